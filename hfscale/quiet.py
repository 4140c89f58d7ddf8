"""Quiet by default: third-party messages a new user reads as failure, dropped from hfscale's own
commands unless `--verbose`. Each is matched by its logger and its text, so every other warning of
the same libraries still shows.

Seen on every command here (torch 2.13, torchao 0.18, DeepSpeed 0.19.8, on a CPU-only host):
  torchao   "Failed to load .../_C_mxfp8...so"   optional CUDA kernels, absent on CPU builds
  torch     "<enum ...> is an Enum subclass ... register_constant() ... deprecated"   torchao's pytree use
  DeepSpeed "Setting accelerator to CPU. If you have GPU ..."   the expected choice on a CPU host
"""

from __future__ import annotations

import logging

NOISE = {
    "torchao": ("Failed to load",),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported",),
    "DeepSpeed": ("Setting accelerator to CPU",),
}


class _DropKnownNoise(logging.Filter):
    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.texts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(t in msg for t in self.texts)


def quiet_known_noise() -> None:
    """Install the filters (before the libraries are imported: a filter on a logger survives the
    library's own setLevel / handler set-up). Idempotent."""
    for name, texts in NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnownNoise) for f in logger.filters):
            logger.addFilter(_DropKnownNoise(texts))
