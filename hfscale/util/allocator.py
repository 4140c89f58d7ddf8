"""glibc's malloc set for a CPU training process: memory a step frees stays with the process for the next step,
instead of going back to the kernel and being page-faulted in again.

A training step allocates and frees the same large tensors every step (activations, logits, their gradients), and
torch's CPU allocator is plain malloc. With glibc's defaults a block above the mmap threshold (128 KiB, raised by
each freed mapped block up to 32 MiB) is mapped afresh and faulted in page by page, and free memory at the top of
the heap beyond the trim threshold (twice the mmap threshold, so <= 64 MiB) is handed back, to be faulted in again
by the next step: measured on benchmark (d) at seq_len 1024 (benchmarks/results/data_pipeline.md, 2-core AMD EPYC,
loaded host), 5,800-79,000 minor faults per pass of the padding-free micro batches with glibc's defaults, 3-2,600
with these settings. Intel's torch CPU launcher
(torch.backends.xeon.run_cpu) preloads jemalloc or tcmalloc for the same cost; this needs no other library.

Set here: the mmap threshold at 32 MiB (the most glibc takes on 64-bit: it refuses more) and the trim threshold
at 1 GiB. Blocks above 32 MiB are still mapped per allocation. VmHWM (the peak) is what a step holds at once, which
these settings do not change; what the process holds between steps may be up to 1 GiB more. Not glibc (musl,
macOS): nothing is set. A process started with glibc's own variables (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_)
keeps what they say: nothing is set either.
"""

from __future__ import annotations

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 * 2**20
TRIM_THRESHOLD = 2**30


def retain_freed_memory(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Set glibc's mmap and trim thresholds for this process (mallopt; process-wide, for what is allocated from
    now on). True when glibc took both; False on another C library or where the user set glibc's variables."""
    import ctypes
    import os

    if {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"} & set(os.environ):  # the user's own settings stand
        return False
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version"):
        return False
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1 and libc.mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1


__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "retain_freed_memory"]
