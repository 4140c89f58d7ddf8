"""What a checkpoint holds, file by file, so a resume can tell an intact checkpoint from a damaged one.

The manifest is `{relative path: [size in bytes, xxh3-64 hex]}` of every file in a checkpoint
directory. hfscale.train.state writes it into the checkpoint's marker (hfscale_state.json), the
last file written before the stage is renamed into place, so it is also the commit mark: a
checkpoint whose files do not match it is refused (truncated: the size differs; a flipped bit:
the hash differs; a rank file missing or extra: the names differ).

Hashing (xxh3-64, hfscale.util.hashing) is bounded by the disk: a 10 GB checkpoint costs ~2 s of CPU per rank. Work is split over the ranks
when saving (`share`), and each rank checks every file when resuming, so no rank trusts another's
view of a file system.
"""

from __future__ import annotations

from pathlib import Path

from ..util.hashing import CHUNK, files_of, hash_file, hash_files  # noqa: F401  (the hashing's one home is util/)


def share(names: list[str], rank: int, world: int) -> list[str]:
    """The files rank `rank` hashes when `world` ranks split a save's manifest between them."""
    return names[rank::world]


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
