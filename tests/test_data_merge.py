"""hfscale.data.merge (issue 36 (b)): the merging rank's memory does not grow with the corpus, and the store it
writes a chunk at a time is byte for byte the whole-array computation's. Synthetic parts (no tokenizer): each test
runs in about a second."""

import io
import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from hfscale.data import merge as merge_mod
from hfscale.data.packing import mixture_order, pack
from hfscale.data.sources import Source
from hfscale.data.store import SPLITS, DataOptions, TokenStore
from hfscale.util import hashing

SEQ_LEN = 256


def write_parts(work: Path, n_parts: int, docs_per_part: int, masked: bool, sources: int = 1, seed: int = 0):
    """Part directories as hfscale.data.parts writes them: train documents of 2-256 tokens (uint16), validation
    empty; `masked`: each document trains only a random tail (else every token); part p belongs to source
    p % sources. Returns the jobs (unit, split) merge reads."""
    rng = np.random.default_rng(seed)
    for p in range(n_parts):
        d = work / f"part-{p:06d}"
        d.mkdir(parents=True)
        lens = rng.integers(2, SEQ_LEN + 1, size=docs_per_part)
        starts = np.cumsum(lens) - lens
        lead = rng.integers(0, lens - 1) if masked else np.zeros_like(lens)  # untrained head; >= 2 tokens train
        rng.integers(0, 4096, size=int(lens.sum()), dtype=np.uint16).tofile(d / "train.tok")
        np.save(d / "train.len.npy", lens.astype(np.int64))
        np.save(d / "train.span.npy", np.stack([starts + lead, starts + lens], axis=1).astype(np.int64))
        (d / "validation.tok").write_bytes(b"")
        np.save(d / "validation.len.npy", np.zeros(0, np.int64))
        np.save(d / "validation.span.npy", np.zeros((0, 2), np.int64))
        counts = {"examples": docs_per_part, "truncated": 0, "dropped": 0, "split": 0}
        (d / "stats.json").write_text(json.dumps({
            "format": "text", "source": p % sources, "file": f"f{p % sources}.jsonl",
            "resolved": {"train_on": "all", "overflow": "split"},
            "splits": {"train": counts, "validation": {k: 0 for k in counts}}}))
    return [(None, "train")] * n_parts


def run_merge(work: Path, jobs, out: Path, packing: str, weights=(1.0,)):
    sources = [Source(f"f{i}.jsonl", w) for i, w in enumerate(weights)]
    opts = DataOptions(SEQ_LEN, format="text", packing=packing)
    return merge_mod.merge(work, jobs, sources, out, "k", opts, 4096, None, packing)


def npy_bytes(arr) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


@pytest.mark.parametrize("packing,masked,weights", [("wrapped", True, (1.5, 1.0)), ("bfd", True, (1.0, 0.5)),
                                                    ("none", False, (1.0,)), ("wrapped", False, (1.0,))])
def test_merge_matches_whole_arrays(tmp_path, monkeypatch, packing, masked, weights):
    """Chunks of 50 documents, parts of 120: every file equals np.save of the whole-array reference (packing.pack
    over all documents, trained tokens counted position by position from the mask), mixture statistics too."""
    monkeypatch.setattr(merge_mod, "CHUNK", 50)
    jobs = write_parts(tmp_path / "work", 5, 120, masked, sources=len(weights))
    info = run_merge(tmp_path / "work", jobs, tmp_path / "store", packing, weights)
    parts = [tmp_path / "work" / f"part-{p:06d}" for p in range(5)]
    lens = np.concatenate([np.load(p / "train.len.npy") for p in parts])
    docs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    base = docs[np.cumsum([0] + [len(np.load(p / "train.len.npy")) for p in parts])[:-1]]
    spans = np.concatenate([np.load(p / "train.span.npy") + b for p, b in zip(parts, base)])
    doc_w = np.concatenate([np.full(120, weights[p % len(weights)]) for p in range(5)])
    ref = pack(lens, SEQ_LEN, packing, mixture_order(doc_w))
    mask = np.zeros(docs[-1], dtype=bool)
    for a, b in spans:
        mask[a:b] = True
    per_seg = [int(mask[docs[d] + s + 1: docs[d] + s + n].sum()) for d, s, n in ref.segments.tolist()]
    row_trained = np.array([sum(per_seg[ref.row_ptr[r]:ref.row_ptr[r + 1]]) for r in range(ref.rows)], dtype=np.int32)
    d = tmp_path / "store" / "train"
    expect = {"docs.npy": docs, "segments.npy": ref.segments[:, :2], "row_ptr.npy": ref.row_ptr,
              "row_trained.npy": row_trained, **({"spans.npy": spans} if masked else {})}
    for name, arr in expect.items():
        assert (d / name).read_bytes() == npy_bytes(arr), name
    assert (d / "spans.npy").exists() == masked
    assert (d / "tokens.bin").read_bytes() == b"".join((p / "train.tok").read_bytes() for p in parts)
    s = info.splits["train"]
    assert (s.rows, s.tokens, s.trained, s.documents) == (ref.rows, ref.tokens, int(row_trained.sum()), len(lens))
    if len(weights) > 1:
        src = (ref.segments[:, 0] // 120) % len(weights)
        assert [x.tokens for x in info.sources] == [int(ref.segments[src == i, 2].sum()) for i in range(len(weights))]
        assert [x.trained for x in info.sources] == [int(np.asarray(per_seg)[src == i].sum()) for i in range(len(weights))]
    v = tmp_path / "store" / "validation"  # an empty split: what np.save wrote for empty arrays
    empty = {"docs.npy": np.zeros(1, np.int64), "segments.npy": np.zeros((0, 2), np.int32),
             "row_ptr.npy": np.zeros(1, np.int64), "row_trained.npy": np.zeros(0, np.int32)}
    assert {n: (v / n).read_bytes() for n in empty} == {n: npy_bytes(a) for n, a in empty.items()}
    assert not (v / "spans.npy").exists() and (v / "tokens.bin").stat().st_size == 0
    for split in SPLITS:  # the store reads back
        TokenStore(tmp_path / "store", split)
    store = TokenStore(tmp_path / "store")
    r = ref.rows // 2
    ids, labels, _ = store.row(r)
    assert int((labels != -100).sum()) == row_trained[r]


def traced_peak(tmp_path: Path, n_parts: int, packing: str, docs: int = 8000) -> int:
    """The merge's peak traced allocation over parts of `docs` masked documents. Its constant buffers are made small
    so they do not hide what grows: merge.CHUNK 4,096 documents, merge.COPY and the file hash's read size 64 KiB
    (8 MiB each in production: bounded, but larger than everything else at these sizes)."""
    jobs = write_parts(tmp_path / f"work{n_parts}", n_parts, docs, masked=True, seed=n_parts)
    tracemalloc.start()
    try:
        run_merge(tmp_path / f"work{n_parts}", jobs, tmp_path / f"store{n_parts}", packing)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.fixture
def small_buffers(tmp_path, monkeypatch):
    monkeypatch.setattr(merge_mod, "CHUNK", 4096)
    monkeypatch.setattr(merge_mod, "COPY", 64 << 10)
    monkeypatch.setattr(hashing, "CHUNK", 64 << 10)
    run_merge(tmp_path / "warm", write_parts(tmp_path / "warm", 1, 10, masked=True), tmp_path / "warm-store", "bfd")
    # ^ once untraced: the lazy imports' allocations would otherwise count in the first measurement only


@pytest.mark.parametrize("packing", ["wrapped", "none"])
def test_merge_memory_does_not_grow_with_documents(tmp_path, small_buffers, packing):
    """8,000 vs 80,000 documents (1M vs 10M tokens): the merge's peak traced allocation (numpy reports its buffers
    to tracemalloc) grows by less than 256 KiB (what grows is the parts' bookkeeping, a few KB per part of up to
    32 MiB of input). The whole-array merge before it grew by ~170 bytes per document here, ~12 MB."""
    small = traced_peak(tmp_path, 1, packing)
    big = traced_peak(tmp_path, 10, packing)
    assert big - small < 256 << 10, (small, big)


def test_merge_memory_bfd_is_int32_per_document(tmp_path, small_buffers):
    """bfd chooses rows over all documents: int32 arrays of one entry per document (lengths, visiting order, rows,
    trained counts: 16 bytes) and the open rows' int32 stacks, nothing else that grows. 4,000 vs 40,000 documents:
    < 24 bytes more per added document (the whole-array merge before it: ~170)."""
    small = traced_peak(tmp_path, 1, "bfd", docs=4000)
    big = traced_peak(tmp_path, 10, "bfd", docs=4000)
    assert (big - small) / 36_000 < 24, (small, big)
