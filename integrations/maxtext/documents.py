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

Files are local or ``gs://`` (:mod:`~integrations.maxtext.data_files`: a
Parquet object by ranged reads, an ArrayRecord shard fetched into this host's
cache first, since array_record reads local paths only). Document ``d`` is
record ``d`` of the files' concatenation. The client learns each reader's
``layout`` (records per file, rows per row group) once, or ``adopt``-s the one
the index cache kept. Each reader is picklable (no open file, fetched path or
client in its pickled state), opens nothing until used and reads only what it
is asked for.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

import elastic
from integrations.maxtext.data_files import DataFile, DataFiles

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


def _data_files(files: Sequence[DataFile | str], store: DataFiles | None, key: str) -> tuple[list[DataFile], DataFiles]:
    """``files`` as :class:`DataFile` (a bare local path is stat'ed) and the store that reads them."""
    out = []
    for f in files:
        if not isinstance(f, DataFile):
            st = os.stat(f)
            f = DataFile(os.path.abspath(f), st.st_size, st.st_mtime_ns)
        out.append(f)
    return out, store if store is not None else DataFiles(key)


class ArrayRecordDocuments(Unshipped):
    """Documents of ArrayRecord files of serialized ``tf.train.Example`` records, as MaxText's grain pipeline reads
    them (grain's ``ArrayRecordDataSource``, MaxText's ``ParseFeatures`` and ``NormalizeFeatures``).

    ``read(indices)`` gives column ``column`` of those records: a ``str`` (``tokenize``) or int32 token ids.
    The client counts each file's records once (:meth:`layout`; a ``gs://`` file is fetched into this host's
    cache for that, see :mod:`~integrations.maxtext.data_files`); a process fetches only the files its
    documents are in, on first use, and opens grain's source over them lazily; pickling drops it.
    """

    _unshipped = (("_source", lambda: None), ("_local", dict))   # grain's source, files fetched to this host

    def __init__(self, files: Sequence[DataFile | str], column: str, tokenize: bool, *,
                 store: DataFiles | None = None, files_key: str = "grain_train_files",
                 tokenize_key: str = "tokenize_train_data"):
        self.files, self.store = _data_files(files, store, files_key)
        self.column = column
        self.tokenize = bool(tokenize)
        self.tokenize_key = tokenize_key
        self._counts: np.ndarray | None = None   # records of each file, from the client
        self._source = None
        self._local: dict[int, str] = {}
        self._lock = threading.Lock()

    def layout(self) -> dict[str, np.ndarray]:
        """What the client learns of the files (records per file): counted once, here, unless :meth:`adopt`-ed."""
        if self._counts is None:
            from array_record.python import array_record_module

            counts = []
            for k in range(len(self.files)):
                reader = array_record_module.ArrayRecordReader(self._local_path(k))
                counts.append(reader.num_records())
                reader.close()
            self._counts = np.asarray(counts, np.int64)
        return {"counts": self._counts}

    def adopt(self, layout: dict[str, np.ndarray]) -> None:
        """Takes the :meth:`layout` a previous client learnt of the same files (the index cache)."""
        counts = np.asarray(layout["counts"], np.int64)
        if counts.shape != (len(self.files),) or (counts < 0).any():
            raise ValueError(f"a layout of {counts.shape} counts for {len(self.files)} files")
        self._counts = counts

    def __len__(self) -> int:
        return int(self.layout()["counts"].sum())

    def _local_path(self, k: int) -> str:
        path = self._local.get(k)
        if path is None:
            path = self._local[k] = self.store.local(self.files[k])
        return path

    def read(self, indices: Sequence[int]) -> list[Any]:
        from maxtext.input_pipeline import input_pipeline_utils as ipu

        indices = [int(i) for i in indices]
        ends = np.cumsum(self.layout()["counts"])
        for k in np.unique(np.searchsorted(ends, indices, side="right")):
            if k < len(self.files):
                self._local_path(int(k))   # fetch the files these documents are in, and only those
        with self._lock:
            if self._source is None:
                import grain.python as grain

                # "path[0:n]": grain's read instruction, so it counts nothing and opens each file when first read
                # (a file of no document read here is never fetched, never opened).
                paths = [f"{self.store.cached_path(file)}[0:{n}]"
                         for file, n in zip(self.files, self._counts.tolist())]
                self._source = grain.ArrayRecordDataSource(paths)
            source = self._source
        records = source.__getitems__(indices)
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

    The client reads each file's metadata once (:meth:`layout`: rows per row group; a ``gs://`` file's footer by
    ranged reads); a process opens files lazily (a ``gs://`` file as ranged reads of one row group's column at a
    time) and keeps a few decoded row groups. Pickling drops open files and caches.
    """

    _unshipped = (("_files", dict), ("_cache", collections.OrderedDict))   # open files, decoded row groups

    def __init__(self, files: Sequence[DataFile | str], column: str, tokenize: bool, *,
                 store: DataFiles | None = None, files_key: str = "grain_train_files",
                 columns_key: str = "train_data_columns"):
        self.files, self.store = _data_files(files, store, files_key)
        self.column = column
        self.tokenize = bool(tokenize)
        self.columns_key = columns_key
        self._starts: np.ndarray | None = None   # global first row of each (file, row group) with rows
        self._groups: np.ndarray | None = None   # (file, row group) of each
        self._len = 0
        self._files: dict[int, Any] = {}
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def layout(self) -> dict[str, np.ndarray]:
        """What the client learns of the files (the rows of each row group): read once, here, unless
        :meth:`adopt`-ed; ConfigError naming the key for a file without the column."""
        if self._starts is None:
            starts, groups = [], []
            total = 0
            for f, file in enumerate(self.files):
                meta = self._open(f).metadata
                names = meta.schema.to_arrow_schema().names
                if self.column not in names:
                    raise elastic.ConfigError(
                        f"config key {self.columns_key!r}: column {self.column!r} is not in {file.path} "
                        f"(columns {names}); set {self.columns_key}=[COLUMN]")
                for g in range(meta.num_row_groups):
                    rows = meta.row_group(g).num_rows
                    if rows:
                        starts.append(total)
                        groups.append((f, g))
                        total += rows
            self.adopt({"starts": np.asarray(starts, np.int64), "groups": np.asarray(groups, np.int64),
                        "rows": np.asarray([total], np.int64)})
        return {"starts": self._starts, "groups": self._groups, "rows": np.asarray([self._len], np.int64)}

    def adopt(self, layout: dict[str, np.ndarray]) -> None:
        """Takes the :meth:`layout` a previous client learnt of the same files (the index cache)."""
        starts = np.asarray(layout["starts"], np.int64)
        groups = np.asarray(layout["groups"], np.int64).reshape(-1, 2)
        rows = int(np.asarray(layout["rows"]).reshape(-1)[0])
        if len(starts) != len(groups) or (len(groups) and not (0 <= groups[:, 0].min() <= groups[:, 0].max()
                                                               < len(self.files))) \
                or (starts.size and (starts[0] != 0 or (np.diff(starts) <= 0).any() or starts[-1] >= rows)):
            raise ValueError("an inconsistent Parquet layout")
        self._starts, self._groups, self._len = starts, groups, rows

    def __len__(self) -> int:
        self.layout()
        return self._len

    def read(self, indices: Sequence[int]) -> list[Any]:
        from maxtext.input_pipeline import input_pipeline_utils as ipu

        self.layout()
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

    def _open(self, f: int):
        import pyarrow.parquet as pq

        file = self.files[f]
        try:
            return pq.ParquetFile(self.store.open(file) if file.remote else file.path)
        except elastic.ConfigError:
            raise
        except (OSError, ValueError) as e:   # pyarrow: not a Parquet file, truncated, unreadable
            raise elastic.ConfigError(f"config key {self.store.key!r}: cannot read {file.path} as Parquet: "
                                      f"{' '.join(str(e).split())[:300]}") from e

    def _row_group(self, k: int) -> np.ndarray:
        with self._lock:
            cached = self._cache.get(k)
            if cached is not None:
                self._cache.move_to_end(k)
                return cached
            f, g = (int(x) for x in self._groups[k])
            handle = self._files.get(f)
            if handle is None:
                handle = self._files[f] = self._open(f)
            values = handle.read_row_group(g, columns=[self.column]).column(0).to_numpy()
            self._cache[k] = values
            while len(self._cache) > _ROW_GROUP_CACHE:
                self._cache.popitem(last=False)
            return values

    def __repr__(self) -> str:
        return f"ParquetDocuments({len(self.files)} file(s), {len(self)} rows, column={self.column!r})"


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


