"""Per-rank bytes of a training step under FSDP2 (torch `fully_shard` as accelerate 1.16's fsdp2_prepare_model applies
it), laid over a one-rank step trace (`trace.py`), as `zero.py` does for DeepSpeed. Pure functions; the small
interface the planner plugs in:

    units = fsdp2_units(config)                          # FsdpUnits: what each FSDP2 unit gathers (bytes per element 1)
    phases = fsdp2_phases(trace, units, dp=2, reshard_after_forward=True, offload=False, steady=True)
    # -> {"forward" | "backward" | "optimizer": {kind: bytes}}; kinds starting with zero.HOST live in host memory

accelerate wraps a causal LM in units (fsdp_utils.fsdp2_prepare_model): one per decoder layer
(TRANSFORMER_BASED_WRAP), a tail unit [final norm, input embedding, lm_head (when untied)] with
reshard_after_forward=False, and the root for whatever is left (under peft accelerate's final-norm lookup finds none:
the norm stays in the root). Per rank, over N ranks, P trainable elements, F frozen ones (an adapter's base), d bytes
per stored trainable element (4: accelerate upcasts trainable parameters to fp32 masters whenever mixed precision is
on), f per frozen one (kept in its dtype) and c bytes per compute element (the MixedPrecisionPolicy's param_dtype: 2
under bf16, else d):

  held all along      the parameter shards d*P/N + f*F/N (DTensor, Shard(0)); AdamW's moments 8P/N from step 1's end
  forward             the trace's activations, temporaries and buffers at the loss (what the model's own code keeps
                      alive), the tail unit c*T gathered, with reshard_after_forward (default) no layer, without it
                      every one, and the last layer's flat all-gather output c*L (an all-gather's output lives until
                      the next all-gather, which is backward's first); or, when higher, the start of forward: the tail
                      and the first layer gathered beside their all-gather outputs, 2c*(T + L0); or (with reshard) the
                      trace's peak within the decoder layers with the tail and the running layer gathered beside its
                      all-gather output, c*T + 2c*L
  backward            walked over the trace's gradient arrivals (`_backward_segment`), per segment: the trace's
                      activations / temporaries / buffers; gathered the tail, with reshard the running layer and the
                      next lower one's all-gather (without: every layer not yet finished); the running unit's gradients
                      unsharded (c bytes), finished layers' as fp32 shards, the reduce-scatter input of the layer
                      finished last (its trainable elements, c bytes) until the next reduce-scatter
  optimizer           shards, gradients 4P/N, moments 8P/N and, for torch's forloop AdamW, two temporaries of the
                      largest trainable parameter's shard (4 bytes each)
  offload (CPU)       the shards, gradients and moments live on the host (CPUOffloadPolicy): host kinds

The unit running in backward is the one whose gradient arrives next (before the first arrival: the tail, where the
loss's backward starts): a layer all of whose gradients arrived has run its post-backward (resharded, reduce-scattered).
An adapter's units hold its frozen base too (gathered like the rest), only its trainable parameters have gradients.

Measured inside both ranks with `hfscale profile` (MemTracker) on the tiny Gemma 3, 2 CPU ranks over gloo, micro 2 x
128 (benchmarks/results/step_peak.md, FSDP2 rows): the steady and step-1 peaks within 0.001% with reshard on and
off, CPU offload (device + host), bf16 and every:2 checkpointing, and with 2 micro batches of accumulation (bf16, micro
4 x 128, benchmarks/results/fsdp2_engines.md: the first micro batch's fp32 gradient shards stay alive). With full
checkpointing the peak moves into the middle of backward (a recomputed layer gathered beside the prefetch and
reduce-scatter buffers): +1.5% steady, +2.1% step 1. On a 101.6M Gemma 3 (2 ranks, fp32, micro 1 x 64,
benchmarks/results/adapters.md), where the model states outweigh the activations: full fine-tuning's backward peak is
the tied embedding's last gradient after every layer finished (-0.00%; +3.19% while the last arrival's layer was taken
as still running), LoRA's peak the start of forward (-0.06%; its backward -0.001%), DoRA's inside the last layer,
where its weight-norm temporaries outweigh what the loss adds and the running layer is gathered beside its all-gather
output (`_within_layers`: -0.0007%; -5.2% while the forward's peak was taken at the loss; before hfscale's tracker
dropped ModTracker's input hooks, tracker.py, DoRA's ranks measured 515.1 / 558.8 MB in one run). Not modelled:
allocator caching and stream overlap on GPUs (the all-gather and reduce-scatter buffers were read from CPU / gloo runs,
where collectives are synchronous); the activations at the start of forward (the embedding's output).
"""

from __future__ import annotations

from dataclasses import dataclass

from .trace import StepTrace
from .zero import HOST


TAIL, ROOT = -1, -2  # FsdpUnits.param_units: the tail unit, the root unit


@dataclass(frozen=True)
class FsdpUnits:
    """Elements each FSDP2 unit all-gathers, as accelerate wraps the model."""

    layers: tuple[int, ...]  # per decoder layer (one unit each), every parameter (an adapter's frozen base too)
    tail: int  # final norm + input embedding + untied lm_head: gathered from forward start to backward end
    root: int  # parameters left to the root unit
    largest_param: int  # elements of the largest trainable parameter (the forloop AdamW's temporaries work on its shard)
    param_units: tuple[int, ...] = ()  # per trainable parameter (model.parameters() order): its layer, TAIL or ROOT
    trainable_layers: tuple[int, ...] = ()  # per decoder layer, its trainable elements (= layers without an adapter)

    @property
    def total(self) -> int:
        return sum(self.layers) + self.tail + self.root


_UNITS: dict[tuple, FsdpUnits] = {}  # per process: a plan asks for the same model's units once per FSDP2 candidate


def fsdp2_units(config, lora_rank: int = 0, adapter: str = "lora") -> FsdpUnits:
    """The units of `config`'s causal LM, counted on the meta device (no weights are built), with the adapter of rank
    `lora_rank` (kind `adapter`) applied as the recipe applies it (trace._build); memoised per config and adapter."""
    key = (config.to_json_string(use_diff=False), lora_rank, adapter if lora_rank else None)
    if key not in _UNITS:
        _UNITS[key] = _units(config, lora_rank, adapter)
    return _UNITS[key]


def _final_norm(model):
    """The norm accelerate 1.16's fsdp2_prepare_model puts in the tail unit: the last direct child whose class name
    holds "Norm" of the model's `base_model_prefix` module (Llama's / Gemma's `model.norm`, GPT-NeoX's
    `gpt_neox.final_layer_norm`); under peft the prefix lands on the causal LM, which has no such child: None, the
    norm stays in the root unit. Owned here: accelerate keeps its lookup private (fsdp_utils._find_final_norm)."""
    import torch

    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else model
    if not isinstance(base, torch.nn.Module):
        return None
    return next((m for _, m in reversed(list(base.named_children())) if "Norm" in type(m).__name__), None)


def _units(config, lora_rank: int = 0, adapter: str = "lora") -> FsdpUnits:
    import copy

    import torch
    from transformers.modeling_layers import GradientCheckpointingLayer

    from .trace import _build

    with torch.device("meta"):
        model = _build(copy.deepcopy(config), "fp32", "sdpa", lora_rank, adapter)
    seen: set[int] = set()

    def numel(module) -> int:
        n = 0
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
        return n

    decoder = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    unit_of = {id(p): i for i, m in enumerate(decoder) for p in m.parameters()}
    layers = tuple(numel(m) for m in decoder)
    trainable_layers = tuple(sum(p.numel() for p in m.parameters() if p.requires_grad) for m in decoder)
    tail_modules = [_final_norm(model), model.get_input_embeddings(), model.get_output_embeddings()]
    unit_of.update({id(p): TAIL for m in tail_modules if m is not None for p in m.parameters()})
    tail = sum(numel(m) for m in tail_modules if m is not None)
    root = numel(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    largest = max(p.numel() for p in trainable)
    return FsdpUnits(layers, tail, root, largest, tuple(unit_of.get(id(p), ROOT) for p in trainable), trainable_layers)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _walk(segments: list):
    """(parameter indices whose gradients arrived so far, the index of the next parameter to arrive or None, the
    segment) for each segment of a traced backward."""
    arrived: list[tuple[int, int]] = []
    for j, seg in enumerate(segments):
        if seg[0] >= 0:
            arrived.append((seg[0], seg[1]))
        yield list(arrived), segments[j + 1][0] if j + 1 < len(segments) else None, seg


def _backward_segment(seg: list, arrived: list[tuple[int, int]], upcoming: int | None, units: FsdpUnits, N: int,
                      c: int, reshard: bool, where: str) -> dict[str, int]:
    """FSDP2's bytes over one segment of the traced backward (between two gradient arrivals): the model's own
    activations / temporaries / buffers from the trace. The unit running is the one whose gradient arrives next
    (before the first arrival: the tail, where the loss's backward starts; after the last: the last one's). A layer
    all of whose gradients arrived while another unit runs is finished: FSDP2's post-backward resharded it and
    reduce-scattered its gradients into fp32 shards (1/N), and the reduce-scatter input (its unsharded gradients,
    copied flat) stays alive until the next reduce-scatter. The running unit's gradients are unsharded; the tail's
    stay unsharded to the end (the tied embedding's gradient completes last). Gathered: the tail, plus the running
    layer and the next lower layer's prefetch (reshard: gathered again for their backward) or every layer whose
    backward has not finished (no reshard)."""
    kinds = {n: seg[3].get(n, 0) for n in ("activations", "temporaries", "buffers")}
    pu = units.param_units
    current = TAIL if not arrived else pu[upcoming] if upcoming is not None else pu[arrived[-1][0]]
    finished_layers = {pu[i] for i, _ in arrived if pu[i] >= 0 and pu[i] != current}
    last_finished = next((pu[i] for i, _ in reversed(arrived) if pu[i] in finished_layers), None)
    per_unit: dict[int, int] = {}
    for i, n in arrived:
        per_unit[pu[i]] = per_unit.get(pu[i], 0) + n
    unsharded = sum(n for u, n in per_unit.items() if u == current or u < 0)
    sharded = sum(n for u, n in per_unit.items() if u >= 0 and u != current)
    gathered = c * units.tail
    if reshard:
        gathered += c * units.layers[current] if current >= 0 else 0
    else:
        gathered += c * sum(n for i, n in enumerate(units.layers) if i not in finished_layers)
    kinds.update({"gathered_parameters": gathered, "unsharded_gradients": c * unsharded,
                  where + "gradient_shards": 4 * _ceil(sharded, N)})
    # the reduce-scatter input of the layer finished last (its trainable gradients), until the next reduce-scatter
    kinds["reduce_scatter_input"] = (c * (units.trainable_layers or units.layers)[last_finished]
                                     if last_finished is not None else 0)
    if reshard and current >= 1:
        # during a layer's backward FSDP2 prefetches the next (lower) layer's all-gather output; read from the measured
        # timeline (temporaries +2 layers mid-backward with full checkpointing: this and the reduce-scatter input)
        kinds["prefetch_all_gather"] = c * units.layers[current - 1]
    return kinds


def _within_layers(tr: StepTrace, units: FsdpUnits, c: int, steady: bool, grad_accum: int, reshard: bool) -> list[dict]:
    """The forward's peak within the decoder layers (the trace's `forward_in_layers`), where with reshard the running
    layer is gathered beside its all-gather's flat output (2c x the largest layer) and the tail stays gathered: DoRA's
    peak, whose weight-norm temporaries inside the last layer outweigh what the loss adds. [] without the trace's
    in-layer peak, or without reshard (every layer gathered at the loss: that rule holds the most)."""
    inner = tr.forward_in_layers(steady, grad_accum)
    if inner is None or not reshard:
        return []
    layer = max(units.layers, default=0)
    return [{**{n: inner.breakdown.get(n, 0) for n in ("activations", "temporaries", "buffers")},
             "gathered_parameters": c * (units.tail + layer), "all_gather_output": c * layer}]


def fsdp2_phases(tr: StepTrace, units: FsdpUnits, dp: int, reshard_after_forward: bool = True, offload: bool = False,
                 steady: bool = True, grad_accum: int = 1, adamw: str = "forloop") -> dict[str, dict[str, int]]:
    """{phase: {kind: bytes}} on one of `dp` ranks under FSDP2 (see the module docstring)."""
    N = max(1, dp)
    P = tr.trainable_params
    c = 2 if tr.precision in ("bf16", "bf16-autocast") else 4  # the MixedPrecisionPolicy's param_dtype
    d = 4  # fp32 masters: accelerate upcasts trainable parameters when mixed precision is on
    f = 2 if tr.precision in ("bf16", "bf16-pure") else 4  # frozen parameters (an adapter's base) keep their dtype
    where = HOST if offload else ""
    shards = {where + "param_shards": d * _ceil(P, N), where + "frozen_param_shards": f * _ceil(tr.params - P, N)}
    moments = {where + "optimizer": _ceil(tr.state_bytes, N) if steady else 0}
    layer = max(units.layers, default=0)
    checkpointing = tr.checkpointing != "off"
    out: dict[str, dict[str, int]] = {}
    for phase in ("forward", "backward"):
        k = dict(tr.phases(steady, grad_accum)[phase].breakdown)
        kinds = {n: k.get(n, 0) for n in ("activations", "temporaries", "buffers")}
        if phase == "forward":
            # at the loss (the trace's forward peak when no layer holds more): every layer has run; with reshard
            # only the tail remains, beside the last layer's all-gather output (kept until the next all-gather,
            # backward's first)
            gathered = c * units.tail + (0 if reshard_after_forward else c * sum(units.layers))
            kinds["all_gather_output"] = c * (units.layers[-1] if units.layers else 0)
        else:
            gathered = c * units.tail + (0 if reshard_after_forward else c * sum(units.layers))
            if checkpointing and reshard_after_forward:
                gathered += c * layer  # a checkpointed layer recomputed in backward is gathered again
                # its gradients before the reduce-scatter (an adapter's trainable part only)
                kinds["unsharded_gradients"] = c * max(units.trainable_layers or units.layers, default=0)
        kinds["gathered_parameters"] = gathered
        if phase == "backward" and k.get("gradients", 0):
            # the trace's gradients at its backward peak, reduce-scattered into this rank's shard
            kinds[where + "gradient_shards"] = _ceil(k["gradients"], N)
        if phase == "backward" and tr.grad_arrivals and units.param_units:
            # with accumulation the earlier micro batches' reduce-scattered gradients stay as fp32 shards (4P/N)
            kinds = max(({**_backward_segment(seg, done, upcoming, units, N, c, reshard_after_forward, where),
                          **({where + "accumulated_gradient_shards": 4 * _ceil(P, N)} if m else {})}
                         for m, segments in enumerate(tr.grad_arrivals[: 1 if grad_accum == 1 else 2])
                         for done, upcoming, seg in _walk(segments)), key=lambda x: sum(x.values()))
        out[phase] = {**kinds, **shards, **moments}
        if phase == "forward":
            # the start of forward, where the tail and the first layer are gathered: each all-gather's flat output is
            # alive beside the parameters copied out of it until the next all-gather (the tail's until the first
            # layer's is copied out): 2 x (tail + first layer); the activations there are the embedding's output only
            # (not counted: the trace records the loss's peak)
            first = units.layers[0] if units.layers else 0
            start = {"buffers": kinds.get("buffers", 0), "gathered_parameters": c * (units.tail + first),
                     "all_gather_output": c * (units.tail + first), **shards, **moments}
            inner = [{**k, **shards, **moments}
                     for k in _within_layers(tr, units, c, steady, grad_accum, reshard_after_forward)]
            out[phase] = max(out[phase], start, *inner, key=lambda x: sum(x.values()))
    opt = {"buffers": tr.phases(steady, grad_accum)["optimizer"].breakdown.get("buffers", 0),
           **shards, where + "gradient_shards": 4 * _ceil(P, N), where + "optimizer": _ceil(tr.state_bytes, N),
           "optimizer_temporaries": 2 * 4 * _ceil(units.largest_param, N) if adamw == "forloop" else 0}
    out["optimizer"] = opt
    return {ph: {k: v for k, v in kinds.items() if v} for ph, kinds in out.items()}


__all__ = ["FsdpUnits", "fsdp2_phases", "fsdp2_units"]
