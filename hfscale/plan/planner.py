"""Enumerate training strategies for a hardware budget, predict each one's peak memory and relative
step time, and pick the cheapest that fits.

Relative step-time cost (1.0 = DDP, no checkpointing, largest micro batch), documented assumptions:
  recompute     +1/3 x fraction of layers checkpointed (the forward is ~1/3 of a step's FLOPs;
                published: transformers ~20%, torchtune 21%, axolotl ~30% slower with full checkpointing)
  ZeRO-3        +0.10 (parameter all-gathers: 1.5x DDP's communication volume, ZeRO paper)
  ZeRO-1/2      +0.00 (same volume as DDP's all-reduce)
  offload       +0.50 CPU, +1.00 NVMe (optimizer step on the CPU and PCIe/NVMe traffic every step)
  micro batch   +0.05 per halving below the largest candidate (smaller GEMMs, more accumulation steps)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import HfscaleError
from .dims import Dims
from ..checkpointing import checkpointed_layers, resolve
from .memory import CUDA_CONTEXT_BYTES, FRAGMENTATION, Strategy, predict


@dataclass(frozen=True)
class Hardware:
    gpus_per_node: int
    nodes: int = 1
    gpu_mem: int = 80 * 10**9
    cpu_mem: int = 512 * 10**9  # per node
    nvme: bool = True

    def __post_init__(self):
        if self.gpus_per_node < 1 or self.nodes < 1:
            raise HfscaleError("--gpus-per-node and --nodes must be at least 1")
        if self.gpu_mem <= 0 or self.cpu_mem <= 0:
            raise HfscaleError("--gpu-mem and --cpu-mem must be positive sizes, e.g. 80GB")

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes


def parse_size(text: str) -> int:
    """'80GB' / '80GiB' / '512G' / '1.5TB' -> bytes."""
    t = str(text).strip().upper().replace(" ", "")
    units = {"TIB": 2**40, "GIB": 2**30, "MIB": 2**20, "TB": 10**12, "GB": 10**9, "MB": 10**6, "T": 10**12, "G": 10**9, "M": 10**6, "B": 1}
    for u, mult in units.items():
        if t.endswith(u):
            try:
                value = float(t[: -len(u)])
            except ValueError:
                break
            if not math.isfinite(value):  # 'nanGB', 'infGB'
                break
            return int(value * mult)
    raise HfscaleError(f"cannot read size {text!r}; write it like 80GB, 40GiB or 1.5TB")


def cost(d: Dims, s: Strategy, max_micro: int) -> float:
    c = 1.0
    c += (1 / 3) * len(checkpointed_layers(s.checkpointing, d.layers)) / d.layers
    c += 0.10 if s.zero == 3 else 0.0
    c += {"none": 0.0, "cpu": 0.5, "nvme": 1.0}[s.offload]
    c += 0.05 * math.log2(max_micro / s.micro_batch)
    return round(c, 4)


def peak_bytes(pred: dict) -> int:
    """Predicted peak with the stated overheads: total x (1 + fragmentation) + CUDA context."""
    return int(pred["total"] * (1 + FRAGMENTATION)) + CUDA_CONTEXT_BYTES


def candidates(d: Dims, hw: Hardware, seq_len: int, global_batch_tokens: int, precision: str = "bf16",
               attention: str = "sdpa") -> list[dict]:
    dp = hw.world
    per_step_seqs, rem = divmod(global_batch_tokens, seq_len * dp)
    if per_step_seqs < 1 or rem:
        raise HfscaleError(
            f"global batch of {global_batch_tokens:,} tokens does not split into {dp} ranks x sequences of {seq_len}; "
            f"use a multiple of {seq_len * dp:,}"
        )
    micros = [m for m in (1, 2, 4, 8, 16, 32) if per_step_seqs % m == 0]
    ckpt_modes = list(dict.fromkeys(("off", resolve("auto", d.layers), "full")))  # every ~sqrt(L)-th layer
    rows = []
    for zero in (0, 1, 2, 3):
        for offload in ("none", "cpu", "nvme"):
            if offload != "none" and zero < 2 or offload == "nvme" and (zero != 3 or not hw.nvme):
                continue
            for ckpt in ckpt_modes:
                for micro in micros:
                    s = Strategy(zero=zero, dp=dp, precision=precision, offload=offload, checkpointing=ckpt,
                                 micro_batch=micro, seq_len=seq_len, attention=attention)
                    pred = predict(d, s)
                    peak = peak_bytes(pred)
                    cpu_need = pred["offloaded_per_rank"] * hw.gpus_per_node if offload == "cpu" else 0
                    fits = peak <= hw.gpu_mem and cpu_need <= hw.cpu_mem
                    rows.append({
                        "strategy": s.label, "zero": zero, "offload": offload, "checkpointing": ckpt, "precision": precision,
                        "micro_batch": micro, "grad_accum": per_step_seqs // micro, "dp": dp,
                        "prediction": pred, "peak_bytes": peak, "cpu_bytes_per_node": cpu_need,
                        "fits": fits, "cost": cost(d, s, max(micros)),
                    })
    return sorted(rows, key=lambda r: (not r["fits"], r["cost"], r["peak_bytes"]))


def pick(rows: list[dict]) -> dict | None:
    fitting = [r for r in rows if r["fits"]]
    return fitting[0] if fitting else None


def shortfall(rows: list[dict], hw: Hardware) -> str:
    """What to say when nothing fits: by how much the smallest candidate is over, and what would fit."""
    best = min(rows, key=lambda r: r["peak_bytes"])
    over = best["peak_bytes"] - hw.gpu_mem
    return (f"nothing fits: the smallest candidate ({best['strategy']}) needs {best['peak_bytes'] / 1e9:.1f} GB per GPU, "
            f"{over / 1e9:.1f} GB over {hw.gpu_mem / 1e9:.0f} GB; it would fit on GPUs with >= {best['peak_bytes'] / 1e9:.0f} GB, "
            f"or with more GPUs sharding the states (ZeRO-3 divides them by the GPU count)")


def to_scale_spec(row: dict, hw: Hardware, name: str = "plan"):
    """The foundation's ScaleSpec for a picked candidate (so --write reuses the config builders)."""
    from ..scale.spec import Launch, ScaleSpec, Zero

    off = row["offload"]
    zero = Zero(stage=row["zero"], offload_optimizer=off,
                offload_params=off if (off != "none" and row["zero"] == 3) else "none",
                nvme_path="/local_nvme/hfscale" if off == "nvme" else None)
    launch = Launch(num_processes=hw.world, num_machines=hw.nodes,
                    main_process_ip="MAIN_NODE_ADDRESS" if hw.nodes > 1 else None)
    return ScaleSpec(name, engine="deepspeed" if row["zero"] > 0 else "ddp", zero=zero if row["zero"] > 0 else Zero(stage=0),
                     precision=row.get("precision", "bf16"), gradient_accumulation_steps=row["grad_accum"],
                     gradient_checkpointing=row["checkpointing"], launch=launch)


__all__ = ["Hardware", "candidates", "pick", "shortfall", "parse_size", "to_scale_spec"]
