"""The step peak per rank for a strategy: a traced step (`trace.py`), cached, scaled to the micro batch,
with ZeRO's sharding and offload applied to the traced model states.

- Cache: traces are stored as JSON under `$HFSCALE_CACHE` (default `~/.cache/hfscale/traces`), keyed by
  the config's JSON, the trace arguments and the torch/transformers versions, so a repeated plan or a
  candidate search does not re-trace what it has seen.
- Micro batch: traced as given. Phase peaks are not linear in the micro batch (the op at which a phase
  peaks moves: extrapolating tiny Gemma's checkpointed backward from micro batches 1 and 2 to 4 missed
  by 9.5%), so each micro batch is its own trace; the cache makes a repeated search cheap.
- Depth: a model whose layers repeat with a period p (`layer_types`, e.g. Gemma 3's 5 sliding + 1 global;
  p = 1 for Llama-likes; with every:K checkpointing lcm(p, K)) and no other per-layer settings is traced
  at L0 = L mod p + p and L0 + p layers (at least 2), and forward / backward are extrapolated per kind:
  phase(L) = phase(L0) + (L - L0) / p x (phase(L0 + p) - phase(L0)). Exact on every checked row
  (16-layer Llama and 26-layer Gemma 3 1B, checkpointing off / full / every:4: 0.0000%; tests/test_trace.py::
  test_depth_scaling_is_exact keeps the Llama row).
  The optimizer step is not extrapolated (its peak follows the largest parameters, -1.8% on Gemma 3 1B
  when it was): it is traced on the full-depth model alone, which costs no forward or backward.
- Engines: DDP is the trace itself plus DDP's gradient buckets; DeepSpeed ZeRO 1-3 and offload lay
  DeepSpeed's own buffers over the trace (`zero.py`, measured against DeepSpeed ranks); FSDP2 lays its units'
  gathers and shards over it (`fsdp.py`, measured against FSDP2 ranks). ZeRO-3's and FSDP2's backward walk the
  traced gradient arrivals, which a trace scaled in depth does not keep: there each shallow trace is walked and the
  engine's backward extrapolated per kind (`_depth_scaled_backward`; equal to walking the full-depth trace on the
  checked rows, tests/test_trace.py, but ZeRO-3 full fine-tuning's step-1 backward on a 20-layer Gemma 3, -1.8%).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from dataclasses import replace

from ..util.cache import cache_root, cached_json
from ..util.errors import HfscaleError
from .memory import runs_as
from ..scale.optim import DEFAULT_ADAMW
from .trace import PhasePeak, StepTrace, trace_step

# bump when what a trace records changes (2: gradients made in backward count as gradients, not temporaries;
# 3: gradient arrivals in backward, for ZeRO-2's per-rank partition; 4: no S x S mask where checkpointing turns the
# cache off, trace._unpacked_rows; 5: no module-input hooks, so a graph backward never runs through is freed when
# its last reference goes, not when the GC runs: DoRA's delta weight, tracker.py; 6: the forward's peak within the
# decoder layers, StepTrace.forward_in_layers; 7: a packed step's LM head and loss at the trained positions only,
# hfscale.models.loss.head_at)
TRACE_FORMAT = 7


trace_precision = runs_as  # what a planned precision runs as: decided in one place (memory.runs_as)


def cache_dir() -> Path:
    return cache_root() / "traces"


def _key(config, kw: dict) -> str:
    import torch
    import transformers

    text = json.dumps([config.to_json_string(use_diff=False), kw, torch.__version__, transformers.__version__,
                       TRACE_FORMAT],
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def repeat_period(types: list) -> int:
    return next(p for p in range(1, len(types) + 1) if all(t == types[i % p] for i, t in enumerate(types)))


def _layer_period(config) -> int | None:
    """The period of the decoder layers' structure (parameter names, shapes, module classes), from the
    model built on the meta device; None when there are no decoder layers to compare."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import GradientCheckpointingLayer

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    except Exception:  # noqa: BLE001 - not buildable as a causal LM: the full trace says why, in one line (TraceError)
        return None
    sig = [tuple((n, tuple(p.shape), str(p.dtype)) for n, p in m.named_parameters())
           + tuple(type(x).__name__ for x in m.modules())
           for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    return repeat_period(sig) if sig else None


def depth_plan(config, checkpointing: str) -> tuple[int, int, int] | None:
    """(L, L0, L1) when the trace can be scaled in depth: the layer types and the layers' structure repeat,
    and no other config entry is per layer (Gemma 4's KV-shared and double-wide layers are caught here)."""
    import math

    from ..scale.checkpointing import every_n_layers

    d = config.to_dict()
    L = d.get("num_hidden_layers")
    if not isinstance(L, int) or L < 4:
        return None
    per_layer = [k for k, v in d.items() if isinstance(v, list) and len(v) == L]
    if any(k != "layer_types" for k in per_layer) or d.get("num_kv_shared_layers"):
        return None
    p = repeat_period(d["layer_types"]) if "layer_types" in per_layer else 1
    structure = _cached_json("period", config, {}, lambda: {"period": _layer_period(config)})["period"]
    if structure is None:
        return None
    k = every_n_layers(checkpointing)
    p = math.lcm(p, structure, k or 1)
    L0 = L % p + p
    while L0 < 2:
        L0 += p
    return (L, L0, L0 + p) if L0 + p < L else None


def truncated(config, layers: int):
    """The same config with its first `layers` decoder layers."""
    import copy

    c = copy.deepcopy(config)
    c.num_hidden_layers = layers
    if isinstance(getattr(c, "layer_types", None), list):
        c.layer_types = c.layer_types[:layers]
    return c


def scaled_trace(config, **kw) -> StepTrace:
    """The step trace at full depth: traced directly, or scaled from two shallower traces (see above)."""
    plan = depth_plan(config, kw.get("checkpointing", "off"))
    if plan is None:
        return cached_trace(config, **kw)
    L, L0, L1 = plan
    # forward and backward from two shallower traces (their optimizer steps are not needed: skipped)
    a, b = (cached_trace(truncated(config, n), **kw, optimizer=False) for n in (L0, L1))
    # the optimizer step depends on the parameters only: one trace serves every sequence, micro batch and mode
    full = cached_trace(config, micro_batch=1, seq_len=1, precision=kw["precision"], lora_rank=kw.get("lora_rank", 0),
                        optimizer_only=True, **({"adapter": kw["adapter"]} if "adapter" in kw else {}), **({"adamw": kw["adamw"]} if kw.get("adamw", "fused") != "fused" else {}))
    n = (L - L0) // (L1 - L0)

    def ext(x: PhasePeak, y: PhasePeak) -> PhasePeak:
        kinds = extrapolated(x.breakdown, y.breakdown, n)
        return PhasePeak(sum(kinds.values()), {k: v for k, v in kinds.items() if v})

    micro = [{ph: ext(ma[ph], mb[ph]) for ph in ma} for ma, mb in zip(a.micro, b.micro)]
    return replace(full, micro=micro, seconds=a.seconds + b.seconds + full.seconds, depth=[L0, L1],
                   micro_batch=a.micro_batch, seq_len=a.seq_len, attention=a.attention, checkpointing=a.checkpointing,
                   kernels=a.kernels, packing=a.packing, attention_kernels=extrapolated(a.attention_kernels, b.attention_kernels, n,
                                                                      keys=b.attention_kernels))


def _cached_json(kind: str, config, kw: dict, compute) -> dict:
    """`compute()` (a JSON-able dict), read from or written to the cache."""
    return cached_json(cache_dir() / f"{kind}-{_key(config, kw)}.json", compute)


def cached_trace(config, **kw) -> StepTrace:
    """`trace_step(config, **kw)` through the cache."""
    return StepTrace.from_dict(_cached_json("trace", config, kw, lambda: trace_step(config, **kw).to_dict()))


def step_prediction(config, micro_batch: int, seq_len: int, precision: str, attention: str = "sdpa",
                    checkpointing: str = "off", lora_rank: int = 0, grad_accum: int = 1, zero: int = 0,
                    dp: int = 1, offload: str = "none", engine: str = "auto", adamw: str = DEFAULT_ADAMW,
                    rank: int | None = None, kernels: str = "cpu", reshard_after_forward: bool = True,
                    packing: bool = False, adapter: str = "lora", trained: int | None = None) -> dict:
    """`prediction.peak`, `peak_step1`, `phases`, `phases_step1`, `peak_breakdown` per rank for a strategy.
    engine: "ddp" (torch DDP through accelerate), "deepspeed", "fsdp2", or "auto" (ddp at ZeRO-0, else deepspeed).
    adamw: torch AdamW's implementation the run uses (trace.ADAMW; fused is transformers Trainer's default).
    rank: the rank to predict (ZeRO-2's backward differs per rank); None: the highest of all ranks.
    kernels: the attention kernels traced, "cpu" or "cuda" (`kernels.py`).
    packing: rows packed with documents: the traced step counts the block-diagonal masks (trace.packed_rows).
    adapter: with lora_rank > 0, its kind (lora / dora; hfscale.scale.adapters.AdapterSpec, the recipe's targets).
    trained: the tokens a micro batch trains, where fewer than every position (masked prompts): the LM head and loss
    traced at that many positions (trace.trained_rows); None: every position."""
    engine = ("ddp" if zero == 0 else "deepspeed") if engine == "auto" else (
        "deepspeed" if engine.lower() == "deepspeed" else "fsdp2" if engine.lower() in ("fsdp", "fsdp2") else "ddp")
    kw = dict(seq_len=seq_len, precision=trace_precision(precision, zero, engine), attention=attention,
              checkpointing=checkpointing, lora_rank=lora_rank, grad_accum=min(grad_accum, 2))
    if adamw != "fused":  # the default stays out of the cache key: traces cached before it existed stay valid
        kw["adamw"] = adamw
    if kernels != "cpu":
        kw["kernels"] = kernels
    if packing:  # unpacked traces keep their cache keys
        kw["packing"] = True
    elif trained is not None:  # so do traces of every position
        kw["trained"] = int(trained)
    nf4_delta = 0
    if lora_rank and adapter == "qlora":  # the LoRA trace with its decoder linears held as NF4 (bitsandbytes has no
        # fake kernels); FSDP2 is refused as the recipe refuses it: no run to predict
        refused = _qlora_refusal(engine)
        if refused is not None:
            raise HfscaleError(refused)
        from ..models.dims import dims_from_config
        from .trace import TraceError
        from .zero import REUSE_DISTANCE

        if engine == "deepspeed" and zero == 3 and dims_from_config(config).params > REUSE_DISTANCE:
            # checked before tracing: the planner's Predictor takes a TraceError to the analytic terms
            raise TraceError("QLoRA under ZeRO-3 above stage3_max_reuse_distance (one module gathered at a time) is "
                             "not traced")
        nf4_delta = _nf4_delta(config, kw["precision"])
        adapter = "lora"
    if lora_rank:  # the recipe's targets (not peft's all-linear, as adapter traces were cached before): new keys
        kw["adapter"] = adapter
    tr = scaled_trace(config, micro_batch=micro_batch, **kw)

    def engine_steps(t: StepTrace, cfg) -> dict:
        """{steady: {phase: {kind: bytes}}} of trace `t` (of model `cfg`) under the engine."""
        if engine == "deepspeed":
            from .zero import deepspeed_phases

            hidden = getattr(cfg.get_text_config(), "hidden_size", 0) or 0
            return {s: deepspeed_phases(t, zero, dp, offload, hidden, s, grad_accum, adamw, rank) for s in (True, False)}
        if engine == "fsdp2":  # FSDP2's rules over the trace (issue 27): hfscale/plan/fsdp.py
            from .fsdp import fsdp2_phases, fsdp2_units

            units = fsdp2_units(cfg, lora_rank, adapter)
            return {s: fsdp2_phases(t, units, dp, reshard_after_forward, offload != "none", s, grad_accum, adamw)
                    for s in (True, False)}
        if zero or offload != "none":
            raise ValueError("ZeRO stages and offload are DeepSpeed's: predict them with engine='deepspeed'")
        out = {s: {k: dict(v.breakdown) for k, v in t.phases(s, grad_accum).items()} for s in (True, False)}
        if dp > 1:  # DDP's gradient buckets: one more copy of the trainable gradients, alive all along
            buckets = t.trainable_params * (2 if t.precision == "bf16-pure" else 4)
            out = {s: {ph: {**kinds, "ddp_buckets": buckets} for ph, kinds in v.items()} for s, v in out.items()}
            # before DDP rebuilds its buckets (step 2's forward) the first backward leaves one more gradient-sized
            # copy alive into the optimizer step (measured on CPU / gloo: hfscale profile, benchmarks/step_peak.py)
            out[False]["optimizer"]["ddp_step1_copy"] = buckets
        return out

    steps = engine_steps(tr, config)
    if tr.depth and (engine == "fsdp2" or (engine == "deepspeed" and zero == 3)):
        steps = _depth_scaled_backward(steps, config, micro_batch, kw, engine_steps)
    if nf4_delta:  # QLoRA: the frozen decoder linears held as NF4 wherever the base is held whole: every phase under
        # DDP and ZeRO-1/2, ZeRO-3's gathered parameters (steady steps: all of them below the reuse distance; step 1
        # gathers none at its peaks: nothing to lay the NF4 base over)
        steps = {s: {ph: {**k, "parameters": k["parameters"] - nf4_delta} if k.get("parameters") else k
                      for ph, k in v.items()} for s, v in steps.items()}
    from .zero import HOST, split_host

    steady, step1 = ({ph: split_host(k)[0] for ph, k in steps[s].items()} for s in (True, False))
    at = max(steady, key=steady.get)
    out = tr.prediction(grad_accum)
    out.update(peak=steady[at], peak_step1=max(step1.values()), peak_phase=at, phases=steady, phases_step1=step1,
               peak_breakdown={k: v for k, v in sorted(steps[True][at].items()) if v and not k.startswith(HOST)})
    # device + host per phase: what one memory holds where the "device" is the CPU (offload measured on CPU)
    out["phases_with_host"], out["phases_step1_with_host"] = ({ph: sum(k.values()) for ph, k in steps[s].items()}
                                                              for s in (True, False))
    if offload == "none":
        out["offloaded_per_rank"] = 0
    else:
        out["offloaded_per_rank"] = split_host(steps[True]["optimizer"])[1]
    out["params"], out["trainable_params"] = tr.params, tr.trainable_params
    out["trace"].update(micro_batch=micro_batch, zero=zero, dp=dp, offload=offload, engine=engine, adamw=adamw,
                        sharding=("DeepSpeed's buffers over the traced step (hfscale/plan/zero.py)" if engine == "deepspeed"
                                  else "FSDP2's units over the traced step (hfscale/plan/fsdp.py)" if engine == "fsdp2"
                                  else "none"))
    return out


def extrapolated(x: dict, y: dict, n: int, keys=None) -> dict:
    """Per kind, bytes of a model n layer-steps deeper than the trace `y`, from the shallower `x` and `y` (each
    layer-step adds y - x): the one extrapolation of a depth-scaled trace. `keys`: those to give (default: both's)."""
    return {k: x.get(k, 0) + n * (y.get(k, 0) - x.get(k, 0)) for k in (set(x) | set(y) if keys is None else keys)}


def _depth_scaled_backward(steps: dict, config, micro_batch: int, kw: dict, engine_steps) -> dict:
    """ZeRO-3's and FSDP2's backward, walked over the gradient arrivals, for a trace scaled in depth (which keeps no
    arrivals): the engine's backward on the two shallower traces, each walked over its own arrivals, extrapolated per
    kind as `scaled_trace` extrapolates the step (what the shallow traces never ran, the optimizer states, is the
    full-depth trace's)."""
    L, L0, L1 = depth_plan(config, kw.get("checkpointing", "off"))
    n = (L - L0) // (L1 - L0)
    a, b = (engine_steps(cached_trace(truncated(config, x), micro_batch=micro_batch, **kw, optimizer=False),
                         truncated(config, x)) for x in (L0, L1))
    out = {}
    for s, phases in steps.items():
        x, y = a[s]["backward"], b[s]["backward"]
        kinds = extrapolated(x, y, n)
        kinds.update({k: v for k, v in phases["backward"].items() if k.endswith("optimizer")})
        out[s] = {**phases, "backward": {k: v for k, v in kinds.items() if v}}
    return out


def _nf4_delta(config, precision: str) -> int:
    """Bytes a QLoRA base saves over the LoRA trace's: every decoder linear weight, traced in the precision's dtype,
    held instead as bitsandbytes' NF4 (memory.nf4_base_bytes). Exact where the QLoRA model's other weights are in the
    traced dtype (fp32, or bf16 under DeepSpeed's layout), as the profile's QLoRA runs load them. The NF4 bytes include
    the quant state (absmax, nested absmax, offsets), which torch's MemTracker does not see (attributes of the NF4
    weights): the profile hands it over (scale.adapters.quant_state_tensors); before, the QLoRA plans were +0.47-0.56%
    over the measured peaks of the 101.6M Gemma 3, 1,198,412 B of its 1,198,416 B of quant state on DDP
    (benchmarks/results/adapters.md). The dequantized weight bitsandbytes makes per matmul lives one layer at a time,
    below the step peak there."""
    from ..models.dims import dims_from_config
    from .memory import decoder_linears, nf4_base_bytes

    d = dims_from_config(config)  # HfscaleError for families without formulas: the analytic path says so
    elem = 2 if precision in ("bf16", "bf16-pure") else 4
    return sum(i * o for _, i, o in decoder_linears(d)) * elem - nf4_base_bytes(d)["nf4"]


def _qlora_refusal(engine: str) -> str | None:
    """The recipe's refusal of QLoRA on this engine (hfscale.scale.adapters.QLORA_REFUSED, its one home) as the plan
    says it, or None. engine: as step_prediction names it, or a Strategy's (fsdp2 / auto / deepspeed)."""
    from ..scale.adapters import engine_refusal

    refused = engine_refusal("qlora", None, engine in ("fsdp", "fsdp2"))
    return None if refused is None else (f"not predicted: hfscale's recipe refuses this run ({refused[0]}); "
                                         f"{refused[1]}; the analytic terms are shown for reference only")


def untraceable(s) -> str | None:
    """Why a planner Strategy's step cannot be traced (then only the analytic terms are reported)."""
    if s.optimizer != "adamw":
        return f"the trace runs AdamW; --optimizer {s.optimizer} is predicted from the analytic terms only"
    if s.base_bits == 4:  # traced as the LoRA step with its NF4 base (step_prediction) but where the recipe refuses it
        return _qlora_refusal(getattr(s, "engine", "auto"))
    return None


def for_strategy(config, s, grad_accum: int = 1, kernels: str = "cpu") -> dict:
    """`step_prediction` for a planner `Strategy`."""
    return step_prediction(config, s.micro_batch, s.seq_len, s.precision, s.attention, s.checkpointing,
                           s.lora_rank, grad_accum, s.zero, s.dp, s.offload, engine=getattr(s, "engine", "auto"),
                           adamw=s.adamw, kernels=kernels, packing=getattr(s, "packing", False),
                           adapter=s.adapter if s.lora_rank else "lora")
__all__ = ["cache_dir", "cached_trace", "for_strategy", "step_prediction", "trace_precision", "untraceable"]
