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
from dataclasses import dataclass, replace

from ..scale.checkpointing import checkpointed_layers, resolve
from ..util.errors import HfscaleError
from .memory import CUDA_CONTEXT_BYTES, FRAGMENTATION, Strategy
from .prediction import Prediction


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
    c += 0.10 if s.zero == 3 or s.engine == "fsdp2" else 0.0  # parameter all-gathers (FSDP2's as ZeRO-3's)
    c += {"none": 0.0, "cpu": 0.5, "nvme": 1.0}[s.offload]
    c += 0.05 * math.log2(max_micro_tokens / (s.micro_batch * s.seq_len // (s.sp * s.cp)))
    c += 0.10 * math.log2(s.sp * s.cp) + 0.15 * math.log2(s.tp)
    return round(c, 4)


def peak_bytes(peak: int) -> int:
    """A predicted peak with the stated overheads: peak x (1 + fragmentation) + CUDA context."""
    return int(peak * (1 + FRAGMENTATION)) + CUDA_CONTEXT_BYTES


@dataclass(frozen=True)
class Candidate:
    """One strategy for the hardware, predicted and judged. `peak_bytes` = the prediction's peak with the
    stated overheads; it fits when that is within the GPU and the offloaded bytes within the node's CPU memory."""

    strategy: Strategy
    grad_accum: int
    prediction: Prediction
    cost: float
    peak_bytes: int
    cpu_bytes_per_node: int
    fits: bool

    def __getattr__(self, name):  # zero, offload, checkpointing, micro_batch, dp, sp, tp, cp, precision
        if name in _STRATEGY_FIELDS:
            return getattr(self.strategy, name)
        raise AttributeError(name)

    @property
    def label(self) -> str:
        return self.strategy.label

    def to_dict(self) -> dict:
        s = self.strategy
        return {"strategy": s.label, "zero": s.zero, "offload": s.offload, "checkpointing": s.checkpointing,
                "precision": s.precision, "micro_batch": s.micro_batch, "grad_accum": self.grad_accum, "dp": s.dp,
                "sp": s.sp, "tp": s.tp, "cp": s.cp, "engine": s.engine, "levers": s.levers, "prediction": self.prediction.to_dict(), "cost": self.cost,
                "peak_bytes": self.peak_bytes, "cpu_bytes_per_node": self.cpu_bytes_per_node, "fits": self.fits,
                "peak_source": self.prediction.source}


_STRATEGY_FIELDS = ("zero", "offload", "checkpointing", "micro_batch", "dp", "sp", "tp", "cp", "precision", "engine",
                    "levers")


def judge(s: Strategy, grad_accum: int, pred: Prediction, hw: Hardware, cost_: float, known_not_to_fit: bool = False) -> Candidate:
    peak = peak_bytes(pred.peak)
    cpu = pred.offloaded_per_rank * hw.gpus_per_node if s.offload == "cpu" or s.levers.endswith("offload") else 0
    return Candidate(s, grad_accum, pred, cost_, peak, cpu, not known_not_to_fit and peak <= hw.gpu_mem and cpu <= hw.cpu_mem)


ENGINES = ("ddp", "deepspeed", "fsdp2")  # what the planner ranks (hfscale plan --engines)


def candidates(hw: Hardware, seq_len: int, global_batch_tokens: int, predict, layers: int, precision: str = "bf16",
               attention: str = "sdpa", parallel=((1, 1, 1),), progress: bool = False, period: int = 1,
               engines=ENGINES, packing: bool = False, adapter: dict | None = None) -> list[Candidate]:
    """Every strategy for `hw`, sorted fitting first, then by cost, each predicted by `predict(strategy,
    grad_accum) -> Prediction` (the same model for every row: the ranking and the report agree).
    `parallel`: (sp, tp, cp) sizes to plan (hfscale.plan.parallel.parallel_options), each spanning that many GPUs
    per data-parallel replica; sizes other than (1, 1, 1) are predicted only when no plain data-parallel
    strategy fits: their communication and smaller per-rank GEMMs are not in the cost model's favour otherwise.
    `period`: the layers' repeating pattern (checkpointing.resolve aligns every:K to it); `engines`: which of
    ENGINES to rank (TP / CP rows run under FSDP2, or TP alone over the world under DDP). `packing`: rows packed
    with documents (Strategy.packing; Ulysses rows are planned with flash varlen, which builds no mask).
    Rows whose model states alone (weights + gradients + optimizer, exact from the parameter count) exceed the GPU
    cannot fit whatever their activations, and rows costlier than the cheapest fitting one cannot be the pick:
    `predict(strategy, grad_accum, gpu_mem, skip)` may answer those from the analytic terms without a trace (where
    the model has formulas), and their Prediction says so. Every row at or below the pick's cost is traced.
    `adapter`: the Strategy's adapter fields (adapter, lora_rank, base_bits) every row carries."""
    from tqdm import tqdm

    plain = [p for p in parallel if p == (1, 1, 1)]
    groups = [plain, [p for p in parallel if p != (1, 1, 1)]] if plain else [list(parallel)]
    rows: list[Candidate] = []
    for group in groups:
        todo = [(replace(s, packing=packing and s.sp == 1, **(adapter or {})), a) for sizes in group
                for s, a in _strategies(hw, seq_len, global_batch_tokens, precision, attention, layers, period, *sizes)
                if _engine_of(s) in engines]
        if not todo:
            continue
        max_tokens = max(s.micro_batch * seq_len // (s.sp * s.cp) for s, _ in todo)
        todo = sorted(((cost(layers, s, max_tokens), s, a) for s, a in todo), key=lambda x: x[0])
        smallest = {}  # a strategy without its micro batch -> (micro, accumulation) of its smallest micro batch
        for _, s, a in todo:
            key = replace(s, micro_batch=1)
            if key not in smallest or s.micro_batch < smallest[key][0]:
                smallest[key] = (s.micro_batch, a)
        fails: dict = {}  # the same -> the smallest micro batch known not to fit (a larger one holds more)
        failed_at: dict = {}  # the same -> that micro batch's traced prediction (a lower bound of the larger ones)
        picked_cost = None

        def judged(s, accum, c, skip=None, known_not_to_fit=False):
            key = replace(s, micro_batch=1)
            if known_not_to_fit and key in failed_at:  # shown with the smaller micro batch's traced peak, and why
                lower = replace(failed_at[key], not_traced=skip)
                return judge(s, accum, lower, hw, c, known_not_to_fit)
            row = judge(s, accum, predict(s, accum, hw.gpu_mem, skip), hw, c, known_not_to_fit)
            if not row.fits and row.prediction.source == "trace" and s.micro_batch <= fails.get(key, s.micro_batch):
                fails[key], failed_at[key] = s.micro_batch, row.prediction
            return row

        with tqdm(total=len(todo), desc="predicting candidates", unit="strategy", disable=not progress or None,
                  leave=False) as bar:
            for c, s, accum in todo:
                key = replace(s, micro_batch=1)
                # cheapest first: once one fits, a costlier row cannot be the pick and is not traced; a larger micro
                # batch of a strategy that did not fit at a smaller one cannot fit, so the smallest is tried first
                skip = None if picked_cost is None or c <= picked_cost else "not traced: costlier than the pick"
                # one micro batch per step is a lower bound of accumulating several (the second runs with gradients
                # alive): probes trace without accumulation, which costs half
                if skip is None and s.micro_batch > smallest[key][0] and key not in fails:
                    judged(replace(s, micro_batch=smallest[key][0]), 1, c)
                if skip is None and accum > 1 and not (key in fails and s.micro_batch >= fails[key]):
                    judged(s, 1, c)
                known = skip is None and key in fails and s.micro_batch >= fails[key]
                if known:
                    skip = (f"not traced: micro batch {fails[key]} of this strategy does not fit without accumulation "
                            "(its traced peak shown, a lower bound)")
                row = judged(s, accum, c, skip, known)
                if row.fits and picked_cost is None:
                    picked_cost = c
                rows.append(row)
                bar.update()
        if any(r.fits for r in rows):
            break
    return sorted(rows, key=lambda r: (not r.fits, r.cost, r.peak_bytes))


def _engine_of(s: Strategy) -> str:
    if s.engine == "fsdp2" or (s.tp > 1 or s.cp > 1) and s.zero == 3:
        return "fsdp2"
    return "ddp" if s.zero == 0 else "deepspeed"


def lever_strategies(hw: Hardware, seq_len: int, global_batch_tokens: int, precision: str, attention: str,
                     parallel) -> list[tuple[Strategy, int]]:
    """Long-context candidates for when nothing else fits: ALST's levers (tiled logits + loss, MLP and RMSNorm, with and
    without activation offload) over ZeRO-3 with full checkpointing, with and without CPU offload of the model
    states, at the smallest micro batch, for every sequence-parallel size planned (plain data parallelism too)."""
    out = []
    for sp, tp, cp in parallel:
        if tp > 1 or cp > 1:
            continue
        dp = hw.world // sp
        per_step_seqs = global_batch_tokens // (seq_len * dp)
        if per_step_seqs < 1:
            continue
        for offload in ("none", "cpu"):
            for levers in ("tiled", "tiled+offload"):
                out.append((Strategy(zero=3, dp=dp, precision=precision, offload=offload, checkpointing="full",
                                     micro_batch=1, seq_len=seq_len, attention=attention, sp=sp, levers=levers),
                            per_step_seqs))
    return out


def _strategies(hw, seq_len, global_batch_tokens, precision, attention, layers, period, sp, tp, cp) -> list[tuple[Strategy, int]]:
    dp = hw.world // (sp * tp * cp)
    per_step_seqs, rem = divmod(global_batch_tokens, seq_len * dp)
    if per_step_seqs < 1 or rem:
        raise HfscaleError(
            f"global batch of {global_batch_tokens:,} tokens does not split into {dp} ranks x sequences of {seq_len}; "
            f"use a multiple of {seq_len * dp:,}"
        )
    micros = [m for m in (1, 2, 4, 8, 16, 32) if per_step_seqs % m == 0]
    ckpt_modes = list(dict.fromkeys(("off", resolve("auto", layers, period), "full")))  # every ~sqrt(L)-th layer
    out = []
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
                    out.append((Strategy(zero=zero, dp=dp, precision=precision, offload=offload, checkpointing=ckpt,
                                         micro_batch=micro, seq_len=seq_len, attention=attention, sp=sp, tp=tp, cp=cp),
                                per_step_seqs // micro))
    if sp * tp * cp == 1:  # FSDP2 (accelerate's fully_shard path), with or without CPU offload of its shards
        for offload in ("none", "cpu"):
            for ckpt in ckpt_modes:
                for micro in micros:
                    out.append((Strategy(dp=dp, precision=precision, offload=offload, checkpointing=ckpt, micro_batch=micro,
                                         seq_len=seq_len, attention=attention, engine="fsdp2"), per_step_seqs // micro))
    return out


def pick(rows: list[Candidate]) -> Candidate | None:
    fitting = [r for r in rows if r.fits]
    return fitting[0] if fitting else None


def shortfall(rows: list[Candidate], hw: Hardware) -> str:
    """What to say when nothing fits: by how much the smallest candidate is over, and what would fit."""
    best = min(rows, key=lambda r: r.peak_bytes)
    if best.peak_bytes <= hw.gpu_mem:  # within the GPU, over the host: offloaded states / activations
        host = min((r for r in rows if r.peak_bytes <= hw.gpu_mem), key=lambda r: r.cpu_bytes_per_node)
        return (f"nothing fits: {host.label} fits the GPU ({host.peak_bytes / 1e9:.1f} GB) but needs "
                f"{host.cpu_bytes_per_node / 1e9:.0f} GB of host memory per node, over {hw.cpu_mem / 1e9:.0f} GB; "
                "give the nodes' real host memory (--cpu-mem) or more nodes")
    over = best.peak_bytes - hw.gpu_mem
    return (f"nothing fits: the smallest candidate ({best.label}) needs {best.peak_bytes / 1e9:.1f} GB per GPU, "
            f"{over / 1e9:.1f} GB over {hw.gpu_mem / 1e9:.0f} GB; it would fit on GPUs with >= {best.peak_bytes / 1e9:.0f} GB, "
            f"or with more GPUs sharding the states (ZeRO-3 divides them by the GPU count)")


def to_scale_spec(row: Candidate, hw: Hardware, name: str = "plan"):
    """The foundation's ScaleSpec for a picked candidate (so --write reuses the config builders)."""
    from ..scale.spec import Launch, Parallel, ScaleSpec, Zero

    off = row.offload
    par = Parallel(sp=row.sp, tp=row.tp, cp=row.cp, sp_attention="flash_attention_2" if row.sp > 1 else "sdpa")
    launch = Launch(num_processes=hw.world, num_machines=hw.nodes,
                    main_process_ip="MAIN_NODE_ADDRESS" if hw.nodes > 1 else None)
    if row.strategy.engine == "fsdp2":  # parameter offload is Zero.offload_params for both engines
        return ScaleSpec(name, engine="fsdp2", zero=Zero(stage=3, offload_params=off) if off != "none" else Zero(stage=0),
                         precision=row.precision, gradient_accumulation_steps=row.grad_accum,
                         gradient_checkpointing=row.checkpointing, launch=launch, parallel=par)
    zero = Zero(stage=row.zero, offload_optimizer=off,
                offload_params=off if (off != "none" and row.zero == 3) else "none",
                nvme_path="/local_nvme/hfscale" if off == "nvme" else None)
    engine = "deepspeed" if row.zero > 0 else "ddp"
    if par.tp > 1 or par.cp > 1:  # transformers TP / torch CP: FSDP2 (or DDP when TP spans the world)
        engine, zero = ("fsdp2", Zero(stage=0)) if row.zero == 3 else ("ddp", Zero(stage=0))
    return ScaleSpec(name, engine=engine, zero=zero if row.zero > 0 and engine == "deepspeed" else Zero(stage=0),
                     precision=row.precision, gradient_accumulation_steps=row.grad_accum,
                     gradient_checkpointing=row.checkpointing, launch=launch, parallel=par)


__all__ = ["ENGINES", "Candidate", "Hardware", "candidates", "judge", "lever_strategies", "peak_bytes", "pick", "shortfall", "parse_size", "to_scale_spec"]
