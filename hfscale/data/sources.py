"""Where the examples come from: local files (.jsonl / .json / .parquet / .arrow / .txt, gzipped jsonl/txt too),
globs and directories, the built-in corpus, hub names when online, and a mixture of them with weights.

Every source is cut into work units of at most UNIT_BYTES of input (line-aligned byte ranges of a jsonl /
txt file, a parquet row group, a whole .json / .arrow / .gz file). The units, their order and their
boundaries depend on the files only, never on the number of processes, so a store built by 1 or by 8
ranks is the same bytes. Records stream out of a unit one at a time: memory never holds a file.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..util.errors import ConfigError, HfscaleError, first_line

BUILTIN = "builtin"  # the built-in corpus (text)
BUILTIN_CHAT = "builtin-chat"  # the built-in chat set made from it (tools/build_chat.py)
UNIT_BYTES = 32 << 20  # a work unit's input: ~8M tokens of text at ~4 bytes/token; parts stay small in memory
SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow", ".txt")


@dataclass(frozen=True)
class Source:
    """One entry of `data:`: a path, glob, directory, 'builtin' or hub name, and its mixture weight
    (how many times its examples appear per pass over the mixture: 2.0 twice, 0.5 a fixed half)."""
    path: str
    weight: float = 1.0

    def __post_init__(self):
        if not self.weight > 0:
            raise ConfigError(f"data source {self.path}: weight must be > 0 (got {self.weight})")


@dataclass(frozen=True)
class Unit:
    """A piece of work: lines starting in [start, end) of a jsonl / txt file, a parquet row group (`start`),
    or a whole file (start = end = -1). `source`: the index of its Source in the mixture."""
    source: int
    file: str
    start: int = -1
    end: int = -1


def parse_sources(data) -> tuple[Source, ...]:
    """`data` as given: 'a.jsonl', 'a.jsonl:0.7,b/*.parquet:0.3', a list of those, or a list of
    {path: ..., weight: ...} mappings (recipe YAML)."""
    if isinstance(data, Source):
        return (data,)
    if isinstance(data, (list, tuple)):
        out = []
        for d in data:
            if isinstance(d, dict):
                unknown = set(d) - {"path", "weight"}
                if unknown or "path" not in d:
                    raise ConfigError(f"a data source is {{path: ..., weight: ...}} (got keys {sorted(d)})")
                out.append(Source(str(d["path"]), float(d.get("weight", 1.0))))
            else:
                out.extend(parse_sources(d))
        return tuple(out)
    out = []
    for part in str(data).split(","):
        path, _, w = part.strip().rpartition(":") if _has_weight(part) else (part.strip(), "", "")
        try:
            out.append(Source(path, float(w) if w else 1.0))
        except ValueError:
            raise ConfigError(f"data source {part!r}: the weight after ':' must be a number") from None
    if not out or any(not s.path for s in out):
        raise ConfigError("no data given; pass --data FILE (or 'builtin')")
    return tuple(out)


def _has_weight(part: str) -> bool:
    head, sep, tail = part.strip().rpartition(":")
    return bool(sep and head) and tail.replace(".", "", 1).isdigit()


def looks_like_hub_name(data: str) -> bool:
    if data in (BUILTIN, BUILTIN_CHAT):
        return False
    name = Path(data).name
    return data.count("/") == 1 and not data.startswith((".", "/")) and "." not in name and not Path(data).exists()


def builtin_files(name: str = BUILTIN) -> dict[str, Path]:
    """{"train", "validation"} files of a built-in set."""
    from importlib import resources

    from .corpus import corpus_files

    if name == BUILTIN_CHAT:
        root = Path(str(resources.files("hfscale.models") / "data" / "chat"))
        return {k: root / f"{k}.jsonl.gz" for k in ("train", "validation")}
    return {k: Path(v) for k, v in corpus_files().items()}


def files_of(source: Source) -> list[Path]:
    """The files a source names, sorted (globs and directories expanded; hidden files and stages skipped)."""
    p = source.path
    if p in (BUILTIN, BUILTIN_CHAT):
        return [builtin_files(p)["train"]]
    if looks_like_hub_name(p):
        offline_refusal(p)
        return []
    if any(c in p for c in "*?["):
        found = sorted(Path(f) for f in glob.glob(p, recursive=True) if Path(f).is_file())
    elif Path(p).is_dir():
        found = sorted(f for f in Path(p).rglob("*") if f.is_file())
    elif Path(p).is_file():
        return [Path(p)]
    else:
        raise HfscaleError(f"data {p} not found; pass an existing file, directory or glob (.jsonl/.json/.parquet/.arrow/"
                           ".txt), or 'builtin'")
    found = [f for f in found if not f.name.startswith(".") and _suffix(f) in SUFFIXES]
    if not found:
        raise HfscaleError(f"data {p} holds no .jsonl/.json/.parquet/.arrow/.txt file")
    return found


def _suffix(path: Path) -> str:
    return Path(path.name.removesuffix(".gz")).suffix


def units_of(sources: tuple[Source, ...]) -> list[Unit]:
    """Every source's work units, in a fixed order that depends on the files only."""
    out = []
    for i, src in enumerate(sources):
        if looks_like_hub_name(src.path):
            out.append(Unit(i, "hub:" + src.path))
            continue
        for f in files_of(src):
            suffix, size = _suffix(f), f.stat().st_size
            if f.name.endswith(".gz") or suffix in (".json", ".arrow"):
                out.append(Unit(i, str(f)))
            elif suffix == ".parquet":
                out.extend(Unit(i, str(f), g, g + 1) for g in range(_row_groups(f)))
            else:
                out.extend(Unit(i, str(f), a, min(a + UNIT_BYTES, size)) for a in range(0, max(size, 1), UNIT_BYTES))
    return out


def _row_groups(path: Path) -> int:
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).num_row_groups
    except Exception as e:  # pyarrow raises several types for a damaged file
        raise HfscaleError(f"cannot read {path} as parquet ({first_line(e, 160)})") from None


def records(unit: Unit) -> Iterator[tuple[str, dict]]:
    """(where, record) for every record of a unit; `where` is 'file:line' (or 'file:row N') for messages."""
    if unit.file.startswith("hub:"):
        yield from _hub_records(unit.file[4:])
        return
    path = Path(unit.file)
    suffix = _suffix(path)
    if suffix == ".parquet":
        yield from _parquet_records(path, unit.start)
    elif suffix == ".arrow":
        yield from _arrow_records(path)
    elif suffix == ".json" and not path.name.endswith(".gz"):
        yield from _json_records(path)
    else:
        yield from _line_records(path, unit, suffix == ".txt")


def _line_records(path: Path, unit: Unit, text: bool) -> Iterator[tuple[str, dict]]:
    """jsonl (one object a line) or txt (one document a line; blank lines skipped) lines starting in the unit."""
    import gzip

    whole = unit.start < 0
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rb") as f:
        line_no = 1
        if not whole and unit.start > 0:
            line_no = None  # counted only if an error needs it
            f.seek(unit.start - 1)
            if f.read(1) != b"\n":
                f.readline()  # the line in progress belongs to the unit before
        while whole or f.tell() < unit.end:
            raw = f.readline()
            if not raw:
                break
            where = Where(path, line_no, f.tell() - len(raw))
            if text:
                s = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                if s.strip():
                    yield where, {"text": s}
            elif raw.strip():
                try:
                    rec = json.loads(raw)
                except ValueError as e:
                    raise HfscaleError(f"{where}: not valid JSON ({first_line(e, 100)}); one JSON object per line") from None
                if not isinstance(rec, dict):
                    raise HfscaleError(f"{where}: a JSON {type(rec).__name__}, not an object; one {{...}} per line")
                yield where, rec
            if line_no is not None:
                line_no += 1


class Where:
    """'file:line' of a record, for messages only: in a unit that starts mid-file the line number is counted from
    the file's start when the text is first asked for (an error), never per record."""
    __slots__ = ("path", "line", "offset")

    def __init__(self, path: Path, line: int | None, offset: int):
        self.path, self.line, self.offset = path, line, offset

    def __str__(self) -> str:
        return f"{self.path}:{self.line if self.line is not None else _line_of(self.path, self.offset)}"

    __format__ = lambda self, spec: format(str(self), spec)  # noqa: E731


def _line_of(path: Path, offset: int) -> int:
    """1-based line number of the line starting at byte `offset` (only computed for an error message)."""
    n = 1
    with open(path, "rb") as f:
        while offset > 0:
            chunk = f.read(min(offset, 1 << 20))
            if not chunk:
                break
            n += chunk.count(b"\n")
            offset -= len(chunk)
    return n


def _json_records(path: Path) -> Iterator[tuple[str, dict]]:
    """A .json file: a list of objects (or JSON lines, as datasets' json builder also accepts)."""
    head = path.open("rb").read(64).lstrip()
    if not head.startswith(b"["):
        yield from _line_records(path, Unit(0, str(path)), False)
        return
    try:
        rows = json.loads(path.read_bytes())
    except ValueError as e:
        raise HfscaleError(f"{path}: not valid JSON ({first_line(e, 100)})") from None
    for i, rec in enumerate(rows):
        if not isinstance(rec, dict):
            raise HfscaleError(f"{path}: item {i} is a JSON {type(rec).__name__}, not an object")
        yield f"{path}:item {i}", rec


def _parquet_records(path: Path, group: int) -> Iterator[tuple[str, dict]]:
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path).read_row_group(group)
    except Exception as e:  # pyarrow raises several types for a damaged file
        raise HfscaleError(f"cannot read {path} as parquet ({first_line(e, 160)})") from None
    yield from _table_records(path, table, f"row group {group} row ")


def _arrow_records(path: Path) -> Iterator[tuple[str, dict]]:
    import pyarrow as pa

    try:
        with pa.memory_map(str(path)) as src:
            try:
                reader = pa.ipc.open_stream(src)  # datasets' cache files are streams
            except pa.ArrowInvalid:
                reader = pa.ipc.open_file(src)
            table = reader.read_all()
    except Exception as e:  # pyarrow raises several types for a damaged file
        raise HfscaleError(f"cannot read {path} as arrow ({first_line(e, 160)})") from None
    yield from _table_records(path, table, "row ")


def _table_records(path, table, label: str) -> Iterator[tuple[str, dict]]:
    for b in table.to_batches(max_chunksize=4096):
        base = 0
        for i, rec in enumerate(b.to_pylist()):
            yield f"{path}:{label}{base + i}", rec
        base += b.num_rows


def offline_refusal(name: str) -> None:
    """Hub names need the network: refused in one line where the hub is off (HF_HUB_OFFLINE, the Hub's own switch)."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false"):
        raise HfscaleError(f"{name} looks like a hub dataset but HF_HUB_OFFLINE is set; use a local .jsonl/.parquet/.txt "
                           "file or 'builtin', or unset HF_HUB_OFFLINE")


def _hub_records(name: str) -> Iterator[tuple[str, dict]]:
    """A hub dataset's train split, streamed (network needed; refused offline)."""
    offline_refusal(name)
    import datasets

    try:
        ds = datasets.load_dataset(name, split="train", streaming=True)
    except Exception as e:  # hub errors come in many types; the user needs the first line
        raise HfscaleError(f"cannot load dataset {name} from the hub ({first_line(e, 160)})") from None
    for i, rec in enumerate(ds):
        yield f"{name}:row {i}", rec


def input_fingerprint(sources: tuple[Source, ...], validation: str | None) -> list:
    """What the store key takes from the input: every file's size and xxh3 content hash, in unit order, with its
    source's weight (hub names by name only: a hub dataset cannot be hashed offline)."""
    from ..util.hashing import hash_file

    out = []
    for i, src in enumerate(sources):
        if looks_like_hub_name(src.path):
            out.append([i, "hub:" + src.path, src.weight])
        else:
            out.extend([i, *hash_file(f), src.weight] for f in files_of(src))
    if validation:
        out.extend(["validation", *hash_file(f)] for f in files_of(Source(validation)))
    return out
