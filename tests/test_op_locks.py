"""A killed JIT build's lock is named in one line instead of a launch that waits forever (hfscale.scale.op_locks)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hfscale.scale.op_locks import refuse_stale_locks, stale_locks
from hfscale.util.errors import HfscaleError


def _lock(root, op, age_s):
    (root / op).mkdir(parents=True)
    lock = root / op / "lock"
    lock.touch()
    t = time.time() - age_s
    os.utime(lock, (t, t))
    return lock


def test_only_old_unheld_locks_are_stale(tmp_path):
    old = _lock(tmp_path, "deepspeed_shm_comm", 3600)
    _lock(tmp_path, "cpu_adam", 5)  # a build's first seconds (or a loader's no-op ninja check): not stale
    held = _lock(tmp_path, "async_io", 3600)
    (tmp_path / "pin_memory").mkdir()  # an op built and released: no lock
    # a process working in async_io's directory, as ninja and the compiler do during a build
    builder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=held.parent)
    try:
        time.sleep(0.2)
        assert stale_locks(tmp_path) == [old]
        with pytest.raises(HfscaleError, match=f"rm {old}\\) and launch again"):
            refuse_stale_locks(tmp_path)
    finally:
        builder.kill()
        builder.wait()
    assert stale_locks(tmp_path) == [held, old]  # its builder gone, async_io's lock is stale too
    old.unlink()
    held.unlink()
    refuse_stale_locks(tmp_path)  # nothing left: no error


def test_root_follows_torch_extensions_dir(tmp_path, monkeypatch):
    from hfscale.scale.op_locks import extensions_root

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert extensions_root() == tmp_path
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    from torch.utils.cpp_extension import _get_build_directory

    # the same directory torch's loader builds in (its private helper creates it, so ask it for a throwaway name)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    root = extensions_root()
    assert Path(_get_build_directory("hfscale_probe", verbose=False)).parent == root
