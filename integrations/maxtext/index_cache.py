"""The packing index of :mod:`integrations.maxtext.text_data`, kept on disk so a client builds it once per dataset.

Building the index reads and tokenizes every document (about one tokenization pass over the dataset). A client
that restarts, or another run on the same data, loads it instead: ``<directory>/<key>.npz`` holds the
:class:`~integrations.maxtext.packing.PackedIndex` and what the client learnt of the files (the documents'
``layout``: records per ArrayRecord file, rows per Parquet row group), so a hit reads no document at all.

The key (:func:`index_key`) is a hash of everything the index depends on: each file's path, size and version
(GCS generation, local mtime), the reader (format, column, tokenize), the tokenizer (path and the size and
mtime of its files, type, BOS/EOS, pipeline, truncation length) and every value that changes the packing
(length, packing, chunking, shuffle seed, max segments, best fit, bins, vocabulary size). A changed file or
setting is another key, so a stale index is never found; the key is also stored in the file and checked.

A file is written whole under a temporary name, then renamed (two clients racing both write the same bytes).
A file that does not load, or whose arrays do not make a consistent index, is ignored (and rebuilt and
rewritten by the caller): never trusted. Nothing here imports MaxText or JAX.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import tempfile
import zipfile
from typing import Any

import numpy as np

from integrations.maxtext.packing import PackedIndex

__all__ = ["index_key", "load_index", "save_index"]

_FORMAT = 1   # bump when the file's contents or the index's meaning change
_INDEX_ARRAYS = ("element_doc", "element_start", "element_length", "row_offsets", "row_elements")


def index_key(documents, tokenizer, **settings: Any) -> str:
    """The hex digest naming the index of ``documents`` (an ``ArrayRecordDocuments`` or ``ParquetDocuments``)
    tokenized by ``tokenizer`` and packed with ``settings`` (see the module docstring). Reads no document."""
    what = {
        "format": _FORMAT,
        "reader": type(documents).__name__,
        "column": documents.column,
        "tokenize": documents.tokenize,
        "files": [[f.path, f.size, f.version] for f in documents.files],
        "tokenizer": {**{f.name: getattr(tokenizer, f.name) for f in dataclasses.fields(tokenizer)
                         if f.name != "access_token"}, "stat": _stat(tokenizer.path)},
        "settings": {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in sorted(settings.items())},
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


def _stat(path: str) -> list:
    """Size and mtime of a tokenizer file, or of each file of a tokenizer directory (a name: nothing)."""
    p = pathlib.Path(path)
    try:
        if p.is_dir():
            return [[c.name, c.stat().st_size, c.stat().st_mtime_ns] for c in sorted(p.iterdir()) if c.is_file()]
        st = p.stat()
        return [st.st_size, st.st_mtime_ns]
    except OSError:
        return []


def load_index(directory: str | os.PathLike, key: str) -> tuple[PackedIndex, dict[str, np.ndarray]] | None:
    """``(index, layout)`` stored under ``key``, or ``None`` if there is none, it does not load or it is not a
    consistent index (see the module docstring)."""
    path = pathlib.Path(directory) / f"{key}.npz"
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {name: z[name] for name in z.files}   # zip CRCs are checked as each member is read
    except FileNotFoundError:
        return None
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile):
        return None
    try:
        if str(arrays.pop("key")) != key or int(arrays.pop("format")) != _FORMAT:
            return None
        index = PackedIndex(*(arrays.pop(name) for name in _INDEX_ARRAYS), int(arrays.pop("documents")))
        layout = {name[len("layout_"):]: arrays[name] for name in arrays if name.startswith("layout_")}
    except (KeyError, ValueError, TypeError):
        return None
    return (index, layout) if _consistent(index) else None


def _consistent(index: PackedIndex) -> bool:
    """Whether the arrays make an index whose every row and element points inside the others."""
    n = len(index.element_doc)
    offsets, members = index.row_offsets, index.row_elements
    return (index.element_start.shape == index.element_length.shape == (n,) and offsets.ndim == members.ndim == 1
            and len(offsets) >= 2 and offsets[0] == 0 and offsets[-1] == len(members)
            and bool((np.diff(offsets) >= 0).all())
            and (not len(members) or (0 <= members.min() and members.max() < n))
            and (not n or (0 <= index.element_doc.min() and index.element_doc.max() < index.documents))
            and bool((index.element_start >= 0).all() and (index.element_length >= 0).all()))


def save_index(directory: str | os.PathLike, key: str, index: PackedIndex, layout: dict[str, np.ndarray]) -> None:
    """Writes ``(index, layout)`` under ``key`` atomically (a temporary file renamed into place). A directory
    that cannot be written raises ``OSError`` (the caller warns and goes on)."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    arrays = {name: getattr(index, name) for name in _INDEX_ARRAYS}
    arrays.update({f"layout_{name}": np.asarray(v) for name, v in layout.items()})
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{key}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, key=np.asarray(key), format=np.asarray(_FORMAT), documents=np.asarray(index.documents),
                     **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / f"{key}.npz")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
