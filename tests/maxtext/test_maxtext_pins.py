"""The MaxText the integration is written against: the pinned version, and the private names it reaches into.

``integrations/maxtext`` calls a few private MaxText functions (``pyconfig._load_config``,
``pyconfig._initialize_pydantic``, ``_make_packed_segment_ids``, ...) and reads a private attribute of
MaxText's tokenizer. A MaxText upgrade may drop or change any of them without notice, so these tests fail
loudly, naming the name and the file that uses it:

* the installed MaxText is the one ``integrations/maxtext/requirements.txt`` pins (and ``MAXTEXT_VERSION``);
* every MaxText import in ``integrations/maxtext/*.py`` resolves (module and name);
* every private MaxText name the integration uses still exists, and the functions among them still take the
  parameters the integration passes (:data:`SIGNATURES`).

The private uses are found by scanning the integration's source (``ast``), not listed by hand: a new one
fails here until it is given an expected signature (a function) or a check (an attribute of a MaxText object,
which the scan cannot resolve: :data:`INSTANCE_ATTRIBUTES`).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.metadata
import importlib.util
import inspect
import pathlib
import re

import pytest

pytest.importorskip("maxtext")   # the MaxText integration's requirements (integrations/maxtext/requirements.txt)

ROOT = pathlib.Path(__file__).resolve().parents[2]
INTEGRATION = ROOT / "integrations" / "maxtext"
REQUIREMENTS = INTEGRATION / "requirements.txt"

# Private MaxText functions the integration calls -> the parameters it passes, in order (positionally or by
# these names). The function must still take them first, and need no other argument.
SIGNATURES: dict[str, tuple[str, ...]] = {
    "maxtext.configs.pyconfig._load_config": ("config_name",),
    "maxtext.configs.pyconfig._initialize_pydantic": ("argv",),
    "maxtext.input_pipeline.synthetic_data_processing._make_packed_segment_ids":
        ("batch_size", "seq_len", "max_segments_per_seq"),
    "maxtext.input_pipeline.hf_data_processing._get_pad_id": ("tokenizer",),
}


def _sentencepiece_tokenizer_model():
    """documents.py: ``model._tokenizer_model.GetPieceSize()`` on the tokenizer MaxText builds for
    ``tokenizer_type: sentencepiece`` (MaxText's ``SentencePieceTokenizer``: no public vocabulary size)."""
    from types import SimpleNamespace

    from maxtext.input_pipeline import data_processing_utils

    path = pathlib.Path(importlib.util.find_spec("maxtext").submodule_search_locations[0], "assets", "tokenizers",
                        "tokenizer.llama2")
    keys = SimpleNamespace(tokenizer_path=str(path), tokenizer_type="sentencepiece", add_bos=True, add_eos=False,
                           hf_access_token="")
    model, _ = data_processing_utils.get_tokenizer_and_pad_id(keys)
    assert hasattr(model, "_tokenizer_model"), f"{type(model).__qualname__} has no _tokenizer_model"
    assert model._tokenizer_model.GetPieceSize() == 32000, "llama2's sentencepiece vocabulary is 32000 pieces"


# Private attributes of MaxText objects (not modules): (file, attribute) -> a check that MaxText still has it.
INSTANCE_ATTRIBUTES = {("documents.py", "_tokenizer_model"): _sentencepiece_tokenizer_model}


@dataclasses.dataclass(frozen=True)
class Use:
    """One use of a MaxText name in the integration's source."""

    file: str          # relative to the repository root
    line: int
    target: str        # dotted: module path, then attributes ("maxtext.configs.pyconfig._load_config")
    module: str        # the importable module the target starts from
    resolved: bool = True   # False: a private attribute of a value the scan cannot type (INSTANCE_ATTRIBUTES)

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _dotted(node) -> list[str] | None:
    """``a.b.c`` as ["a", "b", "c"]; None when the chain does not start with a name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def scan(path: pathlib.Path) -> tuple[list[Use], list[Use]]:
    """(every MaxText import of ``path``, every use of a private name there that may be MaxText's)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    file = str(path.relative_to(ROOT))
    aliases: dict[str, tuple[str, str]] = {}   # local name -> (dotted MaxText target, its module)
    others: set[str] = set()                   # local names bound by imports of other packages
    imports, private = [], []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                local = a.asname or a.name.split(".")[0]
                if a.name.split(".")[0] != "maxtext":
                    others.add(local)
                    continue
                imports.append(Use(file, node.lineno, a.name, a.name))
                aliases[local] = (a.name, a.name) if a.asname else ("maxtext", "maxtext")
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                local = a.asname or a.name
                if node.module.split(".")[0] != "maxtext":
                    others.add(local)
                    continue
                sub = f"{node.module}.{a.name}"
                module = sub if _is_module(sub) else node.module
                use = Use(file, node.lineno, sub, module)
                imports.append(use)
                aliases[local] = (sub, module)
                if any(_is_private(p) for p in sub.split(".")):
                    private.append(use)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
            continue
        chain = _dotted(node)
        if chain is None or chain[0] in ("self", "cls") or chain[0] in others:
            continue
        if chain[0] in aliases:
            target, module = aliases[chain[0]]
            private.append(Use(file, node.lineno, ".".join([target, *chain[1:]]), module))
        else:   # a private attribute of some value (a MaxText object, perhaps): INSTANCE_ATTRIBUTES
            private.append(Use(file, node.lineno, ".".join(chain), "", resolved=False))
    return imports, private


def all_uses() -> tuple[list[Use], list[Use]]:
    imports, private = [], []
    for path in sorted(INTEGRATION.glob("*.py")):
        i, p = scan(path)
        imports += i
        private += p
    return imports, private


def resolve(use: Use):
    """The object ``use.target`` names, imported as the integration imports it."""
    obj = importlib.import_module(use.module)
    rest = use.target[len(use.module):].lstrip(".")
    for part in filter(None, rest.split(".")):
        obj = getattr(obj, part)
    return obj


def test_installed_maxtext_is_the_pinned_one():
    from integrations.maxtext.config import MAXTEXT_VERSION

    pins = re.findall(r"^maxtext==(\S+)\s*$", REQUIREMENTS.read_text(), flags=re.M)
    assert len(pins) == 1, f"{REQUIREMENTS.relative_to(ROOT)} must pin maxtext once (maxtext==X), found {pins}"
    installed = importlib.metadata.version("maxtext")
    assert installed == pins[0], (
        f"MaxText {installed} is installed but {REQUIREMENTS.relative_to(ROOT)} pins maxtext=={pins[0]}: the "
        "integration is written against the pinned version (its private calls are checked in this file)")
    assert MAXTEXT_VERSION == pins[0], (f"integrations/maxtext/config.py says MAXTEXT_VERSION = {MAXTEXT_VERSION!r}, "
                                        f"the requirements pin {pins[0]}")


def test_the_scan_finds_the_private_uses_known_today():
    """The scan itself: it must see the private uses the integration had when this test was written (a scan
    that finds nothing would pass every check below)."""
    _, private = all_uses()
    found = {(pathlib.Path(u.file).name, u.target) for u in private}
    for expected in [("config.py", "maxtext.configs.pyconfig._load_config"),
                     ("data.py", "maxtext.input_pipeline.synthetic_data_processing._make_packed_segment_ids")]:
        assert expected in found, f"the source scan no longer finds {expected}; it found {sorted(found)}"


def test_every_maxtext_import_of_the_integration_resolves():
    imports, _ = all_uses()
    assert imports, "no MaxText import found in integrations/maxtext/*.py"
    broken = []
    for use in imports:
        try:
            resolve(use)
        except (ImportError, AttributeError) as e:
            broken.append(f"{use.where} imports {use.target}: {type(e).__name__}: {e}")
    assert not broken, ("MaxText no longer has names the integration imports (installed MaxText "
                        f"{importlib.metadata.version('maxtext')}):\n" + "\n".join(broken))


def test_every_private_maxtext_name_the_integration_uses_still_exists_with_its_parameters():
    _, private = all_uses()
    by_target: dict[str, list[Use]] = {}
    for use in private:
        by_target.setdefault(use.target, []).append(use)
    problems = []
    for target, uses in by_target.items():
        use, where = uses[0], ", ".join(u.where for u in uses)
        if not use.resolved:
            unknown = [u for u in uses if (pathlib.Path(u.file).name, target.split(".")[-1]) not in INSTANCE_ATTRIBUTES]
            if unknown:
                problems.append(f"{', '.join(u.where for u in unknown)} reads the private attribute {target!r} of a "
                                "value the scan cannot type: if it is MaxText's, add a check to INSTANCE_ATTRIBUTES "
                                f"in {pathlib.Path(__file__).name}")
            continue
        try:
            obj = resolve(use)
        except (ImportError, AttributeError) as e:
            problems.append(f"{target} (used in {where}) is gone from MaxText: {type(e).__name__}: {e}")
            continue
        if not callable(obj) or inspect.isclass(obj) or inspect.ismodule(obj):
            continue
        if target not in SIGNATURES:
            problems.append(f"{target} (used in {where}) is a private MaxText function with no expected "
                            f"parameters: add the parameters the integration passes to SIGNATURES in "
                            f"{pathlib.Path(__file__).name}")
            continue
        params = list(inspect.signature(obj).parameters.values())
        want = SIGNATURES[target]
        got = tuple(p.name for p in params[:len(want)])
        required = [p.name for p in params[len(want):] if p.default is inspect.Parameter.empty
                    and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if got != want or required:
            problems.append(f"{target} (used in {where}) now has the signature {inspect.signature(obj)}; "
                            f"the integration passes {want}" + (f" and not {required}" if required else ""))
    stale = sorted(set(SIGNATURES) - set(by_target))
    if stale:
        problems.append(f"SIGNATURES lists {stale}, which integrations/maxtext/*.py no longer uses: remove them")
    assert not problems, (f"the integration's private MaxText calls do not match MaxText "
                          f"{importlib.metadata.version('maxtext')}:\n" + "\n".join(problems))


@pytest.mark.parametrize("key", sorted(INSTANCE_ATTRIBUTES), ids=lambda k: f"{k[0]}:{k[1]}")
def test_private_attributes_of_maxtext_objects_still_exist(key):
    _, private = all_uses()
    uses = [u for u in private if not u.resolved and (pathlib.Path(u.file).name, u.target.split(".")[-1]) == key]
    assert uses, f"integrations/maxtext/{key[0]} no longer reads {key[1]}: remove it from INSTANCE_ATTRIBUTES"
    try:
        INSTANCE_ATTRIBUTES[key]()
    except Exception as e:  # noqa: BLE001 - any failure is MaxText's object having changed
        pytest.fail(f"{uses[0].where} reads {uses[0].target}, which MaxText {importlib.metadata.version('maxtext')} "
                    f"no longer provides: {type(e).__name__}: {e}")
