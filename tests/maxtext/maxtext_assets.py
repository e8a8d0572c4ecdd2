"""What the MaxText data tests share: the bundled tiny config, MaxText's own tokenizers (from its package: nothing
downloads) and a view of a MaxText config with some keys changed. Imports MaxText: import it after
``pytest.importorskip("maxtext")``."""

import pathlib

import maxtext

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = ROOT / "integrations" / "maxtext" / "configs" / "tiny.yml"
TOKENIZERS = pathlib.Path(maxtext.__file__).parent / "assets" / "tokenizers"
LLAMA2 = TOKENIZERS / "tokenizer.llama2"   # sentencepiece, 32000 pieces, pad id -1 (MaxText pads with -1)
QWEN3 = TOKENIZERS / "qwen3-tokenizer"     # a Hugging Face tokenizer directory
LENGTH = 32                                # max_target_length of these tests


class Over:
    """MaxText's config with some keys changed (only read here), so most tests share one load of it."""

    def __init__(self, mt, **keys):
        self._mt, self._keys = mt, keys

    def __getattr__(self, key):
        return self._keys[key] if key in self._keys else getattr(self._mt, key)
