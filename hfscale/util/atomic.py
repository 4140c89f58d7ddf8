"""Every file and directory hfscale writes goes through this module. What it guarantees:

1. **Inputs are sacred.** `check_overlap` (and `check_writable`, which calls it) resolves each output
   and each input with real paths (symlinks followed) and refuses, before any work, an output that is
   an input, lies inside one, or contains one (replacing it would delete the input), `--force` or not.
   An output that is or contains the current directory is refused the same way.
2. **Bad paths fail first, in one line naming the flag.** `check_parents`: an output under a file, or
   under a directory this process cannot create entries in, is refused before any work. Missing parent
   directories are created when the output is written, never on refusal.
3. **Nothing half-written at a target.** `staged(target)` yields a staging path beside the target,
   `.hfscale-stage.<host>.<pid>.<start>.<name>`; the caller makes it complete; on success it is renamed
   into place, on an exception removed. A file replaces a file in one rename; a directory is swapped
   with its stage in one step (renameat2 RENAME_EXCHANGE; moved aside first where the file system
   cannot), so a reader, or a kill at any moment, finds the old target or the new one, never a part.
4. **Stale staging is removed.** A stage made on this host by a process that is gone (no process has
   its pid, or the one that has it started at another time: the pid was reused) is deleted by the next
   `staged` into the same directory, or by `clean_stale(directory)`. Live writers' stages and stages
   from other hosts (shared file systems) are left alone.
5. **Permissions follow the umask.** On commit every file in the stage gets 0o666 & ~umask (0o777 for
   files that had an execute bit) and every directory 0o777 & ~umask: 0644 / 0755 under umask 022,
   whatever a library gave them (mkstemp's 0600, safetensors' 0600, mkdtemp's 0700).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Iterable, Iterator, Mapping

from .errors import HfscaleError

STAGE_PREFIX = ".hfscale-stage."
_STAGE_RE = re.compile(r"^\.hfscale-stage\.([A-Za-z0-9_-]+)\.(\d+)\.(\d+)\.(.+)$")
# errors a user fixes by choosing another place (not bugs): reported as one line, exit 2
_USER_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


# --- checks before any work --------------------------------------------------------------------


def _named(paths, default: str) -> dict[str, str]:
    if isinstance(paths, Mapping):
        return {str(p): str(n) for p, n in paths.items() if p is not None and str(p) != ""}
    return {str(p): default for p in paths if p is not None and str(p) != ""}


def _inside(path: str, root: str) -> bool:
    return path != root and path.startswith(root.rstrip(os.sep) + os.sep)


def check_overlap(outputs: Mapping | Iterable, inputs: Mapping | Iterable = ()) -> None:
    """Refuse an output that is, lies inside, or contains an input (real paths), or the current directory.

    outputs: {path: flag} or paths (named --out); inputs: {path: label} or paths. Inputs that are not
    on disk (built-in or hub model names) cannot be overwritten and are skipped.
    """
    cwd = os.path.realpath(os.getcwd())
    ins = {p: (label, os.path.realpath(p)) for p, label in _named(inputs, "input").items() if os.path.lexists(p)}
    for out, flag in _named(outputs, "--out").items():
        o = os.path.realpath(out)
        if o == cwd or _inside(cwd, o):
            raise HfscaleError(f"{flag} {out} is or contains the current directory; give a path inside it")
        for inp, (label, i) in ins.items():
            rel = "is" if o == i else "is inside" if _inside(o, i) else "contains" if _inside(i, o) else None
            if rel:
                via = f" (real paths {o} and {i})" if (os.path.abspath(out), os.path.abspath(inp)) != (o, i) else ""
                raise HfscaleError(f"{flag} {out} {rel} the input {label} {inp}{via}; hfscale never writes over, "
                                   f"into or around its own inputs, --force or not: choose another {flag}")


def check_parents(outputs: Mapping | Iterable) -> None:
    """Refuse an output whose nearest existing ancestor is not a directory, or is one this process
    cannot create entries in (probed with a staging directory made and removed at once)."""
    probed: set[Path] = set()
    for out, flag in _named(outputs, "--out").items():
        anc = Path(os.path.abspath(out)).parent
        while not os.path.lexists(anc):
            anc = anc.parent
        if not os.path.isdir(anc):
            raise HfscaleError(f"{flag} {out}: {anc} is a file, not a directory; choose a {flag} path inside a directory")
        if anc in probed:
            continue
        probe = anc / stage_name("probe")
        try:
            os.mkdir(probe)
            os.rmdir(probe)
        except OSError as e:
            raise HfscaleError(f"{flag} {out}: cannot create files in {anc} ({e.strerror}); "
                               f"choose a writable directory for {flag}") from None
        probed.add(anc)


def check_writable(outputs: Mapping | Iterable, force: bool, inputs: Mapping | Iterable = ()) -> None:
    """Everything that can refuse an output, before anything is loaded or written: overlap with an
    input (always), a parent that cannot hold it, and an existing output while force is off."""
    outs = _named(outputs, "--out")
    check_overlap(outs, inputs)
    check_parents(outs)
    existing = [(p, f) for p, f in outs.items() if os.path.lexists(p)]
    if existing and not force:
        p, f = existing[0]
        raise HfscaleError(f"{f} {p} exists; pass --force to overwrite it, or choose another {f}")


# --- staging -----------------------------------------------------------------------------------


def _start_ticks(pid: int) -> int | None:
    """Start time of process `pid` in clock ticks since boot (/proc/PID/stat field 22); None if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "_", socket.gethostname().split(".")[0]) or "host"


def stage_name(name: str) -> str:
    """This process's staging name for a target called `name` (keeps its suffix: .gguf, .pte)."""
    pid = os.getpid()
    return f"{STAGE_PREFIX}{_host()}.{pid}.{_start_ticks(pid) or 0}.{name}"


def _writer_alive(pid: int, start: int) -> bool:
    now = _start_ticks(pid)
    if now is not None:
        return start == 0 or now == start  # another start time: the pid was reused, the writer is gone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: Path) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def clean_stale(directory: str | os.PathLike) -> list[Path]:
    """Remove the stages in `directory` whose writer on this host is gone; returns what was removed."""
    gone = []
    host = _host()
    try:
        names = os.listdir(directory)
    except OSError:
        return gone
    for name in names:
        m = _STAGE_RE.match(name)
        if m and m.group(1) == host and not _writer_alive(int(m.group(2)), int(m.group(3))):
            _remove(Path(directory) / name)
            gone.append(Path(directory) / name)
    return gone


def _umask() -> int:
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/self/status") as f:
            return int(next(ln for ln in f if ln.startswith("Umask:")).split()[1], 8)
    mask = os.umask(0o022)  # no /proc: read it by setting it (restored at once)
    os.umask(mask)
    return mask


def _apply_umask(stage: Path) -> None:
    """Give every file and directory in `stage` the modes the umask gives new ones."""
    mask = _umask()
    dmode = 0o777 & ~mask

    def fix_file(p):
        st = os.lstat(p)
        os.chmod(p, (0o777 if st.st_mode & 0o111 else 0o666) & ~mask)

    if os.path.isdir(stage) and not os.path.islink(stage):
        os.chmod(stage, dmode)
        for root, dirs, files in os.walk(stage):
            for d in dirs:
                if not os.path.islink(os.path.join(root, d)):
                    os.chmod(os.path.join(root, d), dmode)
            for f in files:
                if not os.path.islink(os.path.join(root, f)):
                    fix_file(os.path.join(root, f))
    elif not os.path.islink(stage):
        fix_file(stage)


def begin_stage(target: str | os.PathLike, directory: bool = False) -> Path:
    """Create this process's stage beside `target` (an empty file, or a directory): parents are made,
    stale stages there are removed first. Use `staged`, unless the stage must outlive one block
    (a collective checkpoint save); then `commit` or `discard` it."""
    target = Path(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        clean_stale(target.parent)
        stage = target.parent / stage_name(target.name)
        _remove(stage)
        if directory:
            os.mkdir(stage)
        else:
            os.close(os.open(stage, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except OSError as e:
        raise HfscaleError(f"cannot write {target} ({e.strerror}); choose a writable location") from None
    return stage


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def commit(stage: Path, target: str | os.PathLike) -> Path:
    """Give `stage` the umask's modes and rename it to `target`. A file replaces a file in one rename;
    a directory (or a target of the other kind) is swapped with the stage in one step where the file
    system can (else moved aside first), and the old one, now under a staging name, is removed."""
    target = Path(target)
    _apply_umask(stage)
    replacing_dir = os.path.lexists(target) and (
        os.path.isdir(stage) or (os.path.isdir(target) and not os.path.islink(target)))
    if not replacing_dir:
        os.replace(stage, target)
        return target
    if not _exchange(stage, target):
        aside = stage.with_name(stage.name + ".old")
        _remove(aside)
        os.replace(target, aside)
        try:
            os.replace(stage, target)
        except BaseException:
            os.replace(aside, target)
            raise
        stage = aside
    _remove(stage)  # the old target
    return target


def discard(stage: Path) -> None:
    _remove(stage)


@contextlib.contextmanager
def staged(target: str | os.PathLike, directory: bool = False) -> Iterator[Path]:
    """Yield a stage for `target` (an existing empty file, or with directory=True an empty directory);
    on success it is renamed into place with the umask's modes, on an exception it is removed."""
    stage = begin_stage(target, directory)
    try:
        yield stage
        commit(stage, target)
    except BaseException as e:
        _remove(stage)
        if isinstance(e, OSError) and e.errno in _USER_ERRNOS:
            raise HfscaleError(f"writing {target} failed ({e.strerror}); free space or choose another location") from e
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` through a stage beside it (flushed to disk), then rename over it:
    a reader (or a crash) sees the old content or the new one, never a part."""
    with staged(path) as stage:
        with open(stage, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    return Path(path)
