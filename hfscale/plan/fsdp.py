"""Per-rank bytes of a training step under FSDP2 (torch `fully_shard` as accelerate 1.16's fsdp2_prepare_model applies
it), laid over a one-rank step trace (`trace.py`), as `zero.py` does for DeepSpeed. Pure functions; the small
interface the planner plugs in:

    units = fsdp2_units(config)                          # FsdpUnits: what each FSDP2 unit gathers (bytes per element 1)
    phases = fsdp2_phases(trace, units, dp=2, reshard_after_forward=True, offload=False, steady=True)
    # -> {"forward" | "backward" | "optimizer": {kind: bytes}}; kinds starting with zero.HOST live in host memory

accelerate wraps a causal LM in units (fsdp_utils.fsdp2_prepare_model): one per decoder layer
(TRANSFORMER_BASED_WRAP), a tail unit [final norm, input embedding, lm_head (when untied)] with
reshard_after_forward=False, and the root for whatever is left. Per rank, over N ranks, P trainable elements, d
bytes per stored element (4: accelerate upcasts trainable parameters to fp32 masters whenever mixed precision is on)
and c bytes per compute element (the MixedPrecisionPolicy's param_dtype: 2 under bf16, else d):

  held all along      the parameter shards d*P/N (DTensor, Shard(0)); AdamW's moments 8P/N from the end of step 1
  forward, backward   the trace's activations, temporaries and buffers (what the model's own code keeps alive), and
                      gathered: the tail unit c*T from forward start to backward end; with reshard_after_forward
                      (default) one decoder layer at a time in forward, none at the start of backward (the loss and
                      its gradient are the peak), one layer again while backward recomputes a checkpointed layer,
                      with that layer's unsharded gradients c*L before its reduce-scatter; without reshard every
                      layer stays gathered from its forward to its backward (c*P at the start of backward)
                      gradients: the sharded fp32 gradients 4P/N fill in as units reduce-scatter
  optimizer           shards d*P/N, gradients 4P/N, moments 8P/N and, for torch's forloop AdamW, two temporaries of
                      the largest parameter shard (4 bytes each)
  offload (CPU)       the shards, gradients and moments live on the host (CPUOffloadPolicy): host kinds

Backward is walked over the trace's gradient arrivals (`_backward_segment`): the unit whose gradient arrived last is
the one running; its gradients are unsharded (c bytes) until its reduce-scatter, finished layers hold fp32 shards.

Measured inside both ranks with `hfscale profile` (MemTracker) on the tiny Gemma 3, 2 CPU ranks over gloo, micro 2 x
128 (benchmarks/results/step_peak.md, FSDP2 rows): the steady and step-1 peaks within 0.001% with reshard on and
off, CPU offload (device + host), bf16 and every:2 checkpointing, and with 2 micro batches of accumulation (bf16, micro
4 x 128, benchmarks/results/fsdp2_engines.md: the first micro batch's fp32 gradient shards stay alive). With full
checkpointing the peak moves into the middle of backward (a recomputed layer gathered beside the prefetch and
reduce-scatter buffers): +1.5% steady, +2.1% step 1. The
forward phase (not the peak in any row) is under-predicted by 2-5%: FSDP2 holds about one logits-sized tensor more at
the end of forward than the one-rank trace, not yet explained. Not modelled: allocator caching and stream overlap on
GPUs (the prefetch and reduce-scatter buffers were read from CPU / gloo runs, where collectives are synchronous).
"""

from __future__ import annotations

from dataclasses import dataclass

from .trace import StepTrace
from .zero import HOST


TAIL, ROOT = -1, -2  # FsdpUnits.param_units: the tail unit, the root unit


@dataclass(frozen=True)
class FsdpUnits:
    """Elements each FSDP2 unit all-gathers, as accelerate wraps the model."""

    layers: tuple[int, ...]  # per decoder layer (one unit each)
    tail: int  # final norm + input embedding + untied lm_head: gathered from forward start to backward end
    root: int  # parameters left to the root unit
    largest_param: int  # elements of the largest parameter (the forloop AdamW's temporaries work on its shard)
    param_units: tuple[int, ...] = ()  # per parameter (model.parameters() order): its layer, TAIL or ROOT

    @property
    def total(self) -> int:
        return sum(self.layers) + self.tail + self.root


_UNITS: dict[str, FsdpUnits] = {}  # per process: a plan asks for the same model's units once per FSDP2 candidate


def fsdp2_units(config) -> FsdpUnits:
    """The units of `config`'s causal LM, counted on the meta device (no weights are built); memoised per config."""
    key = config.to_json_string(use_diff=False)
    if key not in _UNITS:
        _UNITS[key] = _units(config)
    return _UNITS[key]


def _units(config) -> FsdpUnits:
    import copy

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import GradientCheckpointingLayer

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
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
    tail_modules = [model.get_input_embeddings(), model.get_output_embeddings()]
    norm = getattr(getattr(model, "model", model), "norm", None)
    unit_of.update({id(p): TAIL for m in [norm, *tail_modules] if m is not None for p in m.parameters()})
    tail = sum(numel(m) for m in [norm, *tail_modules] if m is not None)
    root = numel(model)
    largest = max(p.numel() for p in model.parameters())
    return FsdpUnits(layers, tail, root, largest, tuple(unit_of.get(id(p), ROOT) for p in model.parameters()))


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _walk(segments: list):
    """(parameter indices whose gradients arrived so far, the segment) for each segment of a traced backward."""
    arrived: list[tuple[int, int]] = []
    for seg in segments:
        if seg[0] >= 0:
            arrived.append((seg[0], seg[1]))
        yield list(arrived), seg


def _backward_segment(seg: list, arrived: list[tuple[int, int]], units: FsdpUnits, N: int, c: int, reshard: bool,
                      where: str) -> dict[str, int]:
    """FSDP2's bytes over one segment of the traced backward (between two gradient arrivals): the model's own
    activations / temporaries / buffers from the trace; the unit running now is the one whose parameter arrived
    last (before the first arrival: the tail, where the loss's backward starts). Its gradients are unsharded until
    its reduce-scatter, the finished layers' gradients are fp32 shards (1/N), the tail's stay unsharded to the end
    (the tied embedding's gradient completes last). Gathered: the tail, plus the running layer (reshard: gathered
    again for its backward) or every layer whose backward has not finished (no reshard)."""
    kinds = {n: seg[3].get(n, 0) for n in ("activations", "temporaries", "buffers")}
    pu = units.param_units
    current = pu[arrived[-1][0]] if arrived else TAIL
    finished_layers = {pu[i] for i, _ in arrived if pu[i] >= 0 and pu[i] != current}
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
    if reshard and current >= 0:
        # during a layer's backward FSDP2 holds two more layer-sized buffers: the next (lower) layer's prefetched
        # all-gather output and the reduce-scatter input of the layer finished before (freed at the next
        # reduce-scatter); read from the measured timeline (temporaries +2 layers mid-backward with full checkpointing)
        kinds["prefetch_all_gather"] = c * units.layers[current - 1] if current >= 1 else 0
        kinds["reduce_scatter_input"] = c * units.layers[current + 1] if current + 1 in finished_layers else 0
    return kinds


def fsdp2_phases(tr: StepTrace, units: FsdpUnits, dp: int, reshard_after_forward: bool = True, offload: bool = False,
                 steady: bool = True, grad_accum: int = 1, adamw: str = "forloop") -> dict[str, dict[str, int]]:
    """{phase: {kind: bytes}} on one of `dp` ranks under FSDP2 (see the module docstring)."""
    N = max(1, dp)
    P = tr.trainable_params
    c = 2 if tr.precision in ("bf16", "bf16-autocast") else 4  # the MixedPrecisionPolicy's param_dtype
    d = 4  # fp32 masters: accelerate upcasts trainable parameters when mixed precision is on
    where = HOST if offload else ""
    shards = {where + "param_shards": d * _ceil(P, N)}
    moments = {where + "optimizer": _ceil(tr.state_bytes, N) if steady else 0}
    layer = max(units.layers, default=0)
    checkpointing = tr.checkpointing != "off"
    out: dict[str, dict[str, int]] = {}
    for phase in ("forward", "backward"):
        k = dict(tr.phases(steady, grad_accum)[phase].breakdown)
        kinds = {n: k.get(n, 0) for n in ("activations", "temporaries", "buffers")}
        if phase == "forward":
            # the trace's forward peak is the loss at its end: every layer has run; with reshard only the tail remains
            gathered = c * units.tail + (0 if reshard_after_forward else c * sum(units.layers))
        else:
            gathered = c * units.tail + (0 if reshard_after_forward else c * sum(units.layers))
            if checkpointing and reshard_after_forward:
                gathered += c * layer  # a checkpointed layer recomputed in backward is gathered again
                kinds["unsharded_gradients"] = c * layer  # its gradients before the reduce-scatter
        kinds["gathered_parameters"] = gathered
        if phase == "backward" and k.get("gradients", 0):
            # the trace's gradients at its backward peak, reduce-scattered into this rank's shard
            kinds[where + "gradient_shards"] = _ceil(k["gradients"], N)
        if phase == "backward" and tr.grad_arrivals and units.param_units:
            # with accumulation the earlier micro batches' reduce-scattered gradients stay as fp32 shards (4P/N)
            kinds = max(({**_backward_segment(seg, done, units, N, c, reshard_after_forward, where),
                          **({where + "accumulated_gradient_shards": 4 * _ceil(P, N)} if m else {})}
                         for m, segments in enumerate(tr.grad_arrivals[: 1 if grad_accum == 1 else 2])
                         for done, seg in _walk(segments)), key=lambda x: sum(x.values()))
        out[phase] = {**kinds, **shards, **moments}
    opt = {"buffers": tr.phases(steady, grad_accum)["optimizer"].breakdown.get("buffers", 0),
           **shards, where + "gradient_shards": 4 * _ceil(P, N), where + "optimizer": _ceil(tr.state_bytes, N),
           "optimizer_temporaries": 2 * 4 * _ceil(units.largest_param, N) if adamw == "forloop" else 0}
    out["optimizer"] = opt
    return {ph: {k: v for k, v in kinds.items() if v} for ph, kinds in out.items()}


__all__ = ["FsdpUnits", "fsdp2_phases", "fsdp2_units"]
