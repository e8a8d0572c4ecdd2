"""The packed-row index of :mod:`integrations.maxtext.text_data`: which pieces of which documents fill each row.

Built once in the client from every element's token count (:meth:`PackedIndex.build`): elements (a document,
or one chunk of one) in order, packed into rows of ``max_target_length`` as grain's ``FirstFitPackIterDataset``
(or ``BestFitPackIterDataset``) packs them: groups of :data:`PACKING_BINS` rows, each element into the first
(best) row it fits, honouring ``max_segments_per_seq``; with packing off a row is one element. Pure numpy, no
I/O: a few arrays (about 25 bytes per element) that ship in the pickled source.
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["PACKING_BINS", "PackedIndex"]

PACKING_BINS = 128
"""Rows per packing group (grain's ``num_packing_bins``; MaxText uses its local batch size)."""


@dataclasses.dataclass
class PackedIndex:
    """Which tokens make up each row: elements (a document's tokens ``start .. start + length``) and rows (a list of
    elements each, as CSR: row ``r`` is ``row_elements[row_offsets[r]:row_offsets[r + 1]]``, in segment order)."""

    element_doc: np.ndarray      # int64, document of each element
    element_start: np.ndarray    # int32, first token of the element in its document
    element_length: np.ndarray   # int32, tokens of the element (<= max_target_length)
    row_offsets: np.ndarray      # int64, rows + 1
    row_elements: np.ndarray     # int64
    documents: int               # documents read

    @property
    def rows(self) -> int:
        return len(self.row_offsets) - 1

    def row(self, r: int) -> np.ndarray:
        return self.row_elements[self.row_offsets[r]:self.row_offsets[r + 1]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.element_doc, self.element_start, self.element_length, self.row_offsets,
                                      self.row_elements))

    @classmethod
    def build(cls, doc_lengths: np.ndarray, length: int, *, packing: bool, chunk: bool, order: np.ndarray | None = None,
              max_segments: int | None = None, best_fit: bool = False, bins: int = PACKING_BINS) -> PackedIndex:
        """The index for documents of ``doc_lengths`` tokens (all of them; ``chunk``: cut into pieces of ``length``,
        else the first ``length``), taken in ``order`` (default: as given)."""
        doc_lengths = np.asarray(doc_lengths, np.int64)
        order = np.arange(len(doc_lengths), dtype=np.int64) if order is None else np.asarray(order, np.int64)
        n = doc_lengths[order]
        if chunk:   # TokenizeAndChunk: ceil(n / length) pieces, none for an empty document
            pieces = -(-n // length)
            doc = np.repeat(order, pieces)
            first = np.repeat(np.cumsum(pieces) - pieces, pieces)
            start = (np.arange(len(doc), dtype=np.int64) - first) * length
            size = np.minimum(doc_lengths[doc] - start, length)
        else:
            doc, start, size = order, np.zeros(len(order), np.int64), np.minimum(n, length)
        if packing:
            offsets, members = _pack(size, length, bins=bins, max_segments=max_segments, best_fit=best_fit)
        else:
            offsets, members = np.arange(len(doc) + 1, dtype=np.int64), np.arange(len(doc), dtype=np.int64)
        return cls(doc.astype(np.int64), start.astype(np.int32), size.astype(np.int32), offsets, members,
                   len(doc_lengths))


def _pack(sizes: np.ndarray, length: int, *, bins: int, max_segments: int | None, best_fit: bool):
    """Grain's first-fit (best-fit) packing of elements of ``sizes`` into groups of ``bins`` rows, without bin
    shuffling: rows as CSR ``(offsets, elements)``."""
    offsets, members = [0], []
    used = np.zeros(bins, np.int64)
    count = np.zeros(bins, np.int64)
    rows: list[list[int]] = [[] for _ in range(bins)]

    def emit():
        for r in range(bins):
            if rows[r]:
                members.extend(rows[r])
                offsets.append(len(members))
                rows[r] = []
        used[:] = 0
        count[:] = 0

    for e, size in enumerate(sizes.tolist()):
        fits = used + size <= length
        if max_segments:
            fits &= count < max_segments
        if not fits.any():
            emit()
            fits = used + size <= length
        r = int(np.argmax(np.where(fits, used, -1))) if best_fit else int(np.argmax(fits))
        used[r] += size
        count[r] += 1
        rows[r].append(e)
    emit()
    return np.asarray(offsets, np.int64), np.asarray(members, np.int64)
