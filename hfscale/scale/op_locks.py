"""A killed JIT build of a DeepSpeed op leaves its lock behind, and every later launch waits on it forever.

torch's JIT loader (torch.utils.cpp_extension.load, which DeepSpeed's op builders call for cpu_adam, the shm
collectives and async_io on a CPU host) takes `<extensions dir>/<op>/lock` while it runs ninja, in EVERY process that
loads the op (ninja then finds nothing to do), and removes it after. A process killed in that window (a timeout, a
`kill -9`, an OOM kill) leaves the file, and the next process waits in FileBaton.wait with no message and no end
(seen here: a 2-rank ZeRO-3 launch sat 10 minutes until the test's timeout; a lock of 0 bytes from a killed run).
`stale_locks` finds such files: the lock exists, no process works in that directory (ninja and the compiler run
with it as their working directory), and it is older than a build's first seconds. `refuse_stale_locks` turns that
into one line naming the file to delete, before accelerate starts DeepSpeed.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from ..util.errors import HfscaleError


def extensions_root() -> Path:
    """The directory torch's JIT loader builds into (the same rule as torch.utils.cpp_extension's)."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return Path(env)
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    kind = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip
            else f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu")
    return Path(get_default_build_root()) / f"py{sys.version_info.major}{sys.version_info.minor}{sys.abiflags}_{kind}"


BUILDERS = ("ninja", "c++", "g++", "gcc", "cc1plus", "clang", "python")  # what holds a build's lock or runs in it


def _busy_dirs() -> set[Path] | None:
    """Working directories of this host's processes: where a build is running. None when a process that could be a
    build (a compiler, ninja, python: another user's, say) hides its directory: then no lock is called stale.
    Processes that ended meanwhile, and others we may not read (an init process), do not count."""
    busy = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            busy.add(Path(os.readlink(proc / "cwd")))
        except FileNotFoundError:
            continue
        except OSError:
            try:
                name = (proc / "comm").read_text().strip()
            except OSError:
                continue
            if name.startswith(BUILDERS):
                return None
    return busy


def stale_locks(root: Path | None = None, min_age_s: float = 60.0) -> list[Path]:
    """Lock files under the extensions root that no running build holds."""
    root = extensions_root() if root is None else Path(root)
    locks = [p for p in root.glob("*/lock") if p.is_file()]
    if not locks:
        return []
    now, busy = time.time(), _busy_dirs()
    if busy is None:
        return []
    stale = []
    for lock in locks:
        try:
            age = now - lock.stat().st_mtime
        except OSError:  # released meanwhile
            continue
        if age >= min_age_s and lock.parent.resolve() not in busy:
            stale.append(lock)
    return sorted(stale)


def refuse_stale_locks(root: Path | None = None) -> None:
    """One line naming the lock to delete instead of a launch that waits forever."""
    stale = stale_locks(root)
    if stale:
        names = " ".join(str(p) for p in stale)
        raise HfscaleError(f"a killed build of a DeepSpeed op left {names}, and DeepSpeed would wait on it forever; "
                           f"no build is running: delete it (rm {names}) and launch again")
