"""The token store: tokenized once, by every rank together, memory-mapped by every rank after.

A store is a directory (made through a stage and one rename, hfscale.util.atomic):

    manifest.json           key, options, counts, and every file's size + xxh3 (the commit mark)
    train/, validation/     tokens.bin   uint16 (vocabulary <= 65,536) or uint32, all documents end to end
                            docs.npy     int64 [D + 1]  document d is tokens[docs[d]:docs[d+1]]
                            spans.npy    int64 [S, 2]   trained runs [start, end) (absent: every token trained)
                            segments.npy int32 [N, 2]   the packing: (document, start); a segment's length is the
                                                        rest of its document or of its row, whichever ends first
                            row_ptr.npy  int64 [R + 1]  row r = segments[row_ptr[r]:row_ptr[r+1]]
                            row_trained.npy int32 [R]   tokens of row r with a label (what a step's loss divides by)

Bytes per token: 2 (uint16) + 8 per document + 8 per segment + 12 per row (+ 16 per trained run where not every
token trains): 2.085 measured for ~200-token text documents in 2,048-token rows (benchmarks/data_pipeline.md).

The key (xxh3-64) covers the input bytes (every file's content hash, in order, with its mixture weight), the
tokenizer as it tokenizes (its serialized model, special tokens and chat template) and every option that
changes tokens or rows (format, train_on, packing, overflow, seq_len, validation / held-out fraction). A store
whose manifest holds another key is refused in one line, never used.

Building (`prepare`): the input is cut into work units that depend on the files only
(hfscale.data.sources); rank r of `world` tokenizes units r, r + world, ... and writes each as a part
(hfscale.data.parts: staged, renamed) under a work directory beside the store; rank 0 merges the parts in unit
order, packs, and renames the store into place (hfscale.data.merge); the other ranks wait for its manifest. No
accelerate, no process group: ranks coordinate through renames on the shared file system, so the store is the same
bytes at any world size and a part finished before a kill -9 is reused by the next attempt. Memory holds one unit
(<= 32 MiB of input) per rank; the merge works a chunk of documents at a time, so it does not grow with the corpus
either (bfd: int32 arrays over every document, 12-16 bytes per document; benchmarks/data_pipeline.md (b)); reading maps the files.
"""

from __future__ import annotations

import errno
import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..util.errors import ConfigError, HfscaleError
from . import formats, packing, sources as src_mod

STORE_VERSION = 2  # 2: segments without their lengths
MANIFEST = "manifest.json"
SPLITS = ("train", "validation")
OVERFLOW = {"truncate": "keep the first seq_len tokens", "drop": "skip the example",
            "split": "cut into pieces of seq_len tokens, each its own document"}
EXIT_DISK_FULL = 74  # EX_IOERR, as a failed checkpoint save (hfscale.train.state)
# Test seams, empty in production: hook(point, unit_index, rank) after a part is written ("part") and before the
# store is renamed into place ("merge"); tests SIGKILL there. Nothing here reads the environment.
FAULT_HOOKS: list = []


class StoreWriteError(HfscaleError):
    """The disk filled (or failed) while writing a store: nothing half-written was left. Exit EXIT_DISK_FULL."""
    status = EXIT_DISK_FULL


@dataclass(frozen=True)
class DataOptions:
    """Everything besides the input and the tokenizer that changes a store's tokens or rows."""
    seq_len: int
    format: str | None = None  # detected from the columns when None
    train_on: str | None = None  # the format's default when None (formats.DEFAULT_TRAIN_ON)
    packing: str | None = None  # bfd, wrapped, none; None: wrapped for text, bfd otherwise
    overflow: str | None = None  # truncate, drop, split; None: split for text, truncate otherwise
    validation: str | None = None  # a held-out file; else `heldout` of the examples (by content hash)
    heldout: float = 0.05

    def __post_init__(self):
        if self.seq_len < 2:
            raise ConfigError(f"seq_len must be >= 2 (got {self.seq_len})")
        formats.check_train_on(self.format, self.train_on)
        if self.packing is not None and self.packing not in packing.PACKING:
            raise ConfigError(f"packing {self.packing!r} not understood; use one of {', '.join(packing.PACKING)}")
        if self.overflow is not None and self.overflow not in OVERFLOW:
            raise ConfigError(f"overflow {self.overflow!r} not understood; use one of {', '.join(OVERFLOW)}")
        if not 0.0 <= self.heldout < 1.0:
            raise ConfigError(f"heldout must be in [0, 1) (got {self.heldout})")

    def resolved(self, fmt: str, packing: str | None = None) -> dict:
        """The options of one format's data; `packing`: the store's where its sources hold several formats."""
        text = fmt in ("text", "tokenized")
        return {"format": fmt, "train_on": self.train_on or formats.DEFAULT_TRAIN_ON[fmt],
                "packing": self.packing or packing or ("wrapped" if text else "bfd"),
                "overflow": self.overflow or ("split" if text else "truncate"), "seq_len": self.seq_len}

    def store_packing(self, fmts) -> str:
        """One packing for the whole store: as given, else wrapped where every source is text-like, else bfd."""
        return self.packing or ("wrapped" if set(fmts) <= {"text", "tokenized"} else "bfd")


@dataclass(frozen=True)
class SplitStats:
    examples: int = 0
    documents: int = 0
    tokens: int = 0
    trained: int = 0  # tokens with a label in the packed rows (a document's first token never has one)
    truncated: int = 0
    dropped: int = 0
    split: int = 0
    rows: int = 0
    efficiency: float = 0.0  # real tokens / (rows x seq_len)

    @property
    def trained_share(self) -> float:
        return self.trained / self.tokens if self.tokens else 0.0


@dataclass(frozen=True)
class SourceStats:
    """One source of a mixture in the train split: its format and options, its documents [first, end) (a source's
    documents are contiguous: units go in source order), and what its segments put in the rows (weights applied)."""
    path: str
    weight: float
    format: str
    train_on: str
    overflow: str
    examples: int
    documents: tuple
    tokens: int
    trained: int


@dataclass(frozen=True)
class StoreInfo:
    """What `prepare` made or `open_store` found: the manifest, typed."""
    path: Path
    key: str
    options: dict
    dtype: str
    vocab: int
    splits: dict = field(default_factory=dict)  # split -> SplitStats
    bytes: int = 0
    reused: bool = False
    sources: tuple = ()  # SourceStats of a mixture's sources (train split); empty for one source


    def lines(self) -> list[str]:
        o = self.options
        out = [f"{self.path}: key {self.key}, format {o['format']}, train_on {o['train_on']}, packing {o['packing']}, "
               f"overflow {o['overflow']}, seq_len {o['seq_len']}, {self.dtype} tokens (vocabulary {self.vocab:,})"]
        for name, s in self.splits.items():
            out.append(f"  {name}: {s.examples:,} examples, {s.tokens:,} tokens, {s.trained:,} trained "
                       f"({s.trained_share:.1%}), truncated {s.truncated:,} / dropped {s.dropped:,} / split {s.split:,}; "
                       f"{s.rows:,} rows, packing efficiency {s.efficiency:.1%}")
        for i, s in enumerate(self.sources):
            out.append(f"  source {i} {s.path} (weight {s.weight:g}): {s.format}, train_on {s.train_on}, overflow "
                       f"{s.overflow}: {s.examples:,} examples, {s.tokens:,} tokens in rows, {s.trained:,} trained "
                       f"({s.trained / max(s.tokens, 1):.1%})")
        tokens = sum(s.tokens for s in self.splits.values())
        out.append(f"  {self.bytes / 1e6:,.1f} MB on disk, {self.bytes / max(tokens, 1):.2f} bytes per token")
        return out


def tokenizer_fingerprint(tokenizer) -> str:
    """What decides the tokens: the serialized fast tokenizer, its special tokens and its chat template."""
    from ..util.hashing import hash_text

    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    model = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    return hash_text(type(tokenizer).__name__, model, str(tokenizer.chat_template or ""),
                     repr((tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)))


def store_key(data, tokenizer, opts: DataOptions) -> str:
    from ..util.hashing import hash_text

    sources = src_mod.parse_sources(data)
    inputs = src_mod.input_fingerprint(sources, _validation_file(sources, opts))
    return hash_text(str(STORE_VERSION), json.dumps(inputs), tokenizer_fingerprint(tokenizer),
                     json.dumps(asdict(opts), sort_keys=True))[:16]


def _validation_file(sources, opts: DataOptions) -> str | None:
    if opts.validation:
        return opts.validation
    if len(sources) == 1 and sources[0].path in (src_mod.BUILTIN, src_mod.BUILTIN_CHAT):
        return str(src_mod.builtin_files(sources[0].path)["validation"])
    return None


# --- building --------------------------------------------------------------------------------------


def prepare(data, tokenizer, opts: DataOptions, out, rank: int = 0, world: int = 1, force: bool = False,
            poll_s: float = 0.1, log=None) -> StoreInfo:
    """Build the store at `out` (or reuse the one there with the same key), `world` processes sharing the work;
    every rank returns the same StoreInfo. `out` holding another store: refused unless `force`. `tokenizer`: a
    tokenizer, or a model name (hfscale.data.formats.data_tokenizer)."""
    from ..util.atomic import check_overlap, check_parents
    from .merge import merge
    from .parts import write_part

    if isinstance(tokenizer, str):
        tokenizer = formats.data_tokenizer(tokenizer)
    out = Path(out)
    sources = src_mod.parse_sources(data)
    vfile = _validation_file(sources, opts)
    inputs = [f for s in sources for f in src_mod.files_of(s)] + ([Path(vfile)] if vfile else [])
    check_overlap({out: "--out"}, {str(f): "--data" for f in inputs})
    check_parents({out: "--out"})
    key = store_key(sources, tokenizer, opts)
    found = _reusable(out, key, force)
    if found is not None:
        return found
    units = src_mod.units_of(sources)
    vunits = src_mod.units_of((src_mod.Source(vfile),)) if vfile else []
    jobs = [(u, "train") for u in units] + [(u, "validation") for u in vunits]
    work = out.parent / f".{out.name}.work-{key}"
    started = time.time()
    try:
        tok = formats.Tok.of(tokenizer)
        store_packing = opts.store_packing(source_formats(units, opts))
        for i in range(rank, len(jobs), world):
            part = work / f"part-{i:06d}"
            if not part.is_dir():  # a part finished by an earlier, killed attempt is complete (renamed) and reused
                write_part(part, jobs[i][0], jobs[i][1], tok, opts, vfile is None, len(tokenizer), store_packing)
            for hook in FAULT_HOOKS:
                hook("part", i, rank)
        if rank == 0:
            _wait(lambda: all((work / f"part-{i:06d}").is_dir() for i in range(len(jobs))), work, started, poll_s)
            info = merge(work, jobs, sources, out, key, opts, len(tokenizer), log, store_packing)
            shutil.rmtree(work, ignore_errors=True)
            return info
        _wait(lambda: _manifest_key(out) == key, work, started, poll_s)
        return open_info(out)
    except (OSError, HfscaleError) as e:
        _fail(work, rank, world, e)
        cause = e if isinstance(e, OSError) else e.__cause__  # hfscale.util.atomic.staged words a full disk as a user error
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StoreWriteError(f"writing the token store {out} failed ({cause.strerror}); nothing half-written is left: "
                                  "free space or choose another --out") from None
        raise


def source_formats(units, opts: DataOptions) -> list[str]:
    """Each source's format (`format:` where given, else its first record's columns), read before any part is
    written: the store's packing depends on them, and a part's overflow on the packing."""
    if opts.format:
        return [opts.format]
    found: dict[int, str] = {}
    for u in units:
        if u.source not in found:
            for where, rec in src_mod.records(u):
                found[u.source] = formats.detect(rec.keys(), where)
                break
    return list(found.values())


def _reusable(out: Path, key: str, force: bool) -> StoreInfo | None:
    if not out.exists():
        return None
    have = _manifest_key(out)
    if have == key:
        return open_info(out, reused=True)
    if force:
        return None
    what = f"a token store of other data, tokenizer or options (key {have}, this one {key})" if have else "something else"
    raise HfscaleError(f"--out {out} holds {what}; pass --force to replace it, or choose another --out")


def _manifest_key(out: Path) -> str | None:
    try:
        return json.loads((out / MANIFEST).read_text()).get("key")
    except (OSError, ValueError, AttributeError):
        return None


def _fail(work: Path, rank: int, world: int, e: BaseException) -> None:
    """Tell the other ranks why this one stopped (they raise the same line instead of waiting forever); alone,
    leave nothing behind."""
    if world == 1:
        shutil.rmtree(work, ignore_errors=True)
        return
    try:
        from ..util.atomic import write_text_atomic

        work.mkdir(parents=True, exist_ok=True)
        write_text_atomic(work / f"error-rank{rank}", str(e) if isinstance(e, HfscaleError) else f"rank {rank}: {e}")
    except OSError:
        pass


def _wait(done, work: Path, started: float, poll_s: float) -> None:
    while not done():
        for f in sorted(work.glob("error-rank*")) if work.is_dir() else ():
            try:
                if f.stat().st_mtime >= started - 1:  # older ones are a previous attempt's
                    raise HfscaleError(f.read_text().strip())
            except FileNotFoundError:
                continue
        time.sleep(poll_s)


# --- reading ---------------------------------------------------------------------------------------


def read_manifest(path) -> dict:
    path = Path(path)
    try:
        m = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise HfscaleError(f"{path} is not a token store (no {MANIFEST}); make one with hfscale data prepare") from None
    except (OSError, ValueError) as e:
        raise HfscaleError(f"{path}/{MANIFEST} is damaged ({e}); prepare the store again") from None
    if not isinstance(m, dict) or m.get("version") != STORE_VERSION or "files" not in m:
        raise HfscaleError(f"{path} is a token store of another version or damaged; prepare it again")
    return m


def verify(path, full: bool = False) -> dict:
    """The manifest, after checking the store's files against it (sizes; with `full`, content hashes too)."""
    from ..util.hashing import files_of, hash_file

    path = Path(path)
    m = read_manifest(path)
    present = set(files_of(path, exclude=(MANIFEST,)))
    for name, (size, digest) in sorted(m["files"].items()):
        if name not in present:
            raise HfscaleError(f"token store {path} is damaged: {name} is missing; prepare it again")
        if (path / name).stat().st_size != size:
            raise HfscaleError(f"token store {path} is damaged: {name} has {(path / name).stat().st_size:,} bytes, its "
                               f"manifest says {size:,}; prepare it again")
        if full and hash_file(path / name)[1] != digest:
            raise HfscaleError(f"token store {path} is damaged: {name} differs from its manifest's hash; prepare it again")
    return m


def open_info(path, reused: bool = False, full: bool = False) -> StoreInfo:
    path = Path(path)
    m = verify(path, full)
    return StoreInfo(path, m["key"], m["options"], m["dtype"], m["vocab"],
                     {k: SplitStats(**v) for k, v in m["splits"].items()},
                     sum(v[0] for v in m["files"].values()) + (path / MANIFEST).stat().st_size, reused,
                     tuple(SourceStats(**{**v, "documents": tuple(v["documents"])}) for v in m.get("sources", ())))


class TokenStore:
    """One split of a store, memory-mapped: rows as (input_ids, labels, position_ids) int64 arrays."""

    def __init__(self, path, split: str = "train", expect_key: str | None = None):
        path = Path(path)
        m = verify(path)
        if expect_key is not None and m["key"] != expect_key:
            raise HfscaleError(f"token store {path} was made from other data, tokenizer or options (key {m['key']}, "
                               f"expected {expect_key}); prepare it again or pass the matching store")
        d = path / split
        self.path, self.key, self.options, self.manifest = path, m["key"], m["options"], m
        self.seq_len = int(m["options"]["seq_len"])
        self.tokens = np.memmap(d / "tokens.bin", dtype=m["dtype"], mode="r") if (d / "tokens.bin").stat().st_size \
            else np.zeros(0, dtype=m["dtype"])
        self.docs = np.load(d / "docs.npy", mmap_mode="r")
        self.spans = None if m["all_trained"][split] else np.load(d / "spans.npy", mmap_mode="r")
        self.segments = np.load(d / "segments.npy", mmap_mode="r")
        self.row_ptr = np.load(d / "row_ptr.npy", mmap_mode="r")
        self.row_trained = np.load(d / "row_trained.npy", mmap_mode="r")

    def __len__(self) -> int:
        return len(self.row_ptr) - 1

    def row(self, i: int):
        """(input_ids, labels, position_ids) of packed row i, unpadded: labels -100 where untrained and at every
        segment's first token; position ids restart at 0 per segment."""
        ids, labels, pos = [], [], []
        used = 0
        for doc, start in self.segments[self.row_ptr[i]: self.row_ptr[i + 1]].tolist():
            length = min(int(self.docs[doc + 1] - self.docs[doc]) - start, self.seq_len - used)
            used += length
            a = int(self.docs[doc]) + start
            t = np.asarray(self.tokens[a: a + length], dtype=np.int64)
            lab = t.copy()
            if self.spans is not None:
                lab[~self._mask(a, a + length)] = -100
            lab[0] = -100
            ids.append(t)
            labels.append(lab)
            pos.append(np.arange(length, dtype=np.int64))
        return np.concatenate(ids), np.concatenate(labels), np.concatenate(pos)

    def _mask(self, a: int, b: int) -> np.ndarray:
        m = np.zeros(b - a, dtype=bool)
        lo = np.searchsorted(self.spans[:, 1], a, side="right")
        hi = np.searchsorted(self.spans[:, 0], b, side="left")
        for s, e in self.spans[lo:hi].tolist():
            m[max(s, a) - a: min(e, b) - a] = True
        return m
