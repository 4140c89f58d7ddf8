"""Documents -> rows of at most seq_len tokens, over the whole dataset, offline and deterministic.

A packing is a table of segments (document, start within it, length), int32 [N, 3], and row pointers
int64 [R + 1] (row r holds segments row_ptr[r]:row_ptr[r+1]). Documents in a row never attend to each
other: the collator restarts position ids at every segment and the attention kernels take the boundaries
from there (hfscale.data.dataset).

PACKING:
- `bfd`: best-fit decreasing. Documents longest first (ties by index), each into the open row whose free
  space is the smallest that still fits it, else a new row. Needs every document <= seq_len (overflow
  truncate / drop / split before). Free space per row lives in buckets by size: finding the best fit is one
  vectorised scan of seq_len + 1 counters, so a million documents pack in seconds.
- `wrapped`: documents concatenated in order and cut every seq_len tokens (pre-training style); a document
  cut by a row boundary continues as its own segment in the next row; the last partial row is dropped.
- `none`: one document per row (padded by the collator).

`pack` packs whole arrays (tests, benchmarks, the built-in corpus); the store's merge (hfscale.data.merge) packs
through the same pieces a chunk at a time: `wrapped_cuts` for a slice of documents, `bfd_rows` over int32
lengths, `mixture_copies` drawn a slice at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..util.errors import ConfigError

PACKING = {
    "bfd": "best-fit decreasing over the whole dataset (chat / prompt-completion default)",
    "wrapped": "concatenate and cut every seq_len tokens (text default)",
    "none": "one example per row, padded",
}


@dataclass(frozen=True)
class Packed:
    segments: np.ndarray  # int32 [N, 3]: doc, start, length
    row_ptr: np.ndarray  # int64 [R + 1]
    seq_len: int

    @property
    def rows(self) -> int:
        return len(self.row_ptr) - 1

    @property
    def tokens(self) -> int:
        return int(self.segments[:, 2].sum()) if len(self.segments) else 0

    @property
    def efficiency(self) -> float:
        """Real tokens / token slots (rows x seq_len)."""
        return self.tokens / (self.rows * self.seq_len) if self.rows else 0.0


def pack(lengths: np.ndarray, seq_len: int, how: str, order: np.ndarray | None = None) -> Packed:
    """Pack documents of `lengths` (indexed by document), visiting `order` (default all in index order; a
    mixture repeats documents there)."""
    if how not in PACKING:
        raise ConfigError(f"packing {how!r} not understood; use one of {', '.join(PACKING)}")
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.arange(len(lengths), dtype=np.int64) if order is None else np.asarray(order, dtype=np.int64)
    return {"bfd": _bfd, "wrapped": _wrapped, "none": _none}[how](lengths, order, seq_len)


def _none(lengths, order, seq_len) -> Packed:
    if len(order) and lengths[order].max() > seq_len:
        raise ConfigError(f"a document of {int(lengths[order].max())} tokens does not fit a row of {seq_len}")
    seg = np.stack([order, np.zeros_like(order), lengths[order]], axis=1).astype(np.int32)
    return Packed(seg.reshape(-1, 3), np.arange(len(order) + 1, dtype=np.int64), seq_len)


def _wrapped(lengths, order, seq_len) -> Packed:
    lens = lengths[order]
    starts = np.concatenate([[0], np.cumsum(lens)])
    rows = int(starts[-1] // seq_len)
    doc, start, length, at = wrapped_cuts(order, starts[:-1], lens, rows * seq_len, seq_len)
    seg = np.stack([doc, start, length], axis=1).astype(np.int32)
    row_ptr = np.searchsorted(at, np.arange(0, rows * seq_len + 1, seq_len, dtype=np.int64)).astype(np.int64)
    return Packed(seg.reshape(-1, 3), row_ptr, seq_len)


def wrapped_cuts(doc, at, length, end: int, seq_len: int):
    """Wrapped packing of some documents in order: `doc` ids, `at` where each starts in the concatenation,
    `length`; `end` = rows x seq_len (the part after it is dropped). Returns the segments' (doc, start within the
    document, length, where the segment starts in the concatenation): a document is cut at every multiple of
    seq_len inside it. Any consecutive slice of the documents gives that slice's segments, so a merge can pack
    a chunk at a time."""
    doc, at, length = (np.asarray(x, dtype=np.int64) for x in (doc, at, length))
    keep = (length > 0) & (at < end)
    doc, at, length = doc[keep], at[keep], length[keep]
    stop = np.minimum(at + length, end)
    n = 1 + (stop - 1) // seq_len - at // seq_len  # the document's own start + the row boundaries strictly inside
    which = np.repeat(np.arange(len(doc)), n)
    j = np.arange(len(which)) - np.repeat(np.cumsum(n) - n, n)  # piece j of its document
    first = at[which] // seq_len
    a = np.where(j == 0, at[which], (first + j) * seq_len)
    b = np.minimum((first + j + 1) * seq_len, stop[which])
    return doc[which], a - at[which], b - a, a


def _bfd(lengths, order, seq_len) -> Packed:
    lens = lengths[order]
    row_of, rows = bfd_rows(lens, seq_len)
    by_row = np.lexsort((np.arange(len(lens)), row_of))  # within a row: by position in `order`
    seg = np.stack([order[by_row], np.zeros(len(by_row), dtype=np.int64), lens[by_row]], axis=1).astype(np.int32)
    row_ptr = np.searchsorted(row_of[by_row], np.arange(rows + 1)).astype(np.int64)
    return Packed(seg.reshape(-1, 3), row_ptr, seq_len)


def bfd_rows(lens: np.ndarray, seq_len: int, chunk: int = 1 << 16) -> tuple[np.ndarray, int]:
    """Best-fit decreasing: the row of each entry of `lens` (int32) and the row count. Memory: `lens` plus two
    int32 arrays of its length (the visiting order, the rows); open rows are kept as int32 stacks per free
    space, full ones not at all."""
    from array import array

    if len(lens) and int(lens.max()) > seq_len:
        raise ConfigError(f"a document of {int(lens.max())} tokens does not fit a row of {seq_len}: bfd needs "
                          "overflow truncate, drop or split")
    visit = longest_first(lens, seq_len, chunk)
    count = np.zeros(seq_len + 1, dtype=np.int64)  # open rows by free space
    bucket = [array("i") for _ in range(seq_len + 1)]
    keep_full = bool(len(lens)) and int(lens.min()) == 0  # only an empty document fits a full row
    row_of = np.empty(len(lens), dtype=np.int32)
    rows = 0
    for a in range(0, len(lens), chunk):
        idx = visit[a:a + chunk]
        for i, need in zip(idx.tolist(), lens[idx].tolist()):
            hit = np.flatnonzero(count[need:])
            if len(hit):
                space = need + int(hit[0])
                r = bucket[space].pop()
                count[space] -= 1
            else:
                r, space = rows, seq_len
                rows += 1
            left = space - need
            if left or keep_full:
                bucket[left].append(r)
            count[left] += 1
            row_of[i] = r
    return row_of, rows


def longest_first(lens: np.ndarray, seq_len: int, chunk: int = 1 << 16) -> np.ndarray:
    """Positions of `lens` longest first, ties by position (int32): a counting sort by length, a chunk at a time."""
    n = len(lens)
    counts = np.zeros(seq_len + 1, dtype=np.int64)
    for a in range(0, n, chunk):
        counts += np.bincount(np.asarray(lens[a:a + chunk], dtype=np.int64), minlength=seq_len + 1)
    desc = counts[::-1]
    slot = (np.cumsum(desc) - desc)[::-1].copy()  # where each length's run starts, longest first
    out = np.empty(n, dtype=np.int32)
    for a in range(0, n, chunk):
        piece = np.asarray(lens[a:a + chunk], dtype=np.int64)
        o = np.argsort(-piece, kind="stable")
        ls = piece[o]
        c = np.bincount(ls, minlength=seq_len + 1)
        before = np.cumsum(c[::-1])[::-1] - c  # entries of this chunk longer than each length
        out[slot[ls] + np.arange(len(ls)) - before[ls]] = a + o
        slot += c
    return out


def mixture_order(doc_weight: np.ndarray, seed: int = 0) -> np.ndarray:
    """Documents repeated by their source's weight: floor(w) copies, plus one more for a fixed, seeded
    share (w - floor(w)) of them. Weight 1 everywhere: every document once, in order."""
    w = np.asarray(doc_weight, dtype=np.float64)
    if np.all(w == 1.0):
        return np.arange(len(w), dtype=np.int64)
    return np.repeat(np.arange(len(w), dtype=np.int64), mixture_copies(w, np.random.default_rng(seed)))


def mixture_copies(doc_weight: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Copies of each document under mixture_order, one draw of `rng` per document: consecutive slices of the
    documents, drawn in order from one generator, give the whole dataset's copies."""
    w = np.asarray(doc_weight, dtype=np.float64)
    whole = np.floor(w).astype(np.int64)
    return whole + (rng.random(len(w)) < (w - whole))
