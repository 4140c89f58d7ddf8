"""What a checkpoint holds, file by file, so a resume can tell an intact checkpoint from a damaged one.

The manifest is `{relative path: [size in bytes, xxh3-64 hex]}` of every file in a checkpoint
directory. hfscale.train.state writes it into the checkpoint's marker (hfscale_state.json), the
last file written before the stage is renamed into place, so it is also the commit mark: a
checkpoint whose files do not match it is refused (truncated: the size differs; a flipped bit:
the hash differs; a rank file missing or extra: the names differ).

xxh3 (the xxhash package, which `datasets` already requires) hashes ~4.9 GB/s on one core of the
2-core Sapphire Rapids host, against ~0.57 GB/s for sha256 and ~1.6 GB/s for crc32, so hashing is
bounded by the disk: a 10 GB checkpoint costs ~2 s of CPU per rank. Work is split over the ranks
when saving (`share`), and each rank checks every file when resuming, so no rank trusts another's
view of a file system.
"""

from __future__ import annotations

import os
from pathlib import Path

CHUNK = 8 << 20  # bytes read at a time: memory stays flat whatever the file size


def files_of(directory: Path, exclude: tuple[str, ...] = ()) -> list[str]:
    """Relative paths (sorted, '/'-separated) of the regular files under `directory`."""
    out = []
    for root, _, names in os.walk(directory):
        for n in names:
            rel = os.path.relpath(os.path.join(root, n), directory).replace(os.sep, "/")
            if rel not in exclude and os.path.isfile(os.path.join(root, n)):
                out.append(rel)
    return sorted(out)


def hash_file(path: Path) -> tuple[int, str]:
    """(size, xxh3-64 hex) of one file, read in CHUNK pieces."""
    import xxhash

    h = xxhash.xxh3_64()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def share(names: list[str], rank: int, world: int) -> list[str]:
    """The files rank `rank` hashes when `world` ranks split a save's manifest between them."""
    return names[rank::world]


def hash_files(directory: Path, names: list[str]) -> dict[str, list]:
    return {n: list(hash_file(directory / n)) for n in names}


def problem(directory: Path, manifest: dict, exclude: tuple[str, ...] = ()) -> str | None:
    """None if `directory` holds exactly the manifest's files with their sizes and hashes, else the
    first difference, in words ("pytorch_model/x.pt: 3,072 bytes, the manifest says 41,216")."""
    present = set(files_of(directory, exclude))
    for name in sorted(manifest):
        if name not in present:
            return f"{name} is missing"
    extra = sorted(present - set(manifest))
    if extra:
        return f"{extra[0]} is not in its manifest"
    for name in sorted(manifest):  # sizes first: a truncated file is found without reading anything
        size = (directory / name).stat().st_size
        if size != manifest[name][0]:
            return f"{name}: {size:,} bytes, the manifest says {manifest[name][0]:,}"
    for name in sorted(manifest):
        if hash_file(directory / name)[1] != manifest[name][1]:
            return f"{name}: its content differs from the manifest's hash (a changed or corrupted file)"
    return None
