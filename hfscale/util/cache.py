"""hfscale's on-disk cache: where it lives and the one way to read-or-compute a JSON entry in it.

Everything cached is derived (trained fixtures, traces, resolved model shapes) and keyed by what it is
derived from, so deleting `$HFSCALE_CACHE` (default ~/.cache/hfscale) only costs time.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable


def cache_root() -> Path:
    return Path(os.environ.get("HFSCALE_CACHE") or Path.home() / ".cache" / "hfscale")


def cached_json(path: Path, compute: Callable[[], dict], valid: Callable[[dict], object] = lambda d: d) -> dict:
    """The JSON at `path` if it reads back and `valid(data)` does not raise ValueError/KeyError/TypeError/AttributeError;
    else `compute()`, written atomically (a cache that cannot be written is skipped: it only saves time)."""
    try:
        data = json.loads(path.read_text())
        valid(data)
        return data
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # unreadable, foreign or stale
        pass
    value = compute()
    try:
        from .atomic import write_text_atomic

        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(value))
    except Exception:  # noqa: BLE001 - a read-only home must not fail the caller
        pass
    return value


def cached_dir(name: str, key: str, build: Callable[[Path], None], done: str, cache: str | os.PathLike | None = None) -> Path:
    """`root/name-key`, built once by `build(staging_dir)` (it appears whole or not at all: a concurrent builder's
    equal copy may be replaced) and reused while its `done` file exists. The one cache for built model directories
    (the trained default, the test fixtures)."""
    from .atomic import staged

    out = (Path(cache) if cache is not None else cache_root()) / f"{name}-{key}"
    if not (out / done).is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        with staged(out, directory=True) as tmp:
            build(tmp)
    return out
