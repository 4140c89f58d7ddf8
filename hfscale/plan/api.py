"""`hfscale.plan.plan(model, seq_len=..., micro_batch=..., hardware=...) -> Plan`: the planner as one library call.

Every decision lives here, not in the CLI: which model of memory answers, what the trace cannot run and what
then answers instead, the candidates for a hardware budget and the pick, the serving memory. `hfscale plan`
only maps its flags to this call and prints the Plan.

Which model answers (`method`):
  "auto" (default)  the step is traced from transformers' own code on fake tensors (trace.py, peak.py, with
                    DeepSpeed's buffers laid over it by zero.py, FSDP2's by fsdp.py) for every causal LM
                    transformers builds from its config. The analytic terms (memory.py) answer where a step cannot
                    be traced, and the Prediction says why: another optimizer than AdamW, QLoRA's NF4 kernels,
                    tensor / context parallel ranks (one process traces one rank), an op without a fake kernel; in
                    a ranking also for rows that cannot be the pick (states alone over the GPU, costlier than the
                    pick), and for the long-context lever rows (plan/long_context.py).
  "trace"           as auto, but a step that cannot be traced is an error (one line).
  "fast"            the analytic terms alone (model states + saved activations; no temporaries, no phases),
                    for the families memory.py has formulas for; no torch import once the shape is cached.
Kernels (`kernels`): the attention kernels traced follow the hardware planned for: CUDA's flash /
memory-efficient attention when `hardware` (GPUs) is given, the CPU's kernels otherwise.
Candidates share traces: a trace is keyed by the per-rank shapes (micro batch, sequence per rank,
checkpointing, precision as it runs, optimizer), and ZeRO stages, offload and the data-parallel size are laid
over it without tracing again (peak.py's cache).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

from ..util.errors import HfscaleError
from ..scale.optim import DEFAULT_ADAMW
from .memory import Strategy
from .planner import Candidate, Hardware, candidates, pick, shortfall
from .prediction import Prediction, from_analytic, from_trace

METHODS = ("auto", "trace", "fast")


@dataclass(frozen=True)
class Serving:
    """`--inference`: serving memory at a weight quantization, batch and context (default: the sequence)."""

    quant: str = "bf16"
    batch: int = 1
    context: int | None = None
    ram_budget: int | None = None  # MoE: RAM for cached experts when streaming them (hfscale.experts)
    routing: object = None  # MoE: moe_serving.Routing measured on the model (hfscale.experts.routing.calibration_routing)

    def __post_init__(self):
        if self.batch < 1 or (self.context is not None and self.context < 1):
            raise HfscaleError(f"--batch and --context must be at least 1 (got {self.batch}, {self.context})")


@dataclass(frozen=True)
class Plan:
    """What `plan` answers: the prediction for the strategy asked, and with hardware the ranked candidates and
    the pick (None when nothing fits; `nothing_fits` then says by how much)."""

    model: str
    strategy: Strategy
    prediction: Prediction
    kernels: str
    hardware: Hardware | None = None
    candidates: tuple[Candidate, ...] = ()
    pick: Candidate | None = None
    nothing_fits: str | None = None
    serving: Serving | None = None
    inference: dict | None = None
    moe_serving: object = None  # moe_serving.MoEServing for an MoE model with `serving`
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def adamw(self) -> str:
        """torch AdamW's implementation the plan assumed (its step's temporaries are in the traced peak)."""
        return self.strategy.adamw

    def to_dict(self) -> dict:
        """`hfscale plan --json`."""
        out = {"model": self.model, "params": self.prediction.params, "strategy": self.strategy.label,
               "adamw": self.adamw, "adapter": self.strategy.adapter_spec.to_dict(), "prediction": self.prediction.to_dict()}
        if self.inference is not None:
            out["inference"] = self.inference
        if self.moe_serving is not None:
            out["moe_serving"] = self.moe_serving.as_dict()
        if self.hardware is not None:
            out["candidates"] = [c.to_dict() for c in self.candidates]
            out["pick"] = self.pick.to_dict() if self.pick else None
            if self.nothing_fits:
                out["nothing_fits"] = self.nothing_fits
        if self.notes:
            out["notes"] = list(self.notes)
        return out


class _Predictor:
    """One strategy -> one Prediction, by the method asked; the one place a Prediction is made for a plan."""

    def __init__(self, model: str, shape, method: str, kernels: str, adamw: str = DEFAULT_ADAMW):
        self.model, self.shape, self.method, self.kernels, self.adamw = model, shape, method, kernels, adamw
        self._config = None
        self.failed: str | None = None  # the first trace error under "auto" (then the analytic terms answer)

    @property
    def config(self):
        if self._config is None:
            from ..models.builtin import load_config

            self._config = load_config(self.model)
        return self._config

    def why_analytic(self, s: Strategy) -> str | None:
        from .peak import untraceable

        if self.method == "fast":
            return "asked for (--fast): the analytic terms, no temporaries or phases"
        why = untraceable(s)
        if why is None and (s.tp > 1 or s.cp > 1):
            why = "tensor / context parallel ranks are not traced (one process traces one rank): hfscale.plan.parallel"
        if why is None and self.failed:
            why = self.failed
        return why

    def __call__(self, s: Strategy, grad_accum: int = 1, gpu_mem: int | None = None, skip: str | None = None) -> Prediction:
        """`gpu_mem`: a candidate whose model states alone exceed it is answered analytically (it cannot fit);
        `skip`: a reason not to trace this candidate (used where the model has analytic formulas)."""
        from .trace import TraceError

        if s.adamw != self.adamw:  # the planner's candidates run the AdamW the plan was asked for
            s = replace(s, adamw=self.adamw)
        why = self.why_analytic(s)
        if why is None and self.shape.dims is not None and (gpu_mem is not None or skip):
            terms = _analytic(self.shape.dims, s)
            if terms["weights"] + terms["gradients"] + terms["optimizer"] > (gpu_mem or float("inf")):
                return from_analytic(terms, "not traced: the model states alone exceed the GPU")
            if skip:
                return from_analytic(terms, skip)
        if why is None:
            try:
                return self._trace(s, grad_accum)
            except TraceError as e:
                if self.method == "trace" or self.shape.dims is None:
                    raise
                self.failed = why = f"the step cannot be traced ({e})"
        elif self.method == "trace":
            raise HfscaleError(f"--trace: {why}")
        if self.shape.dims is None:
            raise HfscaleError(f"{why}; and {self.shape.dims_error}")
        return from_analytic(_analytic(self.shape.dims, s), why)

    def _trace(self, s: Strategy, grad_accum: int) -> Prediction:
        from .peak import for_strategy

        d = self.shape.dims
        buffers = None
        per_rank = s
        if s.sp > 1:  # Ulysses: a rank holds seq/sp tokens of each sequence; ZeRO shards over dp x sp ranks
            # (planned with flash, whose varlen path builds no mask for packed rows: packing adds nothing)
            per_rank = replace(s, seq_len=s.seq_len // s.sp, dp=s.dp * s.sp, sp=1, packing=False)
            if d is not None:
                from .parallel import parallel_buffers

                buffers = {k: v for k, v in parallel_buffers(d, s).items() if v}
        step = _cached_step(self.model, per_rank, grad_accum, self.kernels,
                            lambda: for_strategy(self.config, per_rank, grad_accum, self.kernels))
        return from_trace(step, _analytic(d, s) if d is not None else None, buffers)


STEP_FORMAT = 1  # bump when what a cached step prediction holds changes


def _cached_step(model: str, s: Strategy, grad_accum: int, kernels: str, compute) -> dict:
    """A strategy's traced step prediction, cached by the config's bytes (as `shape.model_shape` caches a shape),
    the strategy, the hfscale code that computes it and the library versions: a warm plan loads no config and
    imports neither torch nor transformers. Hub names are not cached here (the trace cache still holds them)."""
    import hashlib
    import json
    from dataclasses import asdict
    from importlib.metadata import version

    from ..util.cache import cache_root, cached_json
    from .shape import _source_bytes

    try:
        source = _source_bytes(model)
    except OSError:
        source = None
    if source is None:
        return compute()
    key = json.dumps([asdict(s), grad_accum, kernels, version("torch"), version("transformers"), version("peft"), STEP_FORMAT],
                     sort_keys=True)
    digest = hashlib.sha256(source + _code_digest() + key.encode()).hexdigest()[:32]
    return cached_json(cache_root() / "steps" / f"{digest}.json", compute, lambda v: v["peak"])


@functools.lru_cache(maxsize=1)
def _code_digest() -> bytes:
    """The hfscale code a step prediction comes from (a change is a new cache key, never a stale answer)."""
    import hashlib
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    files = sorted((root / "plan").glob("*.py")) + [root / "models" / "builtin.py", root / "models" / "dims.py", root / "scale" / "checkpointing.py"]
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).digest()


LEVERS_WHY = ("long-context levers, planned analytically per phase (hfscale.plan.long_context.phase_bytes: at or above the "
              "fake-tensor trace of each phase: +0.9% to +17% at Llama-3.1-8B's full size with the four levers, "
              "benchmarks/results/long_context.md)")


def _lever_candidates(d, hw: Hardware, seq_len: int, tokens: int, precision: str, attention: str, sizes,
                      layers: int, adapter: dict | None = None) -> list[Candidate]:
    """ALST's levers over ZeRO-3 + full checkpointing (planner.lever_strategies), each predicted by
    plan/long_context.py; the cost adds the step time the levers add (their recompute and host copies)."""
    from .long_context import alst_levers, lever_prediction
    from .planner import cost, judge, lever_strategies

    out = []
    todo = lever_strategies(hw, seq_len, tokens, precision, attention, sizes)
    max_tokens = max((s.micro_batch * seq_len // s.sp for s, _ in todo), default=1)
    for s, accum in todo:
        s = replace(s, **(adapter or {}))  # the adapter asked for (its model states in lever_prediction's terms)
        base = replace(s, levers="none")
        levers = alst_levers(d, base, offload=s.levers.endswith("offload"))
        lp = lever_prediction(d, base, levers)
        terms = {k: lp.base[k] for k in ("weights", "gradients", "optimizer", "activations", "recompute_working",
                                         "zero3_live")}
        states = {k: terms[k] for k in ("weights", "gradients", "optimizer", "zero3_live") if terms[k]}
        pred = Prediction("analytic", lp.total, d.params, lp.base.get("trainable_params", d.params), lp.base["offloaded_per_rank"] + lp.host_bytes_per_rank,
                          breakdown={**states, **lp.changes}, terms=terms,
                          not_traced=LEVERS_WHY,
                          extra={"levers": {"tiled_loss": levers.tiled_loss, "tiled_mlp": levers.tiled_mlp,
                                            "offload_activations": levers.offload_activations,
                                            "tiled_norm": levers.tiled_norm},
                                 "host_activations_per_rank": lp.host_bytes_per_rank, "time_factor": lp.time_factor,
                                 "peak_phase": lp.peak_phase, "phases": lp.phases})
        out.append(judge(s, accum, pred, hw, round(cost(layers, base, max_tokens) + lp.time_factor - 1, 4)))
    return out


def _analytic(d, s: Strategy) -> dict:
    """The analytic terms; FSDP2 (fully sharded parameters, gradients and optimizer) takes ZeRO-3's."""
    from .parallel import analytic

    return analytic(d, replace(s, engine="auto", zero=3) if s.engine == "fsdp2" else s)


def _parallel(sp, tp, cp, hw: Hardware | None, heads, model: str, seq_len: int):
    """sp / tp / cp as a validated Parallel, checked against the model's heads (SP assumed on flash attention,
    as on GPUs); HfscaleError with the value to set."""
    from ..scale.parallel import require_model_fits
    from ..scale.spec import Parallel

    sp, tp, cp = (1 if v is None else v for v in (sp, tp, cp))
    par = Parallel(sp=sp, tp=tp, cp=cp, sp_attention="flash_attention_2")
    if sp > 1 and tp > 1:
        raise HfscaleError("--sp (DeepSpeed Ulysses) and --tp (transformers TP under FSDP2) do not compose in accelerate; drop one")
    if hw is not None and par.size > hw.gpus_per_node:
        raise HfscaleError(f"sp x tp x cp = {par.size} spans more than one node of {hw.gpus_per_node} GPUs; use sizes whose "
                           f"product is at most {hw.gpus_per_node}")
    if hw is not None and hw.world % par.size:
        raise HfscaleError(f"sp x tp x cp = {par.size} does not divide the {hw.world} GPUs; "
                           "use sizes whose product divides the GPU count")
    if par.size > 1:
        require_model_fits(par, heads, model, seq_len=seq_len)
    return par


def _adapter_fields(s: Strategy) -> dict:
    """The adapter settings every candidate carries (the strategy asked for decides them)."""
    return {"adapter": s.adapter, "lora_rank": s.lora_rank, "base_bits": s.base_bits}


def _no_sp_note(heads, sp_asked, sizes) -> str:
    """Why no sequence-parallel candidate was planned, when the model rules it out."""
    if heads is None or sp_asked is not None or any(sp > 1 for sp, _, _ in sizes):
        return ""
    from ..scale.parallel import model_problems
    from ..scale.spec import Parallel

    errs = [p for p in model_problems(Parallel(sp=2, sp_attention="flash_attention_2"), heads) if p.severity == "error"]
    return f"; sequence parallel is no candidate: {errs[0].what}" if errs else ""


def plan(model: str, seq_len: int, micro_batch: int, *, checkpointing: str = "off", zero: int = 0,
         offload: str = "none", dp: int | None = None, precision: str = "bf16", optimizer: str = "adamw",
         attention: str = "sdpa", lora_rank: int = 0, base_bits: int = 16, sp: int | None = None,
         tp: int | None = None, cp: int | None = None, hardware: Hardware | None = None,
         global_batch_tokens: int | None = None, method: str = "auto", kernels: str | None = None,
         serving: Serving | None = None, engine: str = "auto", engines=None, adamw: str = DEFAULT_ADAMW,
         progress: bool = False, packing: bool = False, adapter: str = "none") -> Plan:
    """Predict per-rank memory of training `model` (a built-in name, config.json, model directory or hub name)
    with the strategy given (`engine`: "auto" = DDP at ZeRO 0, DeepSpeed at 1-3; "fsdp2" = FSDP2, its per-rank
    rules laid over the trace by plan/fsdp.py); with `hardware`, rank every strategy for it (DDP, ZeRO 1-3 and FSDP2,
    offload, checkpointing, micro batch, and sp / tp / cp where plain data parallelism does not fit; `engines`: a
    subset of planner.ENGINES to rank, default all) and pick the cheapest that fits. `adamw`: torch AdamW's
    implementation the step is traced with (hfscale.scale.optim; fused: what the recipes build and Trainer's default).
    `packing`: rows packed with documents under sdpa / eager: the traced step counts the block-diagonal mask each
    layer type gets (flash varlen builds none: plan that without it).
    `adapter`: none | lora | dora | qlora (hfscale.scale.adapters.AdapterSpec's kind, rank `lora_rank` or the spec's
    default): the recipe's adapter planned for the strategy asked and every candidate.
    Raises HfscaleError (one line) for invalid input; see the module docstring for `method` and `kernels`."""
    from .kernels import KERNELS
    from .parallel import parallel_options
    from .shape import model_shape

    if method not in METHODS:
        raise HfscaleError(f"method must be one of {', '.join(METHODS)} (got {method!r})")
    if kernels is not None and kernels not in KERNELS:
        raise HfscaleError(f"--kernels must be one of {', '.join(KERNELS)} (got {kernels!r})")
    if packing and method == "fast":
        raise HfscaleError("--packing is counted by the traced step and --fast traces nothing; drop one")
    if kernels is not None and method == "fast":
        raise HfscaleError("--kernels chooses the traced attention kernels and --fast traces nothing; drop one")
    if optimizer != "adamw" and adamw != DEFAULT_ADAMW:  # a choice that would be ignored is refused
        raise HfscaleError(f"--adamw {adamw} chooses torch AdamW's implementation, and --optimizer {optimizer} is not "
                           "AdamW; drop --adamw or use --optimizer adamw")
    kernels = kernels or ("cuda" if hardware is not None else "cpu")
    from .planner import ENGINES

    engines = tuple(ENGINES if engines is None else engines.split(",") if isinstance(engines, str) else engines)
    if not engines or any(e not in ENGINES for e in engines):
        raise HfscaleError(f"--engines takes a comma-separated subset of {','.join(ENGINES)} (got {','.join(engines)!r})")
    shape = model_shape(model)
    if shape.heads is None and any(v not in (None, 1) for v in (sp, tp, cp)):
        raise HfscaleError(shape.heads_error)
    par = _parallel(sp, tp, cp, hardware, shape.heads, model, seq_len)
    dp = dp if dp is not None else (hardware.world // par.size if hardware else 1)  # dp 0 is refused, not made 1
    s = Strategy(zero=zero, dp=dp, precision=precision, optimizer=optimizer, offload=offload,
                 checkpointing=checkpointing, micro_batch=micro_batch, seq_len=seq_len, attention=attention,
                 lora_rank=lora_rank, base_bits=base_bits, sp=par.sp, tp=par.tp, cp=par.cp, engine=engine, adamw=adamw,
                 packing=packing, adapter=adapter)
    d = shape.dims
    if d is None and (method == "fast" or serving is not None):
        raise HfscaleError(f"{shape.dims_error}; {'--inference' if serving else '--fast'} needs those formulas: drop it "
                           "and the step is traced from transformers' own code instead")
    predict = _Predictor(model, shape, method, kernels, s.adamw)
    # with hardware, the strategy asked is judged like every candidate: its states alone over the GPU -> not traced
    pred = predict(s, 1, hardware.gpu_mem if hardware is not None and method == "auto" else None)
    notes = []
    if packing:
        notes.append("--packing: the block-diagonal attention masks of packed rows are in the traced step, not in the "
                     "analytic terms")
    if pred.source == "trace" and d is None:
        notes.append(f"{shape.model_type}: no analytic formulas, so the step was traced from transformers' own code")
    inference = moe = None
    if serving is not None:
        from .memory import inference_bytes
        from .moe_serving import for_model

        inference = inference_bytes(d, serving.quant, serving.batch, serving.context or seq_len)
        moe = for_model(model, d, serving.quant, inference["kv_cache"], hardware.gpu_mem if hardware else None,
                        serving.ram_budget, serving.routing, serving.routing is not None)
    rows, best, nothing = (), None, None
    if hardware is not None:
        if global_batch_tokens is not None and global_batch_tokens < 1:
            raise HfscaleError(f"--global-batch-tokens must be positive (got {global_batch_tokens})")
        tokens = global_batch_tokens or micro_batch * seq_len * hardware.world
        sizes = (parallel_options(shape.heads, hardware, seq_len, sp, tp, cp) if shape.heads is not None else [(1, 1, 1)])
        if method == "trace":  # tensor / context parallel ranks are not traced: not candidates when a trace is required
            sizes = [p for p in sizes if p[1] == p[2] == 1]
        from .peak import repeat_period

        period = repeat_period(list(d.layer_types)) if d is not None and d.layer_types else 1
        rows = candidates(hardware, seq_len, tokens, predict, shape.layers, precision, attention, sizes, packing=packing,
                          progress=progress,
                          period=period, engines=engines, adapter=_adapter_fields(s))
        if predict.failed and any(c.prediction.source == "trace" for c in rows):
            # a candidate's step could not be traced: rank them all on the analytic terms (one basis), and say why
            notes.append(f"candidates ranked on the analytic terms: {predict.failed}")
            rows = candidates(hardware, seq_len, tokens, predict, shape.layers, precision, attention, sizes, packing=packing,
                              period=period,
                              engines=engines, adapter=_adapter_fields(s))
        if not rows:
            raise HfscaleError(f"no {','.join(engines)} strategy exists for sp/tp/cp {sizes}; add an engine (--engines) "
                               "or drop --sp / --tp / --cp")
        best = pick(rows)
        if best is None and d is not None and "deepspeed" in engines:  # the long-context levers, where nothing else fits
            rows = rows + _lever_candidates(d, hardware, seq_len, tokens, precision, attention, sizes, shape.layers,
                                            _adapter_fields(s))
            rows.sort(key=lambda r: (not r.fits, r.cost, r.peak_bytes))
            best = pick(rows)
        if best is None:
            nothing = shortfall(rows, hardware) + _no_sp_note(shape.heads, sp, sizes)
        rows = tuple(rows)
    return Plan(model, s, pred, kernels, hardware, rows, best, nothing, serving, inference, moe, tuple(notes))


__all__ = ["METHODS", "Plan", "Serving", "plan"]
