"""What this host computes natively, read once at the edge: does it do bf16 in hardware?

Hosts of the same kind differ. Measured on 2026-12-04 on this project's 2-core CI-class hosts (benchmarks/bf16_host.py has the method): on an AMD EPYC with AVX2 only
(torch CPU capability `AVX2`, no `avx512_bf16` / `amx_bf16` flag) bf16 is emulated and a 2048x192 @
192x768 GEMM took 501 ms against 47 ms in fp32 (10.6x); the tiny recipe ran 15 s/step instead of ~1.
On a Xeon with AVX512-BF16 and AMX the same GEMM is as fast or faster in bf16
(`benchmarks/bf16_host.py` measures it on the host at hand). GPUs: bf16 is native from compute
capability 8.0 (Ampere) on.

`bf16_support()` says which; `resolve_precision` turns a requested precision ("auto" obeys the
launch except where it asks for bf16 on a host that emulates it) into the one to run, with the one
line to print when it chose fp32. The environment variable HFSCALE_NATIVE_BF16=0/1 overrides the
detection (to measure, on a native host, what a host without it does); it is read here, the one place
that reads host facts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

# measured on the AVX2-only host above; quoted in messages, never used to decide anything
EMULATED_BF16_SLOWDOWN = 10.6
# x86: AVX512-BF16 / AMX-BF16; aarch64: the BF16 extension (BFMMLA, /proc/cpuinfo "Features: ... bf16")
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
PRECISION_CHOICES = ("auto", "launch", "bf16", "fp16", "fp32")


@dataclass(frozen=True)
class Bf16Support:
    native: bool
    device: str  # "cpu" | "cuda"
    detail: str  # what decided it: "AVX2", "AVX512 + avx512_bf16 amx_bf16", "sm_90", "forced by HFSCALE_NATIVE_BF16=0"

    def why_fp32(self, what: str = "the tiny model") -> str:
        """The one line printed when bf16 was asked for (or is the default) and fp32 is used instead."""
        return (f"bf16 is emulated on this {self.device.upper()} ({self.detail}): using fp32 for {what} "
                f"(bf16 measured {EMULATED_BF16_SLOWDOWN}x slower than fp32 on such a CPU)")


def cpu_bf16(capability: str, flags: set[str]) -> Bf16Support:
    """Pure decision from torch's CPU capability string and /proc/cpuinfo flags (tested on both kinds)."""
    found = " ".join(sorted(NATIVE_BF16_FLAGS & flags))
    native = bool(found) or "AMX" in capability.upper() or "BF16" in capability.upper()
    return Bf16Support(native, "cpu", f"{capability} + {found}" if found else capability)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):  # x86 / aarch64
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@lru_cache(maxsize=None)
def bf16_support(device: str | None = None) -> Bf16Support:
    """Whether bf16 is computed natively on `device` ("cuda" / "cpu"; default: CUDA if present, else CPU)."""
    import torch

    forced = os.environ.get("HFSCALE_NATIVE_BF16", "").strip()
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if forced in ("0", "1"):
        return Bf16Support(forced == "1", device, f"forced by HFSCALE_NATIVE_BF16={forced}")
    if device == "cuda":
        major, minor = torch.cuda.get_device_capability()
        return Bf16Support(major >= 8, "cuda", f"sm_{major}{minor}")
    return cpu_bf16(torch.backends.cpu.get_cpu_capability(), _cpu_flags())


@dataclass(frozen=True)
class PrecisionChoice:
    precision: str  # bf16 | fp16 | fp32: what runs
    requested: str  # what was asked: auto | launch | bf16 | fp16 | fp32
    launch: str  # what the launch config says
    note: str | None = None  # one line to print when the run differs from the launch config

    @property
    def overridden(self) -> bool:
        return self.precision != self.launch


def resolve_precision(requested: str, launch: str, support: Bf16Support, what: str = "the tiny model") -> PrecisionChoice:
    """`launch`: run what the launch config says. `auto`: the same, except bf16 on a host that emulates
    it becomes fp32 (said in one line). bf16 / fp16 / fp32: the user's explicit choice, always obeyed."""
    if requested not in PRECISION_CHOICES:
        from .errors import ConfigError

        raise ConfigError(f"precision {requested!r} not understood; use one of {', '.join(PRECISION_CHOICES)}")
    if requested == "launch":
        return PrecisionChoice(launch, requested, launch)
    if requested == "auto":
        if launch == "bf16" and not support.native:
            return PrecisionChoice("fp32", requested, launch, support.why_fp32(what))
        return PrecisionChoice(launch, requested, launch)
    note = None if requested == launch else f"precision {requested} (as asked) instead of the launch config's {launch}"
    return PrecisionChoice(requested, requested, launch, note)
