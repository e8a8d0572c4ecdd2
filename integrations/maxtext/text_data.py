"""MaxText's text pipelines (``dataset_type: grain`` and ``hf``, local or gs:// files) as indexable sources.

jax-elastic's contract (:mod:`elastic.data`): ``source.batch(step, microbatch)``
is a pure function of its arguments on any process, at any time, in any order.
MaxText's own pipelines are stateful iterators per host (grain ``IterDataset``
chains: shuffle, tokenize, pack, batch, shift), so they cannot serve it; this
module serves the same rows by index instead.

Design:

* **Documents.** ``grain_file_type: arrayrecord`` files hold serialized
  ``tf.train.Example`` records, read with grain's ``ArrayRecordDataSource``
  and parsed with MaxText's ``ParseFeatures`` / ``NormalizeFeatures`` (its
  bundled ``example_pb2``: no TensorFlow). ``grain_file_type: parquet`` files
  (and ``dataset_type: hf`` with ``hf_path: parquet``) are read with pyarrow,
  one row group at a time, and filtered with MaxText's ``KeepFeatures``. The
  column is ``train_data_columns`` (one, default ``text``). Files are MaxText's
  glob of ``grain_train_files`` (``hf_train_files``), sorted (MaxText keeps
  ``glob``'s order locally; GCS lists objects sorted): document ``d`` is
  record ``d`` of their concatenation. ``gs://`` files: Parquet by ranged
  reads, ArrayRecord shards fetched into a per-host cache by the process that
  reads them (:mod:`~integrations.maxtext.data_files`).
* **Tokens.** MaxText's tokenizer code: ``data_processing_utils.
  get_tokenizer_and_pad_id`` (``tokenizer_path``, ``tokenizer_type``,
  ``add_bos``, ``add_eos``) for grain, and the Hugging Face pipeline's
  ``AutoTokenizer`` plus ``input_pipeline_utils.tokenization`` (always
  truncated, as MaxText does) for ``hf``. ``use_truncation: true`` keeps the
  first ``max_target_length`` tokens (``TokenizeAndTrim``);
  ``use_truncation: false`` cuts a document into chunks of that length
  (``TokenizeAndChunk``). ``tokenize_train_data: false`` reads token ids.
* **The index**, built once in the client (:meth:`~integrations.maxtext.packing.PackedIndex.build`): every
  document is read and tokenized once to learn its length; the elements (a
  document, or one chunk of one) are put in order (file order, or with
  ``enable_data_shuffling`` a permutation seeded by ``data_shuffle_seed``, as
  MaxText shuffles documents before it packs) and packed into rows of
  ``max_target_length`` the way grain's ``FirstFitPackIterDataset`` (or
  ``BestFitPackIterDataset``, ``grain_packing_type``) packs them: groups of
  :data:`PACKING_BINS` rows, each element into the first (best) row it fits,
  honouring ``max_segments_per_seq`` > 0, all rows of a group emitted when an
  element fits none. With ``packing: false`` a row is one element. The index
  is a few numpy arrays (about 25 bytes per element) and ships in the pickled
  source; the client caches it on disk (:mod:`~integrations.maxtext.index_cache`,
  in :func:`index_cache_dir`), so a restart reads no document.
* **Rows.** Global row ``g`` of ``(step, microbatch m, row i)`` is
  ``g = (step * microbatches + m) * microbatch_size + i``; epoch ``e = g //
  rows``, and row ``g % rows`` (or with shuffling, that entry of a permutation
  of the rows seeded by ``(data_shuffle_seed, e)``, numpy Philox, as
  :class:`elastic.GrainSource`). A worker reads and tokenizes only the
  documents of its rows, packs them as grain does (segment ids ``1..k``,
  positions from 0 in each segment, zeros after) or pads them with MaxText's
  ``PadOrTrimToMaxLength``, and applies MaxText's ``ShiftData`` (next-token
  targets; the last target and targets equal to the pad id, and for ``hf`` the
  BOS id, get segment 0), so a row means what it means in MaxText.

* **Eval data** (``source_for(..., split="eval")``): MaxText's eval keys
  (``grain_eval_files``, ``hf_eval_files``, ``eval_data_columns``,
  ``tokenize_eval_data``), the training batch shapes, no shuffling and one
  epoch, as MaxText's eval iterator: ``steps`` steps, the last one's missing
  rows filled with the pad id as grain's ``batch_and_pad`` fills them.

How the order differs from MaxText's, honestly: MaxText's iterator shuffles
records with grain (ArrayRecord: a global shuffle per epoch; Parquet: files
shuffled, interleaved and window-shuffled), packs the stream into groups of
its local batch size with bins shuffled, and shards by host; its order depends
on the host count and the iterator's state. Here the order depends only on the
files, the config and the seed: the same for any number of slices, processes
or restarts. The same documents share a row in every epoch (rows, not
documents, are reshuffled per epoch), the packing groups are
:data:`PACKING_BINS` rows rather than the batch size, and bins are not
shuffled inside a group. MaxText's ``hf`` pipeline packs with grain's
``PackAndBatchOperation`` (and shuffles with ``datasets``' streaming buffer);
``hf`` rows here are packed like grain's ``first_fit``. Tokens, truncation,
chunking, packing rules, segment and position ids, padding and the shift are
MaxText's.

Refused with one line naming the key (:class:`elastic.ConfigError`): tfds and
the other dataset types, tfrecord/mmap files, mixtures (``;`` in
``grain_train_files``, ``grain_train_mixture_config_path``), the Hugging Face
hub (``hf://``, an empty file key with ``hf_path``), ``hf_path`` other than
``parquet``, ``concat_then_split`` packing, SFT, DPO, distillation, more than
one data column, a ``vocab_size`` smaller than the tokenizer's, and more rows
than ``num_epoch`` epochs hold.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import pathlib
import threading
import time

import numpy as np

import elastic
from integrations.maxtext.data import KEYS, SyntheticSource
from integrations.maxtext.data_files import DataFile, DataFiles
from integrations.maxtext.index_cache import index_key, load_index, save_index
from integrations.maxtext.packing import PACKING_BINS, PackedIndex
from integrations.maxtext.documents import ArrayRecordDocuments, ParquetDocuments, Tokenizer, Unshipped, enum_value

__all__ = ["PACKING_BINS", "PackedIndex", "TextSource", "index_cache_dir", "source_for"]


_TOKEN_CACHE = 1024   # tokenized documents a process keeps (a chunked document spans rows)
_READ_CHUNK = 1024    # documents per read while the client builds the index


# --------------------------------------------------------------------------- the source


class TextSource(Unshipped):
    """MaxText's batch rows of documents, by ``(step, microbatch)`` (see the module docstring).

    Build it with :func:`source_for` (or :meth:`build`). ``batch`` is pure: it depends only on its arguments
    and on what was fixed in the client (files, index, seed, tokenizer).

    A training source (``once=False``) repeats its rows epoch after epoch and has ``steps = None``. An eval
    source (``once=True``, MaxText's eval iterator: one epoch, no shuffling) holds ``steps`` steps, the last
    one's rows past the end filled as MaxText's ``batch_and_pad`` fills a short last batch (every key the pad
    id, so after ``ShiftData`` no target of theirs counts); asking for a later step is a ``ValueError``.
    """

    _unshipped = (("_perms", dict), ("_tokens", collections.OrderedDict))   # caches
    index_origin = ""   # how build() got the packing index: "built (...)" or "read from its cache <file>"

    def __init__(self, documents, tokenizer: Tokenizer, index: PackedIndex, *, length: int, microbatch_size: int,
                 microbatches: int, packing: bool, shuffle_seed: int | None = None, once: bool = False):
        if index.rows < 1:
            raise ValueError("the documents make no rows (every document is empty)")
        self.documents = documents
        self.tokenizer = tokenizer
        self.index = index
        self.length = int(length)
        self.microbatch_size = int(microbatch_size)
        self.microbatches = int(microbatches)
        self.packing = bool(packing)
        self.shuffle_seed = shuffle_seed
        self.once = bool(once)
        per_step = self.microbatches * self.microbatch_size
        self.steps = -(-index.rows // per_step) if self.once else None
        self._perms: dict[int, np.ndarray] = {}
        self._tokens: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def build(cls, documents, tokenizer: Tokenizer, *, length: int, microbatch_size: int, microbatches: int,
              packing: bool = True, chunk: bool = False, shuffle_seed: int | None = None,
              max_segments: int | None = None, best_fit: bool = False, bins: int = PACKING_BINS,
              vocab_size: int | None = None, once: bool = False, cache_dir: str | None = None) -> TextSource:
        """Reads and tokenizes every document once (in this process) and packs them (:class:`PackedIndex`).
        ``once``: one pass over the rows (an eval source, see the class docstring). ``cache_dir``: load the
        index from there if an earlier client built it from the same files, tokenizer and settings (then no
        document is read), else build it and store it there (:mod:`~integrations.maxtext.index_cache`)."""
        settings = dict(length=length, packing=packing, chunk=chunk, shuffle_seed=shuffle_seed,
                        max_segments=max_segments, best_fit=best_fit, bins=bins, vocab_size=vocab_size)
        key = index_key(documents, tokenizer, **settings) if cache_dir else ""
        cached = load_index(cache_dir, key) if cache_dir else None
        if cached is not None:
            index, layout = cached
            try:
                documents.adopt(layout)
            except (KeyError, ValueError):
                cached = None   # not this reader's layout: build anew
            else:
                if index.documents == len(documents):
                    source = cls(documents, tokenizer, index, length=length, microbatch_size=microbatch_size,
                                 microbatches=microbatches, packing=packing, shuffle_seed=shuffle_seed, once=once)
                    source.index_origin = f"read from its cache {os.path.join(cache_dir, key)}.npz"
                    return source
        t0 = time.perf_counter()
        index = cls._index(documents, tokenizer, **settings)
        origin = f"built ({len(documents)} documents read in {time.perf_counter() - t0:.1f} s"
        if cache_dir:
            try:
                save_index(cache_dir, key, index, documents.layout())
                origin += f"), stored in {os.path.join(cache_dir, key)}.npz"
            except OSError as e:   # the cache is an optimisation: the run goes on without it
                logging.getLogger(__name__).warning("could not store the packing index in %s: %s", cache_dir, e)
                origin += f"), not stored: {e.strerror or e}"
        else:
            origin += "; no cache: base_output_directory is not local)"
        source = cls(documents, tokenizer, index, length=length, microbatch_size=microbatch_size,
                     microbatches=microbatches, packing=packing, shuffle_seed=shuffle_seed, once=once)
        source.index_origin = origin
        return source

    @staticmethod
    def _index(documents, tokenizer: Tokenizer, *, length: int, packing: bool, chunk: bool, shuffle_seed: int | None,
               max_segments: int | None, best_fit: bool, bins: int, vocab_size: int | None) -> PackedIndex:
        lengths = np.zeros(len(documents), np.int64)
        top = -1   # the largest token id of pre-tokenized documents
        for lo in range(0, len(documents), _READ_CHUNK):
            ids = range(lo, min(lo + _READ_CHUNK, len(documents)))
            try:
                values = documents.read(ids)
            except ValueError as e:   # MaxText's parsers name the key to change
                raise elastic.ConfigError(f"reading documents {lo}..{ids[-1]}: {' '.join(str(e).split())}") from e
            for d, value in zip(ids, values):
                if isinstance(value, (str, bytes)):
                    lengths[d] = len(tokenizer.encode(value))
                else:
                    lengths[d] = len(value)
                    top = max(top, int(value.max(initial=-1)))
        if vocab_size is not None and top >= vocab_size:
            raise elastic.ConfigError(f"config key 'vocab_size' ({vocab_size}): the pre-tokenized documents hold "
                                      f"token id {top}; set vocab_size >= {top + 1}")
        if not chunk and packing and not documents.tokenize and lengths.max(initial=0) > length:
            d = int(np.argmax(lengths))
            raise elastic.ConfigError(
                f"config key 'packing' (true): document {d} has {lengths[d]} tokens, more than max_target_length "
                f"({length}), and tokenize_train_data=false does not truncate (MaxText's packer refuses it too); "
                "set packing=false (rows are trimmed) or re-tokenize the dataset")
        order = None
        if shuffle_seed is not None:
            order = _rng(shuffle_seed, 0).permutation(len(lengths))
        index = PackedIndex.build(lengths, length, packing=packing, chunk=chunk, order=order,
                                  max_segments=max_segments, best_fit=best_fit, bins=bins)
        if index.rows < 1:
            raise elastic.ConfigError(f"the {len(lengths)} documents of {documents!r} make no rows (none has a "
                                      "token); check the files (grain_train_files, hf_train_files) and "
                                      "train_data_columns")
        return index

    def element_spec(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {k: ((self.microbatch_size, self.length), np.dtype(np.int32)) for k in KEYS}

    def row_index(self, step: int, microbatch: int, i: int) -> int | None:
        """The index row (:class:`PackedIndex`) that is row ``i`` of microbatch ``microbatch`` at ``step``; ``None``
        for a padding row past the end of an eval source."""
        g = (step * self.microbatches + microbatch) * self.microbatch_size + i
        epoch, r = divmod(g, self.index.rows)
        if self.once and epoch:
            return None
        return r if self.shuffle_seed is None else int(self._permutation(epoch)[r])

    def batch(self, step: int, microbatch: int) -> dict[str, np.ndarray]:
        from maxtext.input_pipeline import input_pipeline_utils as ipu

        if step < 0 or not 0 <= microbatch < self.microbatches:
            raise ValueError(f"no microbatch {microbatch} of step {step}: the source has microbatches "
                             f"0..{self.microbatches - 1} of every step >= 0")
        if self.steps is not None and step >= self.steps:
            raise ValueError(f"no step {step}: the eval data holds {self.steps} steps ({self.index.rows} rows)")
        at = [self.row_index(step, microbatch, i) for i in range(self.microbatch_size)]
        real = sum(r is not None for r in at)   # rows past the end of an eval source come last
        rows = [self.index.row(r) for r in at[:real]] or [self.index.row(0)]
        tokens = self._document_tokens(sorted({int(self.index.element_doc[e]) for row in rows for e in row}))
        pieces = [[self._piece(tokens, int(e)) for e in row] for row in rows]
        if self.packing:
            batch = _packed(pieces, self.length)
        else:   # MaxText's PadOrTrimToMaxLength on each element, then its batch
            pad = ipu.PadOrTrimToMaxLength(self.length, self.tokenizer.pad_id)
            padded = [pad.map({"inputs": p[0], "targets": p[0].copy()}) for p in pieces]
            batch = {k: np.stack([row[k] for row in padded]) for k in padded[0]}
        if real < self.microbatch_size:   # MaxText's batch_and_pad: the short last batch, filled with the pad id
            batch = {k: np.concatenate([v[:real], np.full((self.microbatch_size - real, *v.shape[1:]),
                                                          self.tokenizer.pad_id, v.dtype)]) for k, v in batch.items()}
        batch = ipu.ShiftData(ignored_ids=self.tokenizer.ignored_ids, axis=1).map(batch)
        return {k: np.ascontiguousarray(batch[k], dtype=np.int32) for k in KEYS}

    def _piece(self, tokens: dict[int, np.ndarray], e: int) -> np.ndarray:
        start, size = int(self.index.element_start[e]), int(self.index.element_length[e])
        return tokens[int(self.index.element_doc[e])][start:start + size]

    def _document_tokens(self, docs: list[int]) -> dict[int, np.ndarray]:
        with self._lock:
            out = {d: self._tokens[d] for d in docs if d in self._tokens}
        missing = [d for d in docs if d not in out]
        if missing:
            for d, value in zip(missing, self.documents.read(missing)):
                out[d] = self.tokenizer.encode(value) if isinstance(value, (str, bytes)) else value
            with self._lock:
                for d in missing:
                    self._tokens[d] = out[d]
                while len(self._tokens) > _TOKEN_CACHE:
                    self._tokens.popitem(last=False)
        return out

    def _permutation(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            perm = _rng(self.shuffle_seed, 1, epoch).permutation(self.index.rows)
            kept = {e: p for e, p in self._perms.items() if abs(e - epoch) <= 1}
            self._perms = {**kept, epoch: perm}   # rebinding keeps readers in other threads safe
        return perm

    def __repr__(self) -> str:
        return (f"TextSource({self.documents!r}, {self.index.documents} documents in {self.index.rows} rows of "
                f"{self.length}, packing={self.packing}, shuffle_seed={self.shuffle_seed}, "
                + (f"steps={self.steps}, " if self.once else "")
                + f"microbatches={self.microbatches}, microbatch_size={self.microbatch_size})")


def _rng(seed: int, *key: int) -> np.random.Generator:
    return np.random.Generator(np.random.Philox(np.random.SeedSequence([int(seed), *key])))


def _packed(pieces: list[list[np.ndarray]], length: int) -> dict[str, np.ndarray]:
    """Rows as grain's packers write them: tokens, segment ids 1..k and positions from 0, zeros after; inputs and
    targets the same until ``ShiftData``."""
    tokens = np.zeros((len(pieces), length), np.int32)
    segments = np.zeros_like(tokens)
    positions = np.zeros_like(tokens)
    for r, row in enumerate(pieces):
        at = 0
        for k, piece in enumerate(row):
            tokens[r, at:at + len(piece)] = piece
            segments[r, at:at + len(piece)] = k + 1
            positions[r, at:at + len(piece)] = np.arange(len(piece))
            at += len(piece)
    return {"inputs": tokens, "targets": tokens.copy(), "inputs_segmentation": segments,
            "targets_segmentation": segments.copy(), "inputs_position": positions, "targets_position": positions.copy()}


# --------------------------------------------------------------------------- configs


@dataclasses.dataclass(frozen=True)
class _Split:
    """MaxText's keys of one split's data (its train and eval iterators read different keys)."""

    name: str
    grain_files: str      # the grain file pattern key
    hf_files: str         # the hf file pattern key
    columns: str          # the data column key
    tokenize: str         # the "tokenize the column" key


_SPLITS = {
    "train": _Split("train", "grain_train_files", "hf_train_files", "train_data_columns", "tokenize_train_data"),
    "eval": _Split("eval", "grain_eval_files", "hf_eval_files", "eval_data_columns", "tokenize_eval_data"),
}


def source_for(elastic_config: elastic.Config, maxtext_config,
               split: str = "train") -> SyntheticSource | TextSource | None:
    """The data source MaxText's config asks for: :class:`SyntheticSource` for ``dataset_type: synthetic``, a
    :class:`TextSource` for ``grain`` (ArrayRecord or Parquet) and ``hf`` (Parquet); ``elastic.ConfigError``
    naming the key otherwise. Called in the client: reads and tokenizes every document once.

    ``split="eval"``: the data of MaxText's eval iterator, with the training batch shapes (``microbatches`` of
    ``microbatch_size`` rows). Synthetic data: the training source itself (MaxText's eval iterator is the same
    ``SyntheticDataIterator``; ``steps`` is ``None``, it never ends). ``grain``: ``grain_eval_files``; ``hf``:
    ``hf_eval_files`` (MaxText reads them as the split ``train``, whatever ``hf_eval_split`` says); with
    ``eval_data_columns`` and ``tokenize_eval_data``, not shuffled, one epoch (:class:`TextSource` with
    ``once``: ``steps`` steps, the last one padded). ``None`` when the config names no eval files."""
    if split not in _SPLITS:
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    keys = _SPLITS[split]
    mt = maxtext_config
    kind = enum_value(mt.dataset_type)
    if kind == "synthetic":
        return SyntheticSource.from_configs(elastic_config, mt)
    if kind not in ("grain", "hf"):
        raise elastic.ConfigError(
            f"config key 'dataset_type' is {kind!r}: under jax-elastic MaxText's synthetic, grain (ArrayRecord, "
            "Parquet) and hf (Parquet) data are built in; set dataset_type=grain with grain_file_type="
            "arrayrecord or parquet, or bring your data as a jax-elastic data source: make_job(elastic_config, "
            "maxtext_config, data=SOURCE), from Python or from the command line with elastic_trainer=MODULE:FUNCTION, "
            "FUNCTION(elastic_config, maxtext_config) returning that job")
    _refuse_objectives(mt)
    eval_ = split == "eval"
    if eval_:
        pattern = str(getattr(mt, keys.grain_files if kind == "grain" else keys.hf_files, None) or "")
        if not pattern:
            if kind == "grain" and enum_value(mt.grain_file_type) == "parquet" and mt.hf_path:
                raise elastic.ConfigError(
                    f"config key 'grain_eval_files' is empty: MaxText would read hf_path={mt.hf_path!r}'s eval split "
                    "from the Hugging Face hub, which jax-elastic does not; set grain_eval_files=GLOB")
            return None
        per_device = float(getattr(mt, "eval_per_device_batch_size", 0) or 0)
        if per_device and per_device != float(mt.per_device_batch_size):
            raise elastic.ConfigError(
                f"config key 'eval_per_device_batch_size' ({per_device:g}): under jax-elastic eval batches have the "
                f"training batch's shape (per_device_batch_size={mt.per_device_batch_size}); unset it or set it to "
                "per_device_batch_size")
    columns = list(getattr(mt, keys.columns))
    if len(columns) != 1:
        raise elastic.ConfigError(f"config key {keys.columns!r} ({columns!r}): MaxText's pre-training pipeline "
                                  f"reads one text column; set {keys.columns}=[COLUMN]")
    tokenize = bool(getattr(mt, keys.tokenize))
    length = int(mt.max_target_length)
    if kind == "grain":
        file_type = enum_value(mt.grain_file_type)
        if file_type not in ("arrayrecord", "parquet"):
            raise elastic.ConfigError(
                f"config key 'grain_file_type' is {file_type!r}: under jax-elastic only arrayrecord and parquet are "
                "read by index; convert the dataset or set grain_file_type=arrayrecord or parquet")
        if mt.grain_train_mixture_config_path:
            raise elastic.ConfigError(
                f"config key 'grain_train_mixture_config_path' ({mt.grain_train_mixture_config_path!r}): dataset "
                "mixtures are not supported under jax-elastic yet; set it to '' and grain_train_files to one pattern")
        files, store = _files(keys.grain_files, getattr(mt, keys.grain_files), hf_path=mt.hf_path)
        if file_type == "arrayrecord":
            documents = ArrayRecordDocuments(files, columns[0], tokenize, store=store, files_key=keys.grain_files,
                                             tokenize_key=keys.tokenize)
        else:
            documents = ParquetDocuments(files, columns[0], tokenize, store=store, files_key=keys.grain_files,
                                         columns_key=keys.columns)
        tokenizer = Tokenizer(_tokenizer_path(mt.tokenizer_path), str(enum_value(mt.tokenizer_type)), bool(mt.add_bos),
                              bool(mt.add_eos), mt.hf_access_token or None)
        chunk = tokenize and not mt.use_truncation
        packing_type = enum_value(mt.grain_packing_type)
        if mt.packing and packing_type not in ("first_fit", "best_fit"):
            raise elastic.ConfigError(
                f"config key 'grain_packing_type' is {packing_type!r}: under jax-elastic rows are packed first_fit "
                "or best_fit; set grain_packing_type=first_fit (or packing=false)")
        best_fit = packing_type == "best_fit"
    else:
        hf_path = str(mt.hf_path or "")
        if hf_path != "parquet":
            raise elastic.ConfigError(
                f"config key 'hf_path' is {hf_path!r}: under jax-elastic dataset_type=hf reads only Parquet files, "
                f"local or gs:// (hf_path=parquet, {keys.hf_files}=GLOB), without the datasets package; set "
                "hf_path=parquet, "
                f"or dataset_type=grain grain_file_type=parquet {keys.grain_files}=GLOB")
        for key in ("hf_name", "hf_data_dir"):
            if getattr(mt, key, None):
                raise elastic.ConfigError(f"config key {key!r} ({getattr(mt, key)!r}) has no meaning for "
                                          f"Parquet files under jax-elastic; set it to ''")
        if not eval_ and str(mt.train_split) != "train":
            raise elastic.ConfigError(f"config key 'train_split' ({mt.train_split!r}): files given by "
                                      "hf_train_files are the 'train' split; set train_split=train")
        files, store = _files(keys.hf_files, getattr(mt, keys.hf_files) or "")
        documents = ParquetDocuments(files, columns[0], tokenize, store=store, files_key=keys.hf_files,
                                     columns_key=keys.columns)
        tokenizer = Tokenizer(_tokenizer_path(mt.tokenizer_path), "huggingface", bool(mt.add_bos), bool(mt.add_eos),
                              mt.hf_access_token or None, pipeline="hf", max_length=length)
        chunk, best_fit = False, False   # MaxText's hf pipeline always truncates
    _check_vocabulary(tokenizer, mt)
    max_segments = int(mt.max_segments_per_seq or 0)
    seed = int(mt.data_shuffle_seed) if mt.enable_data_shuffling and not eval_ else None   # MaxText: eval unshuffled
    source = TextSource.build(documents, tokenizer, length=length, microbatch_size=elastic_config.microbatch_size,
                              microbatches=elastic_config.microbatches, packing=bool(mt.packing), chunk=chunk,
                              shuffle_seed=seed, max_segments=max_segments if max_segments > 0 and not best_fit
                              else None, best_fit=best_fit, vocab_size=int(mt.vocab_size), once=eval_,
                              cache_dir=index_cache_dir(elastic_config))
    if not eval_:
        _check_epochs(source, elastic_config, mt)
    return source


def index_cache_dir(elastic_config: elastic.Config) -> str | None:
    """Where the client keeps packing indexes: ``<base_output_directory>/.data_index`` (shared by every run
    there, so a restarted client and another run on the same data both find it, and on the client's host,
    where the index is built); ``None`` (no cache) for a ``gs://`` output directory."""
    base = str(elastic_config.base_output_directory or "")
    if not base or "://" in base:
        return None
    return str(pathlib.Path(base).expanduser().resolve() / ".data_index")


def _refuse_objectives(mt) -> None:
    for key in ("use_sft", "use_dpo", "use_multimodal", "is_offline_distillation"):
        if getattr(mt, key, False):
            raise elastic.ConfigError(f"config key {key!r} (true) is not supported with real data under jax-elastic "
                                      "yet: only MaxText's pre-training pipeline is; set it to false")


def _files(key: str, pattern: str, *, hf_path: str = "") -> tuple[list[DataFile], DataFiles]:
    """MaxText's glob of a file pattern (``find_data_files``: local, or ``gs://`` with GCS's glob), sorted, and the
    store that reads them; ConfigError naming ``key`` otherwise."""
    pattern = str(pattern or "")
    if not pattern:
        hint = f" (MaxText would read hf_path={hf_path!r} from the Hugging Face hub)" if hf_path else ""
        raise elastic.ConfigError(f"config key {key!r} is empty{hint}: set it to a glob of local or gs:// files")
    if ";" in pattern:
        raise elastic.ConfigError(f"config key {key!r} ({pattern!r}) is a mixture ('pattern,weight;...'): mixtures "
                                  "are not supported under jax-elastic yet; set it to one pattern")
    store = DataFiles(key)
    return store.glob(pattern), store


def _tokenizer_path(path: str | None) -> str:
    """``tokenizer_path`` as MaxText resolves it: as given, else a tokenizer of that name bundled with MaxText."""
    path = str(path or "")
    if not path:
        raise elastic.ConfigError("config key 'tokenizer_path' is empty: real data needs MaxText's tokenizer (even "
                                  "pre-tokenized data, for its pad id); set tokenizer_path=PATH")
    if os.path.exists(path):
        return path
    import maxtext

    bundled = pathlib.Path(maxtext.__file__).parent / "assets" / "tokenizers" / os.path.basename(path)
    return str(bundled) if bundled.exists() else path


def _check_vocabulary(tokenizer: Tokenizer, mt) -> None:
    try:
        vocab = tokenizer.vocabulary
    except Exception as e:  # noqa: BLE001 - MaxText's loaders raise ValueError, OSError, ...
        text = " ".join(str(e).split())[:300]
        raise elastic.ConfigError(f"config key 'tokenizer_path' ({tokenizer.path!r}): MaxText could not load the "
                                  f"tokenizer: {type(e).__name__}: {text}") from e
    if vocab > int(mt.vocab_size):
        raise elastic.ConfigError(f"config key 'vocab_size' ({mt.vocab_size}) is smaller than the vocabulary of "
                                  f"tokenizer_path {tokenizer.path!r} ({vocab} tokens); set vocab_size >= {vocab}")


def _check_epochs(source: TextSource, ec: elastic.Config, mt) -> None:
    epochs = int(mt.num_epoch)
    need = int(ec.steps) * ec.microbatches * ec.microbatch_size
    if epochs > 0 and need > epochs * source.index.rows:
        want = math.ceil(need / source.index.rows)
        raise elastic.ConfigError(
            f"config key 'num_epoch' ({epochs}): {ec.steps} steps of {ec.microbatches * ec.microbatch_size} rows "
            f"need {need} rows, but the {source.index.documents} documents make {source.index.rows} rows an epoch; "
            f"set num_epoch >= {want} (or fewer steps)")

