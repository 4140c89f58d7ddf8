"""Enumerate training strategies for a hardware budget, predict each one's peak memory and relative
step time, and pick the cheapest that fits.

Relative step-time cost (1.0 = DDP, no checkpointing, largest micro batch), documented assumptions:
  recompute     +1/3 x fraction of layers checkpointed (the forward is ~1/3 of a step's FLOPs;
                published: transformers ~20%, torchtune 21%, axolotl ~30% slower with full checkpointing)
  ZeRO-3        +0.10 (parameter all-gathers: 1.5x DDP's communication volume, ZeRO paper)
  ZeRO-1/2      +0.00 (same volume as DDP's all-reduce)
  offload       +0.50 CPU, +1.00 NVMe (optimizer step on the CPU and PCIe/NVMe traffic every step)
  micro batch   +0.05 per halving of the tokens a rank computes per micro batch (micro x seq / (sp x cp)) below
                the largest candidate's (smaller GEMMs, more accumulation steps)
  SP / CP       +0.10 per doubling (an all-to-all / K-V all-gather per layer, within a node), on top of the
                smaller per-rank micro batch above: planned only where plain data parallelism does not fit
  TP            +0.15 per doubling (an all-reduce of T x h per layer on the critical path, within a node)
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


def cost(layers: int, s: Strategy, max_micro_tokens: int) -> float:
    c = 1.0
    c += (1 / 3) * len(checkpointed_layers(s.checkpointing, layers)) / layers
    c += 0.10 if s.zero == 3 else 0.0
    c += {"none": 0.0, "cpu": 0.5, "nvme": 1.0}[s.offload]
    c += 0.05 * math.log2(max_micro_tokens / (s.micro_batch * s.seq_len // (s.sp * s.cp)))
    c += 0.10 * math.log2(s.sp * s.cp) + 0.15 * math.log2(s.tp)
    return round(c, 4)


def peak_bytes(pred: dict) -> int:
    """Predicted peak with the stated overheads: (the traced step peak, else the analytic total)
    x (1 + fragmentation) + CUDA context."""
    return int(pred.get("peak", pred.get("total", 0)) * (1 + FRAGMENTATION)) + CUDA_CONTEXT_BYTES


def candidates(d: Dims | None, hw: Hardware, seq_len: int, global_batch_tokens: int, precision: str = "bf16",
               attention: str = "sdpa", step_peak=None, layers: int | None = None,
               parallel=((1, 1, 1),)) -> list[dict]:
    """Every strategy for `hw`, sorted fitting first, then by cost. `step_peak(strategy, grad_accum)` (the
    traced prediction, `peak.step_prediction`) decides the peak when given; else the analytic total does.
    `d` may be None for an architecture the analytic model does not know (then `step_peak` is required).
    `parallel`: (sp, tp, cp) sizes to plan (hfscale.plan.parallel.parallel_options); each spans that many
    GPUs per data-parallel replica. Every row carries integer sp, tp, cp (1 when unused)."""
    layers = layers or d.layers
    rows = []
    for sp, tp, cp in parallel:
        rows += _candidates(d, hw, seq_len, global_batch_tokens, precision, attention, layers, sp, tp, cp)
    max_tokens = max(r["micro_batch"] * seq_len // (r["sp"] * r["cp"]) for r in rows)
    for r in rows:
        r["cost"] = cost(layers, r["_strategy"], max_tokens)
        _judge(r, hw, "analytic")
    if step_peak is not None:
        _trace_in_cost_order([r for r in rows if r["sp"] * r["tp"] * r["cp"] == 1], hw, step_peak)
    if any(r["fits"] and r["sp"] * r["tp"] * r["cp"] == 1 for r in rows):
        # sp / tp / cp only where data parallelism + ZeRO + checkpointing cannot fit (long sequences): their
        # communication and smaller per-rank GEMMs are not in the memory model's favour otherwise
        rows = [r for r in rows if r["sp"] * r["tp"] * r["cp"] == 1]
        max_tokens = max(r["micro_batch"] * seq_len for r in rows)
        for r in rows:
            r["cost"] = cost(layers, r["_strategy"], max_tokens)
    for r in rows:
        del r["_strategy"]
    return sorted(rows, key=lambda r: (not r["fits"], r["cost"], r["peak_bytes"]))


def _candidates(d, hw, seq_len, global_batch_tokens, precision, attention, layers, sp, tp, cp) -> list[dict]:
    dp = hw.world // (sp * tp * cp)
    per_step_seqs, rem = divmod(global_batch_tokens, seq_len * dp)
    if per_step_seqs < 1 or rem:
        raise HfscaleError(
            f"global batch of {global_batch_tokens:,} tokens does not split into {dp} ranks x sequences of {seq_len}; "
            f"use a multiple of {seq_len * dp:,}"
        )
    micros = [m for m in (1, 2, 4, 8, 16, 32) if per_step_seqs % m == 0]
    ckpt_modes = list(dict.fromkeys(("off", resolve("auto", layers), "full")))  # every ~sqrt(L)-th layer
    rows = []
    for zero in (0, 1, 2, 3):
        # SP is DeepSpeed Ulysses (ZeRO 2/3); TP and CP run under FSDP2 (planned as ZeRO-3 without offload) or,
        # TP alone over the whole world, DDP
        if sp > 1 and zero < 2 or cp > 1 and zero != 3 or tp > 1 and not (zero == 3 or zero == 0 and dp == 1):
            continue
        for offload in ("none", "cpu", "nvme"):
            if offload != "none" and zero < 2 or offload == "nvme" and (zero != 3 or not hw.nvme):
                continue
            if offload != "none" and (tp > 1 or cp > 1):
                continue
            for ckpt in ckpt_modes:
                for micro in micros:
                    s = Strategy(zero=zero, dp=dp, precision=precision, offload=offload, checkpointing=ckpt,
                                 micro_batch=micro, seq_len=seq_len, attention=attention, sp=sp, tp=tp, cp=cp)
                    rows.append({
                        "strategy": s.label, "zero": zero, "offload": offload, "checkpointing": ckpt, "precision": precision,
                        "micro_batch": micro, "grad_accum": per_step_seqs // micro, "dp": dp, "sp": sp, "tp": tp, "cp": cp,
                        "prediction": predict(d, s) if d is not None else {},
                        "_strategy": s,
                    })
    return rows


def _judge(row: dict, hw: Hardware, source: str) -> None:
    pred = row["prediction"]
    row["peak_bytes"] = peak_bytes(pred) if pred else 0
    row["cpu_bytes_per_node"] = pred.get("offloaded_per_rank", 0) * hw.gpus_per_node if row["offload"] == "cpu" else 0
    row["fits"] = bool(pred) and row["peak_bytes"] <= hw.gpu_mem and row["cpu_bytes_per_node"] <= hw.cpu_mem
    row["peak_source"] = source


def _trace_in_cost_order(rows: list[dict], hw: Hardware, step_peak) -> None:
    """Trace candidates cheapest first until one fits on its traced peak. A candidate whose exact model
    states alone (analytic, no activations) exceed the GPU is out without a trace; candidates costlier
    than the pick keep their analytic peak (`peak_source`). Traces differ only by checkpointing, micro
    batch and accumulation (ZeRO and offload re-shard the same trace), so most rows reuse a cached one."""
    from tqdm import tqdm

    todo = sorted(rows, key=lambda r: (r["cost"], r["prediction"].get("total", 0)))
    with tqdm(total=len(todo), desc="tracing candidates", unit="strategy", disable=None, leave=False) as bar:
        for r in todo:
            bar.update()
            p = r["prediction"]
            states = p.get("weights", 0) + p.get("gradients", 0) + p.get("optimizer", 0)
            if states > hw.gpu_mem:
                r["peak_source"] = "analytic (model states alone exceed the GPU)"
                continue
            r["prediction"] = {**p, **step_peak(r["_strategy"], r["grad_accum"])}
            _judge(r, hw, "trace")
            if r["fits"]:
                return


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
    from ..scale.spec import Launch, Parallel, ScaleSpec, Zero

    off = row["offload"]
    par = Parallel(sp=row.get("sp", 1), tp=row.get("tp", 1), cp=row.get("cp", 1),
                   sp_attention="flash_attention_2" if row.get("sp", 1) > 1 else "sdpa")
    zero = Zero(stage=row["zero"], offload_optimizer=off,
                offload_params=off if (off != "none" and row["zero"] == 3) else "none",
                nvme_path="/local_nvme/hfscale" if off == "nvme" else None)
    launch = Launch(num_processes=hw.world, num_machines=hw.nodes,
                    main_process_ip="MAIN_NODE_ADDRESS" if hw.nodes > 1 else None)
    engine = "deepspeed" if row["zero"] > 0 else "ddp"
    if par.tp > 1 or par.cp > 1:  # transformers TP / torch CP: FSDP2 (or DDP when TP spans the world)
        engine, zero = ("fsdp2", Zero(stage=0)) if row["zero"] == 3 else ("ddp", Zero(stage=0))
    return ScaleSpec(name, engine=engine, zero=zero if row["zero"] > 0 and engine == "deepspeed" else Zero(stage=0),
                     precision=row.get("precision", "bf16"), gradient_accumulation_steps=row["grad_accum"],
                     gradient_checkpointing=row["checkpointing"], launch=launch, parallel=par)


__all__ = ["Hardware", "candidates", "pick", "shortfall", "parse_size", "to_scale_spec"]
