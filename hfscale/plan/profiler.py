"""The measured memory timeline of real training steps, per rank, by kind and phase: `MemoryProfiler` for any
loop (the recipes' and yours), and the report `hfscale profile` writes (`write_report`).

    hfscale profile --steps 3 --out prof/                                   # the tiny model, 1 process
    hfscale profile --config accelerate_configs/zero2.yaml --num-processes 2 --out prof/
    accelerate launch --config_file X.yaml -m hfscale.proofs.profile --out prof/ranks   # what the above runs

`MemoryProfiler` is the piece for your own loop (`from hfscale.plan.profiler import MemoryProfiler`): built after
`accelerator.prepare`, it counts, with torch's MemTracker (`hfscale.plan.tracker`), every tensor the
model, the optimizer and the engine hold (parameters, gradients, optimizer states, DeepSpeed's flat
fp32 partitions and buckets, ZeRO-3's partitions; data tensors are not counted) and every tensor the
steps create, and samples the live bytes after each op that changes them:

    prof = MemoryProfiler(model, optimizer)
    with prof.phase("forward", step): loss = model(...).loss
    with prof.phase("backward", step): accelerator.backward(loss)
    with prof.phase("optimizer", step): optimizer.step(); optimizer.zero_grad()
    result = prof.result()     # a RankProfile: samples, per-step phase peaks, step 1 vs steady

What MemTracker cannot see is reported apart, never guessed: DDP's C++ gradient buckets (from DDP's own
logging data, `ddp_bucket_bytes`), allocator caching. On CUDA the rank also records PyTorch's allocator
history and writes the snapshot that https://pytorch.org/memory_viz opens, with max_memory_allocated /
max_memory_reserved per phase (written for CUDA; not run yet: no GPU has been lent to this project).
Run on CPU here (2 processes over gloo, DDP and DeepSpeed ZeRO 0-3): tests/test_profile.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..scale.optim import adamw_impl, as_planned, optimizer_chain  # noqa: F401  (adamw_impl: importable here too)
from .tracker import Sample, phase_peak, step_tracker

PHASES = ("forward", "backward", "optimizer")


@dataclass
class RankProfile:
    """One rank's measured steps. `phases[i]` is step i+1's {phase: {"bytes", "breakdown"}}."""

    rank: int
    world: int
    device: str  # cpu | cuda: where the tracked bytes live (on cpu, offloaded states are in the same memory)
    engine: str
    zero: int
    offload: str
    precision: str
    model: str
    micro_batch: int
    seq_len: int
    checkpointing: str
    attention: str
    adamw: str
    samples: list[Sample]
    phases: list[dict]
    extra: dict = field(default_factory=dict)  # bytes MemTracker cannot see (DDP's buckets), CUDA's numbers
    grad_accum: int = 1
    reshard_after_forward: bool = True  # FSDP2's setting (the planner models both)
    adapter: str = "none"  # hfscale.scale.adapters.AdapterSpec's kind trained (none: every parameter)
    lora_rank: int = 0
    step_seconds: list[float] = field(default_factory=list)  # wall seconds per step, under the tracker
    trained: int | None = None  # the most tokens a profiled micro batch trained (packed batches); None: full blocks

    @property
    def peak_step1(self) -> int:
        return max(p["bytes"] for p in self.phases[0].values())

    @property
    def peak(self) -> int:
        """The largest phase peak of the last step: the steady state (step 2 can still hold one-time work,
        such as DDP's bucket rebuild; profile 3 steps or more)."""
        return max(p["bytes"] for p in self.phases[-1].values())

    def summary(self) -> dict:
        steady = self.phases[-1]
        at = max(steady, key=lambda k: steady[k]["bytes"])
        return {"peak": self.peak, "peak_step1": self.peak_step1, "peak_phase": at,
                "phases": {k: v["bytes"] for k, v in steady.items()},
                "phases_step1": {k: v["bytes"] for k, v in self.phases[0].items()},
                "peak_breakdown": steady[at]["breakdown"]}

    def to_dict(self) -> dict:
        d = asdict(self)
        d["samples"] = [[s.op, s.label, s.kinds] for s in self.samples]
        d["measured"] = self.summary()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "RankProfile":
        d = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**{**d, "samples": [Sample(*s) for s in d["samples"]]})


def _tensors_in(obj, depth: int = 3, seen: set | None = None):
    """Tensors held in `obj`'s attributes and in lists / tuples / dicts below them (not in other objects:
    an engine refers to its module, its config, the process group ...)."""
    import torch

    seen = set() if seen is None else seen
    if id(obj) in seen or depth < 0:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if isinstance(obj, dict):
        values = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        values = list(obj)
    else:
        values = list(getattr(obj, "__dict__", {}).values())
    for v in values:
        if isinstance(v, (torch.Tensor, dict, list, tuple)):
            yield from _tensors_in(v, depth - 1, seen)


class MemoryProfiler:
    """Counts what a rank holds through the steps run under `phase(...)` (see the module docstring)."""

    def __init__(self, model, optimizer, engine=None):
        import torch

        self.mt = step_tracker(record=True)
        self.phases: list[dict] = []
        self.model = model
        self.invisible_seen: dict[str, int] = {}
        # first what is neither a parameter nor an optimizer state (DeepSpeed's flat buffers, ZeRO-3's
        # partitions, fp32 master copies), then parameters / buffers, then optimizer states: MemTracker
        # keeps the last kind given to a storage, so a parameter viewing a flat buffer counts as a parameter
        chain = optimizer_chain(optimizer)
        held = []
        for obj in [*chain, engine, *(p for p in model.parameters())]:
            if obj is not None:
                held.extend(t for t in _tensors_in(obj) if t.untyped_storage().nbytes())
        if held:
            self.mt.track_external(*held)
        self.mt.track_external(model)
        from ..scale.adapters import quant_state_tensors

        # a QLoRA base's quant state (1,198,416 B on the 101.6M Gemma 3 of benchmarks/results/adapters.md)
        self.mt.track_as_parameters(*(t for p in model.parameters() for t in quant_state_tensors(p)))
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if grads:
            self.mt.track_external(*grads)
        for opt in chain:
            if isinstance(opt, torch.optim.Optimizer):
                self.mt.track_external(opt)
        self.cuda = torch.cuda.is_available()
        if self.cuda:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        self.trained: int | None = None

    def saw_trained(self, tokens: int) -> None:
        """A profiled micro batch trained `tokens` tokens (the LM head runs at those positions only,
        hfscale.models.loss): the prediction traces the most of them."""
        self.trained = max(self.trained or 0, int(tokens))

    @contextlib.contextmanager
    def phase(self, name: str, step: int):
        """Run one phase of step `step` (1-based) under the tracker; its peak is kept by kind."""
        import torch

        if name not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {name!r}")
        while len(self.phases) < step:
            self.phases.append({})
        self.mt.label = f"step {step} {name}"
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        with self.mt:
            self.mt.sample()
            yield
        peak = phase_peak(self.mt)
        invisible = {k: v for k, v in {"ddp_buckets": ddp_bucket_bytes(self.model)}.items() if v}
        self.invisible_seen.update(invisible)
        entry = {"bytes": peak.bytes + sum(invisible.values()), "breakdown": {**peak.breakdown, **invisible}}
        if self.cuda:
            entry["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
            entry["cuda_max_reserved"] = torch.cuda.max_memory_reserved()
        old = self.phases[step - 1].get(name)
        if old is None or entry["bytes"] > old["bytes"]:  # accumulation: the largest of the micro batches
            self.phases[step - 1][name] = entry
        if name == "optimizer":
            self.mt.reset_mod_stats()  # MemTracker tracks one call per module between resets

    def result(self, accelerator, optimizer, model_name: str, micro_batch: int, seq_len: int, checkpointing: str,
               precision: str, snapshot_dir: str | os.PathLike | None = None, grad_accum: int = 1) -> RankProfile:
        """This rank's RankProfile (on CUDA the allocator snapshot goes to snapshot_dir/rank{R}_cuda_snapshot.pickle)."""
        import torch.distributed as dist

        from ..scale.runtime import deepspeed_engine

        engine = deepspeed_engine(accelerator)
        zero = engine.zero_optimization_stage() if engine is not None else 0
        offload = "none"
        if engine is not None:
            zc = accelerator.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {})
            offload = (zc.get("offload_optimizer") or {}).get("device", "none") or "none"
        reshard = True
        fsdp = getattr(accelerator.state, "fsdp_plugin", None) if accelerator.is_fsdp2 else None
        if fsdp is not None:  # FSDP2: ZeRO-3's semantics, offload as the plugin says
            from torch.distributed.fsdp import CPUOffloadPolicy

            zero, reshard = 3, bool(fsdp.reshard_after_forward)
            offload = "cpu" if isinstance(fsdp.cpu_offload, CPUOffloadPolicy) else "none"
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        extra = dict(self.invisible_seen)
        if self.cuda and snapshot_dir is not None:
            extra["cuda_snapshot"] = self.dump_cuda_snapshot(Path(snapshot_dir) / f"rank{rank}_cuda_snapshot.pickle")
        kind = "deepspeed" if engine is not None else str(accelerator.distributed_type).split(".")[-1]
        return RankProfile(rank, world, "cuda" if self.cuda else "cpu", kind, zero, offload, precision, model_name,
                           micro_batch, seq_len, checkpointing, config_attention(self.model), adamw_impl(optimizer),
                           self.mt.samples, self.phases, extra, grad_accum, reshard, trained=self.trained)

    def dump_cuda_snapshot(self, path: str | os.PathLike) -> str | None:
        """PyTorch's allocator snapshot (open it at https://pytorch.org/memory_viz); None on CPU."""
        if not self.cuda:
            return None
        import torch

        from ..util.atomic import staged

        with staged(path) as stage:
            torch.cuda.memory._dump_snapshot(str(stage))
        torch.cuda.memory._record_memory_history(enabled=None)
        return str(path)


def config_attention(model) -> str:
    """The attention implementation the (possibly wrapped) model runs."""
    inner = getattr(model, "module", model)
    return getattr(inner.config, "_attn_implementation", None) or "eager"


def ddp_bucket_bytes(model) -> int:
    """Bytes of DDP's gradient buckets that MemTracker cannot see, from DDP's logging data: those allocated in
    C++ when DDP wraps the model. DDP rebuilds them in the forward of step 2 through the dispatcher (then
    they are counted like any tensor, and the first ones are freed), so this is 0 after the rebuild."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel) or getattr(model, "_has_rebuilt_buckets", False):
        return 0
    data = model._get_ddp_logging_data()
    if data.get("gradient_as_bucket_view"):
        return 0  # the buckets are the gradients, already counted
    return int(data.get("total_parameter_size_bytes", 0))


def predict(config, r: dict) -> dict:
    """The plan's traced prediction (`hfscale.plan.peak.step_prediction`) for what rank report `r` ran;
    {"error": why} where the trace refuses."""
    from ..util.errors import HfscaleError
    from .peak import step_prediction

    from ..models.varlen import NAME as VARLEN

    precision = {"fp16": "bf16"}.get(r["precision"], r["precision"])  # same bytes per element
    adamw = as_planned(r["adamw"])  # DeepSpeed's own optimizers step in place, like fused
    # hfscale's varlen kernel (padded rows or padding-free) builds no mask and runs sdpa per group of documents: the
    # plan's unpacked sdpa step (measured on the tiny recipe, seq_len 64: docs/data.md)
    attention = "sdpa" if r["attention"] == VARLEN else r["attention"]
    try:
        return step_prediction(config, r["micro_batch"], r["seq_len"], precision, attention, r["checkpointing"],
                               grad_accum=r.get("grad_accum", 1), zero=r["zero"], dp=r["world"], offload=r["offload"], engine=r["engine"], adamw=adamw,
                               reshard_after_forward=r.get("reshard_after_forward", True),
                               rank=r.get("rank"), kernels="cuda" if str(r.get("device", "cpu")).startswith("cuda") else "cpu",
                               lora_rank=r.get("lora_rank", 0), adapter=r.get("adapter", "none") if r.get("lora_rank") else "lora",
                               trained=r.get("trained"))
    except HfscaleError as e:
        return {"error": str(e)}


def write_report(directory: str | os.PathLike, reports: list[dict], config, title: str) -> list[dict]:
    """profile.json (per rank: measured, predicted, error) and timeline.png into `directory` from the rank
    reports; `config` None skips the prediction. Returns the per-rank rows."""
    from ..util.atomic import write_text_atomic
    from ..util.extras import installed, line
    from .plot import plot_timeline

    preds = {r["rank"]: None if config is None else predict(config, r) for r in reports}  # ranks differ (ZeRO-2)
    rows = []
    for r in reports:
        pred = preds[r["rank"]]
        m = RankProfile.from_dict(r).summary()
        row = {"rank": r["rank"], "world": r["world"], "device": r["device"], "engine": r["engine"], "zero": r["zero"],
               "precision": r["precision"], "adamw": r["adamw"], "measured": m, "invisible_to_tracker": r["extra"],
               "step_seconds": r.get("step_seconds", [])}
        if pred and "peak" in pred:
            row["predicted"] = {k: pred[k] for k in ("peak", "peak_step1", "phases", "phases_step1", "peak_breakdown",
                                                     "offloaded_per_rank")}
            # on a CPU host, offloaded states live in the memory the tracker counts: compare device + host
            both = r["device"] == "cpu" and pred["offloaded_per_rank"] > 0
            row["compared"] = "device + offloaded (one memory on a CPU host)" if both else "device"
            steady = pred["phases_with_host"] if both else pred["phases"]
            step1 = pred["phases_step1_with_host"] if both else pred["phases_step1"]
            row["compared_peak"], row["compared_peak_step1"] = max(steady.values()), max(step1.values())
            row["error"] = {"peak": row["compared_peak"] / m["peak"] - 1,
                            "peak_step1": row["compared_peak_step1"] / m["peak_step1"] - 1}
        rows.append(row)
    r0 = reports[0]
    pred = preds[r0["rank"]]
    doc = {"model": r0["model"], "steps": len(r0["phases"]), "micro_batch": r0["micro_batch"], "seq_len": r0["seq_len"],
           "checkpointing": r0["checkpointing"], "ranks": rows,
           "prediction_error": pred.get("error") if pred else None}
    write_text_atomic(Path(directory) / "profile.json", json.dumps(doc, indent=1))
    if not installed("matplotlib"):  # the numbers are in profile.json; the picture is the [plot] extra's
        print(line("timeline.png", "plot"), file=sys.stderr)
        return rows
    plot_timeline(reports, str(Path(directory) / "timeline.png"), title,
                  predicted={k: p["peak"] for k, p in preds.items() if p and "peak" in p})
    return rows
