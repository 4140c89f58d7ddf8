"""Content hashes of files and bytes: xxh3-64, read in bounded pieces.

xxh3 (the xxhash package, which `datasets` already requires) hashes ~4.9 GB/s on one core of the
2-core Sapphire Rapids host, against ~0.57 GB/s for sha256 and ~1.6 GB/s for crc32, so hashing is
bounded by the disk. Used by checkpoint manifests (hfscale.train.manifest) and by the token store's
content key (hfscale.data.store).
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


def hash_files(directory: Path, names: list[str]) -> dict[str, list]:
    return {n: list(hash_file(directory / n)) for n in names}


def hash_text(*parts: str) -> str:
    """xxh3-64 hex of strings joined unambiguously (each length-prefixed)."""
    import xxhash

    h = xxhash.xxh3_64()
    for p in parts:
        b = p.encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()
