"""MaxText's documents and tokens for :mod:`integrations.maxtext.text_data`: files read by index, tokenized as MaxText.

* :class:`ArrayRecordDocuments`: ``grain_file_type: arrayrecord`` files of
  serialized ``tf.train.Example`` records, read with grain's
  ``ArrayRecordDataSource`` and parsed with MaxText's ``ParseFeatures`` /
  ``NormalizeFeatures`` (its bundled ``example_pb2``: no TensorFlow).
* :class:`ParquetDocuments`: ``grain_file_type: parquet`` files (and
  ``dataset_type: hf`` with ``hf_path: parquet``), read with pyarrow one row
  group at a time and filtered with MaxText's ``KeepFeatures``.
* :class:`Tokenizer`: MaxText's tokenizer code
  (``data_processing_utils.get_tokenizer_and_pad_id`` for grain, the Hugging
  Face pipeline's ``AutoTokenizer`` and ``input_pipeline_utils.tokenization``
  for ``hf``), built lazily in each process.

Document ``d`` is record ``d`` of the files' concatenation. Each reader is
picklable (no open file in its pickled state) and reads only what it is
asked for.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

import elastic

__all__ = ["ArrayRecordDocuments", "ParquetDocuments", "Tokenizer", "Unshipped", "enum_value"]

_ROW_GROUP_CACHE = 4  # decoded Parquet row groups a process keeps


class Unshipped:
    """Pickles without what each process builds for itself: the attributes in ``_unshipped`` (name -> a
    factory of the empty value: caches, open files, a loaded model) start empty, and ``_lock`` anew."""

    _unshipped: tuple[tuple[str, Any], ...] = ()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update({name: empty() for name, empty in self._unshipped})
        state.pop("_lock", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


def enum_value(x: Any) -> Any:
    """A MaxText config value, its enums as their values."""
    return getattr(x, "value", x)


# --------------------------------------------------------------------------- documents


class ArrayRecordDocuments:
    """Documents of ArrayRecord files of serialized ``tf.train.Example`` records, as MaxText's grain pipeline reads
    them (grain's ``ArrayRecordDataSource``, MaxText's ``ParseFeatures`` and ``NormalizeFeatures``).

    ``read(indices)`` gives column ``column`` of those records: a ``str`` (``tokenize``) or int32 token ids.
    grain's source counts the records once, in the client; it opens readers lazily in each process and pickles
    without them.
    """

    def __init__(self, files: Sequence[str], column: str, tokenize: bool, *, tokenize_key: str = "tokenize_train_data"):
        import grain.python as grain

        self.files = [str(f) for f in files]
        self.column = column
        self.tokenize = bool(tokenize)
        self.tokenize_key = tokenize_key
        self._source = grain.ArrayRecordDataSource(self.files)

    def __len__(self) -> int:
        return len(self._source)

    def read(self, indices: Sequence[int]) -> list[Any]:
        from maxtext.input_pipeline import input_pipeline_utils as ipu

        records = self._source.__getitems__([int(i) for i in indices])
        parse = ipu.ParseFeatures([self.column], self.tokenize)
        normalize = ipu.NormalizeFeatures([self.column], self.tokenize)
        out = []
        for index, record in zip(indices, records):
            parsed = parse.map(record)
            if self.tokenize != (parsed[self.column].dtype == object):
                raise ValueError(_wrong_kind(self.tokenize, self.column, f"record {index}", self.tokenize_key))
            value = normalize.map(parsed)[self.column]
            out.append(value if self.tokenize else np.asarray(value, np.int32))
        return out

    def __repr__(self) -> str:
        return f"ArrayRecordDocuments({len(self.files)} file(s), {len(self)} records, column={self.column!r})"


class ParquetDocuments(Unshipped):
    """Documents of Parquet files: column ``column`` of each row, read with pyarrow one row group at a time and
    checked with MaxText's ``KeepFeatures`` (values as grain's ``ParquetIterDataset`` gives them).

    The client reads each file's metadata once (rows per row group); a process opens files lazily and keeps a few
    decoded row groups. Pickling drops open files and caches.
    """

    _unshipped = (("_files", dict), ("_cache", collections.OrderedDict))   # open files, decoded row groups

    def __init__(self, files: Sequence[str], column: str, tokenize: bool):
        import pyarrow.parquet as pq

        self.files = [str(f) for f in files]
        self.column = column
        self.tokenize = bool(tokenize)
        starts, groups = [], []   # global first row of each (file, row group)
        total = 0
        for f, path in enumerate(self.files):
            meta = pq.ParquetFile(path).metadata
            names = meta.schema.to_arrow_schema().names
            if column not in names:
                raise elastic.ConfigError(f"config key 'train_data_columns': column {column!r} is not in {path} "
                                          f"(columns {names}); set train_data_columns=[COLUMN]")
            for g in range(meta.num_row_groups):
                rows = meta.row_group(g).num_rows
                if rows:
                    starts.append(total)
                    groups.append((f, g))
                    total += rows
        self._starts = np.asarray(starts, np.int64)
        self._groups = np.asarray(groups, np.int64).reshape(-1, 2)
        self._len = total
        self._files: dict[int, Any] = {}
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._len

    def read(self, indices: Sequence[int]) -> list[Any]:
        from maxtext.input_pipeline import input_pipeline_utils as ipu

        keep = ipu.KeepFeatures(feature_names=[self.column], tokenize=self.tokenize)
        out = []
        for index in indices:
            index = int(index)
            if not 0 <= index < self._len:
                raise IndexError(f"document {index} of {self._len}")
            k = int(np.searchsorted(self._starts, index, side="right")) - 1
            value = self._row_group(k)[index - int(self._starts[k])]
            value = keep.map({self.column: value})[self.column]
            out.append(value if self.tokenize else np.asarray(value, np.int32))
        return out

    def _row_group(self, k: int) -> np.ndarray:
        with self._lock:
            cached = self._cache.get(k)
            if cached is not None:
                self._cache.move_to_end(k)
                return cached
            f, g = (int(x) for x in self._groups[k])
            handle = self._files.get(f)
            if handle is None:
                import pyarrow.parquet as pq

                handle = self._files[f] = pq.ParquetFile(self.files[f])
            values = handle.read_row_group(g, columns=[self.column]).column(0).to_numpy()
            self._cache[k] = values
            while len(self._cache) > _ROW_GROUP_CACHE:
                self._cache.popitem(last=False)
            return values

    def __repr__(self) -> str:
        return f"ParquetDocuments({len(self.files)} file(s), {self._len} rows, column={self.column!r})"


def _wrong_kind(tokenize: bool, column: str, where: str, key: str = "tokenize_train_data") -> str:
    if tokenize:
        return (f"{key}=true but column {column!r} of {where} holds token ids; set {key}=false for a pre-tokenized "
                "dataset")
    return f"{key}=false but column {column!r} of {where} holds text; set {key}=true to tokenize it"


# --------------------------------------------------------------------------- tokens


@dataclasses.dataclass
class Tokenizer(Unshipped):
    """MaxText's tokenizer, built lazily in each process from its config keys (pickling drops the model).

    ``pipeline="grain"``: ``get_tokenizer_and_pad_id`` (``tokenizer_type`` sentencepiece, huggingface or
    tiktoken); :meth:`encode` gives all tokens. ``pipeline="hf"``: the Hugging Face pipeline's ``AutoTokenizer``
    and ``tokenization`` with truncation to ``max_length`` (MaxText ignores ``tokenizer_type`` there).
    """

    _unshipped = (("_model", lambda: None),)   # the tokenizer itself, built in each process

    path: str
    type: str
    add_bos: bool
    add_eos: bool
    access_token: str | None = dataclasses.field(default=None, repr=False)
    pipeline: str = "grain"
    max_length: int = 0

    def __post_init__(self):
        self._model = None
        self._lock = threading.Lock()

    def _built(self):
        if self._model is None:
            with self._lock:
                if self._model is None:
                    self._model = self._build()
        return self._model

    def _build(self):
        if self.pipeline == "hf":
            import transformers
            from maxtext.input_pipeline.hf_data_processing import _get_pad_id

            model = transformers.AutoTokenizer.from_pretrained(
                self.path, add_bos_token=self.add_bos, add_eos_token=self.add_eos, legacy=False,
                token=self.access_token, extra_special_tokens={})
            pad = _get_pad_id(model)
            return model, pad, [pad, model.bos_token_id], len(model)
        from types import SimpleNamespace

        from maxtext.input_pipeline import data_processing_utils

        keys = SimpleNamespace(tokenizer_path=self.path, tokenizer_type=self.type, add_bos=self.add_bos,
                               add_eos=self.add_eos, hf_access_token=self.access_token)
        model, pad = data_processing_utils.get_tokenizer_and_pad_id(keys)
        if self.type == "sentencepiece":
            vocab = model._tokenizer_model.GetPieceSize()
        elif self.type == "huggingface":
            vocab = len(model.tokenizer)
        else:
            vocab = model.model.n_vocab
        return model, pad, [pad], int(vocab)

    @property
    def pad_id(self) -> int:
        """MaxText's pad id for this tokenizer (its pad id, else its unk id, else 0; -1 for some)."""
        return int(self._built()[1])

    @property
    def ignored_ids(self) -> list:
        """The ids MaxText's ``ShiftData`` masks out of the targets."""
        return list(self._built()[2])

    @property
    def vocabulary(self) -> int:
        """How many token ids the tokenizer can produce."""
        return self._built()[3]

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text``, as MaxText's pipeline makes them (before trimming for grain)."""
        model = self._built()[0]
        if self.pipeline == "hf":
            from maxtext.input_pipeline import input_pipeline_utils as ipu

            tokens = ipu.tokenization({"t": text}, hf_tokenizer=model, truncation=True, max_length=self.max_length,
                                      column_names=["t"])["t"]
        else:
            tokens = model.encode(text)
        return np.asarray(tokens, np.int32)


