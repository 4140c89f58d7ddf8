"""hfscale.util.allocator: with glibc's thresholds set, a step that frees 72 MiB and allocates it again faults
nothing in; with the defaults the heap top beyond the trim threshold goes back to the kernel and every step faults
it in again. Each case in its own process (mallopt is process-wide); no torch."""

import os
import subprocess
import sys

import pytest

from conftest import ROOT

STEP = r"""
import ctypes, resource, sys
from hfscale.util.allocator import retain_freed_memory

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
if sys.argv[1] == "set":
    assert retain_freed_memory()
MB = 24 << 20


def step():  # three 24 MiB tensors alive at once, written, freed: 72 MiB at the top of the heap when freed
    blocks = [libc.malloc(MB) for _ in range(3)]
    for b in blocks:
        ctypes.memset(b, 1, MB)
    for b in blocks:
        libc.free(b)


step(), step()  # glibc's dynamic threshold has risen to 24 MiB by now
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # glibc's own settings would stand
    out = subprocess.run([sys.executable, "-c", STEP, mode], capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_memory_is_reused_without_page_faults():
    # 5 steps x 72 MiB / 4 KiB pages = 92,160 pages written; measured: 92,000 faults with the defaults, 0 set
    default, kept = _faults("default"), _faults("set")
    assert default > 20_000, default
    assert kept < 500, kept


def test_the_users_own_glibc_settings_stand(monkeypatch):
    from hfscale.util.allocator import retain_freed_memory

    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")  # read by glibc at start; mallopt would override it
    assert retain_freed_memory() is False
