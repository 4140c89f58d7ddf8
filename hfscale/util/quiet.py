"""Quiet by default: third-party messages a new user reads as failure, dropped from hfscale's own
commands, the recipes and every rank they launch unless `--verbose` (or HFSCALE_VERBOSE=1, which
`hfscale --verbose` sets for what it launches). Each is matched by its source and its text, so every
other warning of the same libraries still shows.

Seen here (torch 2.13, torchao 0.18, bitsandbytes 0.50, DeepSpeed 0.19.8, accelerate 1.16, CPU-only host):
  logging   torchao   "Failed to load .../_C_mxfp8...so"   optional CUDA kernels, absent on CPU builds
            torch     "<enum ...> is an Enum subclass ... register_constant() ... deprecated"   torchao's pytree use
            DeepSpeed "Setting accelerator to CPU. If you have GPU ..."   the expected choice on a CPU host
            bitsandbytes "Failed to load CPU gemm_4bit_forward from kernels-community"   an optional download
            accelerate "Removed shared tensor {'lm_head.weight'} while saving"   tied embeddings, by design
  warnings  torch     "`torch.distributed.all_gather_into_tensor` is deprecated" (+ its `return func(...)` line)
                      DeepSpeed's collectives, once per rank
  print()   DeepSpeed "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully"   once per rank
  warnings  .pte export: dynamo's "side effects" and ExecuTorch's "Mutation on a buffer" (the KV cache, on
            purpose), torch's "`isinstance(treespec, LeafSpec)` is deprecated" (x9)
  fd 2      ExecuTorch "[cpuinfo_utils.cpp:NN] ..." (5 lines per program load): native_noise_dropped()
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import warnings

NOISE = {
    "torchao": ("Failed to load",),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported",),
    "DeepSpeed": ("Setting accelerator to CPU",),
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward",),
    "accelerate.utils.other": ("Removed shared tensor",),
}
# (category, message regex) for warnings.filterwarnings; the printed source line goes with the warning
WARNINGS = (
    (FutureWarning, r"`torch\.distributed\.\w+` is deprecated"),
    # .pte export: the KV cache is a buffer the program mutates on purpose; torch.export's pytree use
    (UserWarning, r"While compiling, we found certain side effects happened"),
    (UserWarning, r"Mutation on a buffer in the model is detected"),
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated"),
)
# whole lines libraries print() with no logger to filter
PRINTS = (re.compile(r"DeepSpeed \S+ built successfully"),)
PRINT_STARTS = ("DeepSpeed ",)
# lines C/C++ code writes straight to fd 2 (ExecuTorch's XNNPACK set-up reading /sys for cpuinfo, once per load)
NATIVE = ("[cpuinfo_utils.cpp:",)
_ACTIVE = False  # what a PRINTS line starts with: a partial line that may become one is held
VERBOSE_ENV = "HFSCALE_VERBOSE"


class _DropKnownNoise(logging.Filter):
    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.texts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(t in msg for t in self.texts)


class _DropPrintedNoise:
    """sys.stdout / sys.stderr that drops whole lines matching PRINTS. Text that cannot start such a line
    is passed on at once (progress bars redraw without a newline); a possible start waits for its newline."""

    def __init__(self, stream):
        self._stream, self._held = stream, ""

    def write(self, s: str) -> int:
        *lines, rest = (self._held + s).split("\n")
        out = "".join(ln + "\n" for ln in lines if not any(p.fullmatch(ln) for p in PRINTS))
        if rest and any(start.startswith(rest) or rest.startswith(start) for start in PRINT_STARTS):
            self._held = rest
        else:
            self._held, out = "", out + rest
        if out:
            self._stream.write(out)
        return len(s)

    def flush(self):
        self._stream.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def quiet_known_noise() -> None:
    """Install the filters (before the libraries are imported: a filter on a logger survives the
    library's own setLevel / handler set-up). Idempotent."""
    global _ACTIVE
    _ACTIVE = True
    for name, texts in NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnownNoise) for f in logger.filters):
            logger.addFilter(_DropKnownNoise(texts))
    for category, message in WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _DropPrintedNoise):
            setattr(sys, name, _DropPrintedNoise(stream))


def quiet_unless_verbose(verbose: bool = False) -> bool:
    """For a script or a launched rank, first thing (before torch is imported): quiet unless `verbose` or
    HFSCALE_VERBOSE=1. Also turns off the Hub / transformers progress bars ("Loading weights", "Writing model
    shards"), which a rank otherwise draws into the launch's output. Returns True when it quieted."""
    if verbose or os.environ.get(VERBOSE_ENV) == "1":
        return False
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    quiet_known_noise()
    return True


@contextlib.contextmanager
def native_noise_dropped(fd: int = 2):
    """Around a call whose native code writes NATIVE lines to stderr, when quiet is on: fd 2 goes to a
    temporary file for the call, and its other lines are written back when it ends."""
    if not _ACTIVE:
        yield
        return
    import tempfile

    sys.stderr.flush()
    saved = os.dup(fd)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), fd)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, fd)
            os.close(saved)
            tmp.seek(0)
            kept = [ln for ln in tmp.read().decode(errors="replace").splitlines(keepends=True) if not ln.startswith(NATIVE)]
            if kept:
                os.write(fd, "".join(kept).encode())


@contextlib.contextmanager
def output_to(log):
    """Everything written to stdout and stderr during the call (Python's sys.stdout / sys.stderr, whatever object
    they are, and native code's fds 1 and 2: progress bars, llama.cpp's log lines) appended to the file `log`
    instead of the terminal; for a command that prints its own summary of a third-party call and keeps that call's
    output for when it fails."""
    from pathlib import Path

    Path(log).parent.mkdir(parents=True, exist_ok=True)
    for s in (sys.stdout, sys.stderr):
        s.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(log, "ab") as f, open(log, "a", buffering=1, errors="replace") as text:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
                yield
        finally:
            for s in (sys.stdout, sys.stderr):
                s.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
