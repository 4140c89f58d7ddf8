"""ALST's long-context levers in the plan: what tiled logits + loss, tiled MLP, tiled RMSNorm and activation offload
do to one rank's memory and step time, as pure functions over the analytic per-rank model states
(`parallel.analytic`, which covers Ulysses SP through `parallel.predict_parallel`). The levers themselves run in hfscale.scale.long_context;
the fake-tensor trace (`trace.trace_step(levers=...)`, `trace.phase_trace`) runs the tiled ones for real and is
what these formulas are checked against (benchmarks/long_context.py; tests/test_long_context.py).

Interface (for the planner's candidates): `lever_prediction(d, s, levers) -> LeverPrediction`, and
`longest_sequence(d, hw, strategy_at, levers_at)` for the longest S that fits. Per rank, T = micro x S / sp
tokens, e = 2 (bf16) / 4 (fp32) bytes, V vocabulary, I MLP width, h hidden, n slices, t = ceil(T / n).

The device peak is per phase (`phase_bytes`): the model states left on the GPU plus the largest of forward, the
loss's backward and a layer's recomputed backward, which are never alive at once (the loss's slices are gone before
the first layer's backward; Ulysses' all-to-all buffers exist only inside attention). Measured against the trace at
Llama-3.1-8B's full per-rank size: a layer's backward +0.5% / +6% (without / with the offload; +4% / +17% with the
tiled norm), the loss's +0.9% / +12% (bounds), forward a loose bound (never the largest with full checkpointing); the
tiny Gemma 3 / Gemma 4 with the levers bounded too (docs/long_context.md).

  tiled logits + loss (n = loss tiles): the saved fp32 log-softmax 4TV (and Gemma's eTV soft-cap output) is
    gone; one slice's working set takes its place in the loss phase, lm_head output + fp32 copy + log-softmax +
    its gradient (e + 12)·t·V, beside the hidden states' gradient the tiled op fills, e·T·h. Its hidden states and
    labels (e·T·h + 8T) stay on its autograd node until the step's graph is freed.
    Default n: slices of <= 1 GiB of fp32 logits, ceil(4TV / 2^30) (ALST sizes its slices in GB the same way).
  tiled MLP (n = MLP tiles): a non-checkpointed layer no longer saves its MLP's [T x I] intermediates
    (the I-terms of `memory.layer_activation_bytes`: 8TI bf16, 16TI fp32; Gemma 4 per layer by its width);
    TiledMLP saves the MLP input, already counted. The recompute of a checkpointed layer (`recompute_working`)
    drops the same terms; one slice's intermediates and their gradients, 2 x (I-terms at t tokens), come back.
    Default n: ceil(T / h) (ALST: slices of `hidden` tokens, so a slice's [t x I] equals one weight matrix).
  tiled RMSNorm (n = norm tiles): a norm saves only its input instead of its fp32 internals (`norm_saving`: the
    fp32 input copy of a bf16 model, the fp32 normalised rows, the per-row statistics, Gemma's fp32 weight copy,
    less the input it now saves), for every norm of a non-checkpointed layer, the recomputed layer and the final
    norm; the norm's backward holds its fp32 temporaries for one slice, (NORM_TEMPS + 2)·4·t·width, beside the
    incoming gradient and the input's gradient, 2e·T·width. Counted: the four [T x h] norms of a Gemma layer (two
    of a Llama) and Gemma's q_norm / k_norm; not counted (their saving left out, so the plan stays a bound):
    Gemma 4's v_norm, MoE and per-layer-input norms. Default n: ceil(T / h), as the MLP's.
  activation offload: everything saved for backward outside the recomputed layer moves to host memory:
    host = activations (per rank; x GPUs per node for the host), less the tiled loss's hidden states and labels
    (held on the op's ctx where no saved-tensor hook sees them); the GPU keeps those and one reloaded layer input
    e·T·h. (Measured on CPU: the adapter's host bytes equal this within 12 bytes, tiny Gemma 3 and small Gemma 4,
    with and without the tiled loss.)

Time model (relative to the same step without the lever; stated, not measured on GPUs):
  FLOPs per token of a forward: 2 x parameters + 4·S·q·d per layer (causal attention, half of 2 x 2·S·q·d);
  a step = forward + backward (2 x forward) + the recomputed forward of the checkpointed layers.
  tiled loss recomputes the lm_head forward (2·h·V per token); tiled MLP recomputes every MLP forward
  (6·h·I per token per layer); tiled norm recomputes every norm forward (~4 FLOPs per element: memory-bound,
  counted as FLOPs, small); offload copies host bytes to the host and back at `pcie_gbps` (default 25 GB/s,
  PCIe 4 x16 as measured by users, not overlapped: torch's save_on_cpu copies synchronously) against compute at
  `tflops` (default 400: 40% of an H100's 989 dense bf16 TFLOPs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..models.dims import Dims
from .memory import Strategy, activation_bytes
from .parallel import analytic


@dataclass(frozen=True)
class LeverPrediction:
    """One rank's memory with the levers (bytes) and what they cost in step time."""

    total: int  # device bytes, the analytic total of memory.predict with the levers applied
    host_bytes_per_rank: int  # activations held in host memory (offload)
    changes: dict  # part -> device bytes of the peak phase beyond the model states (`phase_bytes`)
    tiles: dict  # lever -> slices used
    added_flops: float  # FLOPs the levers add per micro step
    step_flops: float  # FLOPs of the micro step without them
    offload_seconds: float  # host copies per micro step at pcie_gbps
    time_factor: float  # step time with the levers / without
    base: dict  # memory.predict without the levers
    phases: dict = None  # phase -> device bytes beyond the model states (`phase_bytes`)
    peak_phase: str = ""  # the largest of them, whose parts `changes` holds


def mlp_tiles(tokens: int, hidden: int) -> int:
    """ALST's default: slices of `hidden` tokens."""
    return max(1, math.ceil(tokens / hidden))


def loss_tiles(tokens: int, vocab: int, slice_bytes: int = 2**30) -> int:
    """Slices holding at most `slice_bytes` of fp32 logits each."""
    return max(1, math.ceil(4 * tokens * vocab / slice_bytes))


def _mlp_bytes(d: Dims, tokens: int, e: int) -> list[int]:
    """The MLP intermediates one layer saves at `tokens` tokens (the I-terms of the activation formulas)."""
    widths = [ld.intermediate for ld in d.per_layer] if d.per_layer else [d.intermediate] * d.layers
    coeff = 8 if e == 2 else 16
    if d.family == "gemma4":  # GeGLU: gate output, gelu output, up output, product: 4 x e·T·I
        coeff = 4 * e
    return [coeff * tokens * w for w in widths]


def forward_flops(d: Dims, tokens: int, seq: int) -> float:
    attn = sum(4 * seq * d.heads * ld.head_dim for ld in d.layers_dims()) / 2  # causal: half the S x S products
    return tokens * (2 * d.params + attn)


def norm_saving(d: Dims, tokens: int, e: int) -> tuple[list[int], int]:
    """Bytes a tiled RMSNorm no longer saves, per decoder layer and for the final norm, at `tokens` tokens: per norm
    over r rows of width w, Llama's 4rw + 4r (the fp32 input copy or, in fp32, the normalised rows; one statistic),
    Gemma's 6rw in bf16 (fp32 input copy and normalised rows, less the bf16 input it saves) or 4rw in fp32 (the
    normalised rows), the statistics (Gemma 3 one per row, 4r; Gemma 4 two, 8r) and the fp32 weight 4w (Gemma 3's
    1 + weight; Gemma 4's copy in bf16 only), counted from the tensors the norm saves (offload host bytes, exact). Counted norms: the layer's [T x h] ones (Gemma 4, Llama 2) and
    Gemma's q_norm / k_norm (k_norm absent on Gemma 4's KV-shared layers); others are left out (a lower bound)."""
    def one(rows, width):
        if d.family == "llama":
            return 4 * rows * width + 4 * rows
        # Gemma 3 saves rsqrt's output and (1 + weight) in fp32; Gemma 4 pow's input and output, and weight.float()
        # (a copy in bf16 only)
        stats, weight = (4, 4 * width) if d.family == "gemma" else (8, 4 * width if e == 2 else 0)
        return (6 if e == 2 else 4) * rows * width + stats * rows + weight

    T, h = tokens, d.hidden
    per = []
    for ld in d.layers_dims():
        n = (2 if d.family == "llama" else 4) * one(T, h)
        if d.family != "llama":
            n += one(T * d.heads, ld.head_dim)
            if not ld.kv_shared:
                n += one(T * ld.kv_heads, ld.head_dim)
        per.append(n)
    return per, one(T, h)


def _norm_elements(d: Dims) -> int:
    """Elements per token the decoder's counted RMSNorms normalise (the tiled norm's recompute)."""
    per = sum((2 if d.family == "llama" else 4) * d.hidden
              + (0 if d.family == "llama" else d.heads * ld.head_dim + ld.kv_heads * ld.head_dim)
              for ld in d.layers_dims())
    return per + d.hidden


NORM_TEMPS = 4  # fp32 [T x h] temporaries autograd holds at once in an upcasting RMSNorm's backward (see phase_bytes)


def phase_bytes(d: Dims, s: Strategy, levers) -> dict:
    """One rank's device bytes beyond the model states in each phase of a step with full checkpointing (or none),
    as MemTracker and the fake-tensor trace see them: {phase: {part: bytes}}. T tokens per rank, e bytes, h hidden:

      forward         the checkpointed layers' inputs (on the host with the offload), the tensors outside the
                      layers (`activation_bytes`' head: embedding output, final norm, ids, labels), one layer's
                      saved set while it runs, and the logits' saved log-softmax (untiled) or one loss slice.
      loss            backward of the loss, before any layer's: the same inputs and head, the logits' saved
                      log-softmax and (untiled) the lm_head output, its fp32 copy and the fp32 gradients,
                      (e + 8)·T·V, or (tiled) one slice's recomputed lm_head output + fp32 copy + log-softmax +
                      gradient (e + 12)·t·V, the hidden states' gradient e·T·h the tiled op fills, and the slice's
                      [V x h] lm_head gradient, which it adds to the parameter's.
      layer_backward  the top layer's backward (all inputs below it still saved; with the offload one reloaded
                      input e·T·h), the tiled loss's hidden states and labels (held on its autograd node until the
                      step's graph is freed: e·T·h + 8T), the layer's recomputed saved set (`recompute_working`;
                      tiled MLP: without its [T x I] intermediates, with one slice's and their gradients, and one
                      MLP's weight gradients, which TiledMLP adds slice by slice), and the largest of the transients:
                      the widest RMSNorm's backward (tiled norm: one slice of it, see the module docstring; every family here
                      upcasts to fp32: autograd's pow / mean /
                      rsqrt / mul chain holds NORM_TEMPS fp32 copies of its input at once, beside the incoming
                      gradient; counted from the trace: pow, div, mul, mul.Scalar outputs; the input is [T x h], or
                      Gemma's q_norm over all query heads [T x q x d]), an untiled MLP's backward (e·T·h + 4e·T·I +
                      its weights' gradients) where larger, and attention's backward (the incoming and residual
                      gradients 2e·T·h, the query / key / value gradients, Ulysses' all-to-all buffers,
                      `parallel.parallel_buffers`).
    A bound: the recomputed saved set is counted whole although the backward has freed part of it at either
    transient's peak; benchmarks/long_context.py states the error against the trace at full size."""
    from ..scale.checkpointing import checkpointed_layers
    from .parallel import parallel_buffers

    e = 2 if s.precision == "bf16" else 4
    S_local = s.seq_len // (s.sp * s.cp)
    T = s.micro_batch * S_local
    U = e * T * d.hidden
    act = activation_bytes(d, s.micro_batch, S_local, s.precision, s.checkpointing, s.attention)
    ckpt = set(checkpointed_layers(s.checkpointing, d.layers))
    inputs = 0 if levers.offload_activations else act["layers"]
    saved = act["recompute_working"] if ckpt else 0
    head = act["head"]
    norm_tiles = getattr(levers, "tiled_norm", 0)
    if norm_tiles:  # the norms save their inputs only (Gemma 4's layers differ: the smallest saving for the recompute)
        per, final = norm_saving(d, T, e)
        if ckpt:
            saved -= min(per)
        if not levers.offload_activations:
            inputs -= sum(b for i, b in enumerate(per) if i not in ckpt)
        head -= final
    if levers.tiled_mlp:
        per = _mlp_bytes(d, T, e)
        t_mlp = math.ceil(T / levers.tiled_mlp)
        if ckpt:
            saved -= max(per)
        else:
            inputs -= sum(per)
        saved += 2 * max(_mlp_bytes(d, t_mlp, e))
        # TiledMLP's backward also adds each slice's weight gradients to the parameters': one MLP's worth alive
        saved += e * 3 * d.hidden * max(ld.intermediate for ld in d.layers_dims())
    V = d.vocab
    if levers.tiled_loss:
        t = math.ceil(T / levers.tiled_loss)
        slice_bytes = (e + 12) * t * V
        kept = U + 8 * T
        # sequence_tiled_compute runs one backward per slice and adds each slice's lm_head weight gradient to the
        # parameter's: one [V x h] partial gradient alive at a time
        loss = {"loss_slice": slice_bytes, "hidden_gradient": U, "lm_head_gradient_slice": e * V * d.hidden}
        fwd_loss = {"loss_slice": slice_bytes}
    else:
        kept = 0  # the saved log-softmax (+ Gemma's soft-cap output), and the lm_head output, its fp32 copy and
        # the log-softmax's and logits' fp32 gradients while the loss runs backward
        loss = {"logits_saved": act["logits"], "logits_working": (e + 8) * T * V}
        fwd_loss = {"logits_saved": act["logits"], "logits_working": (e + 4) * T * V}
    heads = d.heads * max(ld.head_dim for ld in d.layers_dims())
    kv = max(ld.kv_heads * ld.head_dim for ld in d.layers_dims())
    sp = sum(parallel_buffers(d, s).values())
    # the widest RMSNorm: the hidden one, or Gemma's per-head q_norm over all query heads at once ([T x q x d])
    width = max(d.hidden, *(d.heads * ld.head_dim for ld in d.layers_dims())) if d.family != "llama" else d.hidden
    norm = NORM_TEMPS * 4 * T * width + e * T * width
    if norm_tiles:  # one slice's fp32 temporaries (its fp32 input and normalised rows too), the incoming gradient
        # and the input's gradient the tiled op fills
        norm = (NORM_TEMPS + 2) * 4 * math.ceil(T / norm_tiles) * width + 2 * e * T * width
    attn = 2 * U + e * T * (heads + 2 * kv) + sp
    if not levers.tiled_mlp:  # the MLP's backward: its incoming gradient, the gradients of its four [T x I] tensors
        widest = max(ld.intermediate for ld in d.layers_dims())  # (gate, activation, up, product) and its weights'
        norm = max(norm, U + 4 * e * T * widest + 3 * e * d.hidden * widest)
    # with the offload every saved tensor outside the recomputed layer is in host memory but the tiled loss's
    resident = ({"loss_kept_hidden": kept} if levers.offload_activations else {"layer_inputs": inputs, "head": head})
    # Gemma 4 counts the embedding output (layer 0's input) in the head, not in the layers: alive until layer 0's backward
    embedding = U if d.family == "gemma4" and not levers.offload_activations else 0
    out = {
        "forward": {**resident, "layer_saved": saved, **fwd_loss, "sp_all_to_all": sp},
        "loss": {**resident, **loss},
        "layer_backward": {"layer_inputs": inputs + embedding, "reloaded_layer_input": U if levers.offload_activations else 0,
                           "loss_kept_hidden": kept, "layer_saved": saved,
                           **({"norm_backward": norm} if norm >= attn else {"attention_backward": attn - sp,
                                                                             "sp_all_to_all": sp})},
    }
    return {ph: {k: v for k, v in parts.items() if v} for ph, parts in out.items()}


def lever_prediction(d: Dims, s: Strategy, levers, pcie_gbps: float = 25.0, tflops: float = 400.0) -> LeverPrediction:
    """One rank's device peak with `levers` (hfscale.scale.long_context.Levers; `alst_levers` for the defaults): the
    model states of `parallel.analytic(d, s)` (weights, gradients, optimizer on the GPU, ZeRO-3's gathered layer)
    plus the largest phase of `phase_bytes` (the phases are not alive at once); host bytes of the offload."""
    from ..scale.checkpointing import checkpointed_layers

    base = analytic(d, s)
    e = 2 if s.precision == "bf16" else 4
    S_local = s.seq_len // (s.sp * s.cp)
    T = s.micro_batch * S_local
    act = activation_bytes(d, s.micro_batch, S_local, s.precision, s.checkpointing, s.attention)
    ckpt = set(checkpointed_layers(s.checkpointing, d.layers))
    tiles, added = {}, 0.0
    if levers.tiled_loss:
        tiles["loss"] = levers.tiled_loss
        added += 2 * d.hidden * d.vocab * T
    if levers.tiled_mlp:
        tiles["mlp"] = levers.tiled_mlp
        widths = [ld.intermediate for ld in d.per_layer] if d.per_layer else [d.intermediate] * d.layers
        added += sum(6 * d.hidden * w for w in widths) * T
    if levers.tiled_norm:
        tiles["norm"] = levers.tiled_norm
        added += 4 * _norm_elements(d) * T
    host = 0
    if levers.offload_activations:  # everything saved outside the recomputed layer, but the tiled loss's hidden
        # states and labels (on its autograd node's ctx, where no saved-tensor hook sees them)
        host = act["total"]
        if levers.tiled_loss:
            host -= act["logits"] + e * T * d.hidden + 8 * T
        if levers.tiled_mlp:
            host -= sum(b for i, b in enumerate(_mlp_bytes(d, T, e)) if i not in ckpt)
        if levers.tiled_norm:
            per, final = norm_saving(d, T, e)
            host -= final + sum(b for i, b in enumerate(per) if i not in ckpt)
    phases = phase_bytes(d, s, levers)
    at = max(phases, key=lambda k: sum(phases[k].values()))
    states = base["weights"] + base["gradients"] + base["optimizer"] + base["zero3_live"]
    total = states + sum(phases[at].values())
    fwd = forward_flops(d, T, S_local)
    step = 3 * fwd + fwd * len(ckpt) / d.layers
    seconds_compute = step / (tflops * 1e12)
    offload_s = 2 * host / (pcie_gbps * 1e9)
    factor = (seconds_compute * (step + added) / step + offload_s) / seconds_compute
    return LeverPrediction(int(total), int(host), dict(phases[at]), tiles, added, step, offload_s, round(factor, 4), base,
                           {k: sum(v.values()) for k, v in phases.items()}, at)


def fits(pred: LeverPrediction, gpu_mem: int, host_mem_per_node: int, gpus_per_node: int) -> bool:
    """Device peak with the planner's overheads (x1.1 fragmentation + CUDA context) within the GPU; the host's
    activations plus the ranks' offloaded model states within the node's memory."""
    from .planner import peak_bytes

    device = peak_bytes(pred.total)
    host = (pred.host_bytes_per_rank + pred.base.get("offloaded_per_rank", 0)) * gpus_per_node
    return device <= gpu_mem and host <= host_mem_per_node


def longest_sequence(d: Dims, hw, strategy_at, levers, step: int = 65536, limit: int = 2**25) -> int:
    """The longest multiple of `step` tokens whose `strategy_at(seq_len)` with `levers` (Levers, or a function of
    the strategy such as `alst_levers`, so that the slices follow the length) fits `hw` (0 if none)."""
    best, lo, hi = 0, 1, limit // step
    while lo <= hi:
        mid = (lo + hi) // 2
        s = strategy_at(mid * step)
        lv = levers(d, s) if callable(levers) else levers
        if fits(lever_prediction(d, s, lv), hw.gpu_mem, hw.cpu_mem, hw.gpus_per_node):
            best, lo = mid * step, mid + 1
        else:
            hi = mid - 1
    return best


def alst_levers(d: Dims, s: Strategy, offload: bool = True, norm: bool = True):
    """ALST's three levers with the default slices for one rank's tokens, and the tiled RMSNorm (slices of `hidden`
    tokens, as the MLP's; ALST gets the same from Liger-Kernel's fused norm): it only lowers every phase, for one
    more norm forward per step."""
    from ..scale.long_context import Levers

    T = s.micro_batch * s.seq_len // (s.sp * s.cp)
    return Levers(loss_tiles(T, d.vocab), mlp_tiles(T, d.hidden), offload, mlp_tiles(T, d.hidden) if norm else 0)


def with_seq(s: Strategy, seq_len: int) -> Strategy:
    return replace(s, seq_len=seq_len)


__all__ = ["LeverPrediction", "alst_levers", "fits", "forward_flops", "lever_prediction", "longest_sequence", "loss_tiles",
           "mlp_tiles", "norm_saving", "with_seq"]
