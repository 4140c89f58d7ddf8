"""Writing outputs safely: temp file + rename, and no overwrite without force."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .errors import HfscaleError


def check_writable(paths, force: bool) -> None:
    """Refuse before anything is written if any output exists and force is off."""
    existing = [str(p) for p in paths if Path(p).exists()]
    if existing and not force:
        raise HfscaleError(f"{existing[0]} exists; pass --force to overwrite it")


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` through a temp file in the same directory, then rename over it.

    A reader (or a crash) never sees a half-written file: either the old content or the new one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
