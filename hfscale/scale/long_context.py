"""ALST's long-context levers (Arctic Long Sequence Training, arXiv 2506.13996) as thin adapters over the kept
implementations: DeepSpeed 0.19.8's deepspeed/runtime/sequence_parallel/ulysses_sp.py and torch's
torch.autograd.graph.save_on_cpu. One switch each (`Levers`, the recipe YAML's tiled_loss / tiled_mlp /
offload_activations / tiled_norm); Ulysses SP itself is hfscale.scale.ulysses.

  tiled logits + loss (`tile_loss_`): the CausalLM's forward, given labels, computes the loss with DeepSpeed's
    `sequence_tiled_compute` over `tiles` slices of the sequence: lm_head (+ Gemma's final soft-capping) and an
    fp32 cross-entropy sum per slice, under no_grad in forward and recomputed slice by slice in backward, so
    the [tokens x vocab] logits never exist whole (the returned output has logits=None).
    Not `TiledFusedLogitsLoss`: it runs the lm_head's backward inside forward with an incoming gradient of 1
    and only rescales the hidden states' gradient afterwards, so any loss scaling between it and backward
    (gradient accumulation's 1/accum, which accelerate and DeepSpeed both apply) leaves the lm_head / tied
    embedding gradient unscaled (measured: lm_head gradient 0.065 off against a largest 0.022 at a 1/4 scale;
    exact at 1), and
    its `grads[0] != 1.0` test cannot run on fake tensors (the planner's trace). `sequence_tiled_compute` costs
    one more lm_head forward per step (recomputed in backward) and is exact under any scaling. A tied lm_head
    (Gemma's embedding) needs one more step under ZeRO (`tiled_loss_sum`'s `tied`).
  tiled MLP (`tile_mlp_`): every decoder layer's dense MLP runs through DeepSpeed's `TiledMLP`: forward slice by
    slice under no_grad, saving only its input; backward recomputes each slice. The MLP's [tokens x width]
    intermediates exist for one slice at a time (in the layer's recompute under checkpointing too).
  tiled RMSNorm (`tile_norm_`): every RMSNorm of the decoder (each layer's input / post-attention norms, Gemma's
    pre / post feed-forward and per-head q / k / v norms, the final norm) runs through the same `TiledMLP` over its
    rows (tokens, or tokens x heads for the per-head norms): HF's RMSNorms compute in fp32, so each saves an fp32
    copy of its input (bf16 models) and the fp32 normalised rows, and its backward holds four fp32 copies of its
    input at once (pow, div, mul, mul.Scalar in the trace). Tiled, a norm saves only its input and its fp32
    internals exist for one slice at a time, in forward, in the recompute and in backward (one more norm forward
    per step, memory-bound and small). The same per-token recompute ALST gets from Liger-Kernel's fused RMSNorm,
    with DeepSpeed's kept op instead of a new kernel.
  activation offload (`Offload`, `with_levers`): torch's `save_on_cpu` around the forward: every tensor saved for
    backward except the parameters (with checkpointing: the checkpointed layers' inputs, the tensors outside the
    layers) is copied to host memory (pinned on CUDA) and brought back when backward needs it. On a CPU-only host the
    copy is the tensor itself (nothing moves); `Offload.host_bytes` counts what a GPU host would hold.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from ..util.errors import ConfigError


@dataclass(frozen=True)
class Levers:
    """tiled_loss / tiled_mlp / tiled_norm: slices per sequence (0 = off; each rank's tokens under SP);
    offload_activations: saved activations in host memory (needs checkpointing, whose layer inputs are what it
    moves)."""

    tiled_loss: int = 0
    tiled_mlp: int = 0
    offload_activations: bool = False
    tiled_norm: int = 0

    def __post_init__(self):
        for name in ("tiled_loss", "tiled_mlp", "tiled_norm"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ConfigError(f"{name} must be an integer >= 0 (slices of each sequence; 0 = off), "
                                  f"got {getattr(self, name)!r}")

    @property
    def any(self) -> bool:
        return bool(self.tiled_loss or self.tiled_mlp or self.offload_activations or self.tiled_norm)

    def check(self, seq_len: int, checkpointing: str) -> None:
        """Refuse settings that cannot do what they say, in one line naming the fix."""
        for name in ("tiled_loss", "tiled_mlp", "tiled_norm"):
            if getattr(self, name) > seq_len:
                raise ConfigError(f"{name} {getattr(self, name)} is more slices than the {seq_len} tokens of a sequence; "
                                  f"use at most {seq_len}")
        if self.offload_activations and checkpointing == "off":
            raise ConfigError("offload_activations moves checkpointed activations to host memory, and checkpointing is "
                              "off; set checkpointing: full (or every:K)")


def apply_levers_(model, levers: Levers) -> list[str]:
    """Turn the tiled levers on in `model` (before accelerator.prepare); the forward's offload is `offload()`.
    Returns what was applied, for the run's log."""
    done = []
    if levers.tiled_mlp:
        done.append(f"tiled MLP x{levers.tiled_mlp} on {tile_mlp_(model, levers.tiled_mlp)} layers")
    if levers.tiled_norm:
        done.append(f"tiled RMSNorm x{levers.tiled_norm} on {tile_norm_(model, levers.tiled_norm)} norms")
    if levers.tiled_loss:
        tile_loss_(model, levers.tiled_loss)
        done.append(f"tiled logits+loss x{levers.tiled_loss}")
    if levers.offload_activations:
        done.append("checkpointed activations in host memory")
    return done


def _quiet(x):
    """A slice taken under no_grad of a tensor that requires grad is a view that requires grad with no grad_fn,
    which module hooks that watch gradients (torch's MemTracker, the planner's trace) refuse; in the no_grad
    forward pass of a tiled op nothing flows back through it, so it goes in detached."""
    import torch

    return x if torch.is_grad_enabled() else x.detach()


# --- tiled MLP ---------------------------------------------------------------------------------------------

def _decoder_mlps(model) -> list:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m.mlp for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and hasattr(m, "mlp")]


def tile_mlp_(model, tiles: int) -> int:
    """Every decoder layer's `mlp` computes through DeepSpeed's TiledMLP in `tiles` sequence slices (an instance
    attribute over the class's forward; MoE experts are left as they are). Returns the number of MLPs tiled."""
    mlps = _decoder_mlps(model)
    if not mlps:
        raise ConfigError(f"tiled_mlp: {type(model).__name__} has no decoder layers with an `mlp`; set tiled_mlp: 0")
    for mlp in mlps:
        _tile_forward_(mlp, tiles)
    return len(mlps)


def _own_forward(module, x):
    """The module's class's forward, whatever class it is (the instance's is the tiled one)."""
    return type(module).forward(module, _quiet(x))


def _tile_forward_(module, tiles: int, rows: bool = False) -> None:
    """`module` computes through DeepSpeed's TiledMLP in `tiles` sequence slices (an instance attribute over the
    class's forward). `rows`: the input is flattened to [rows, width] first and the output viewed back (a function
    of each row alone, such as an RMSNorm over any leading dimensions)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    params = [p for p in module.parameters()]

    def forward(x):
        if not rows:
            return TiledMLP.apply(_own_forward, module, x, tiles, params)
        flat = x.reshape(-1, x.shape[-1])
        return TiledMLP.apply(_own_forward, module, flat, min(tiles, flat.shape[0]), params).view(x.shape)

    module.forward = forward


# --- tiled RMSNorm ------------------------------------------------------------------------------------------

def _decoder_norms(model) -> list:
    """Every RMSNorm module of the decoder (its layers' and the final one; not a vision tower's)."""
    return [m for m in model.get_decoder().modules() if type(m).__name__.endswith("RMSNorm")]


def tile_norm_(model, tiles: int) -> int:
    """Every RMSNorm of the decoder computes through DeepSpeed's TiledMLP over its rows (the input flattened to
    [rows, width]: an RMSNorm normalises each row alone, so any split of the rows is exact) in `tiles` slices: the
    norm saves only its input and recomputes each slice in backward. Returns the number of norms tiled."""
    norms = _decoder_norms(model)
    if not norms:
        raise ConfigError(f"tiled_norm: {type(model).__name__} has no RMSNorm in its decoder; set tiled_norm: 0")
    for norm in norms:
        _tile_forward_(norm, tiles, rows=True)
    return len(norms)


# --- tiled logits + loss -----------------------------------------------------------------------------------

def tiled_loss_sum(lm_head, hidden, shift_labels, tiles: int, softcap: float | None = None, tied=()):
    """Sum of next-token cross-entropy (fp32, ignore_index -100) over hidden [B, S, h] and shift_labels [B, S],
    through DeepSpeed's sequence_tiled_compute in `tiles` slices; differentiable in `hidden` and lm_head.

    `tied`: lm_head parameters also used elsewhere (Gemma's embedding). sequence_tiled_compute runs a backward per
    slice inside the outer one and tells ZeRO (`ds_grad_is_ready`) to reduce the weight's gradient after the last
    slice; a tied weight then gets its embedding gradient after that reduction (ZeRO-2 stops: "has already been
    reduced"; ZeRO-3 went on with a wrong gradient: the step-2 loss off by 9e-4, measured on 2 CPU ranks). Such a
    weight is kept not-ready through every slice and made ready once the hidden states' gradient exists, so ZeRO
    reduces it once, at its last use in backward (the embedding), with both contributions summed."""
    import torch
    from deepspeed.runtime.sequence_parallel.ulysses_sp import sequence_tiled_compute

    def slice_loss(hidden, labels):
        logits = lm_head(_quiet(hidden))
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                 ignore_index=-100, reduction="sum")

    tied_ids = {id(p) for p in tied}
    params = [p for p in lm_head.parameters() if id(p) not in tied_ids]
    if tied and hidden.requires_grad and torch.is_grad_enabled():
        for p in tied:
            p.ds_grad_is_ready = False

        def ready(grad):
            for p in tied:
                p.ds_grad_is_ready = True

        hidden.register_hook(ready)
    return sequence_tiled_compute(slice_loss, hidden.shape[1], tiles, {"hidden": hidden, "labels": shift_labels}, {},
                                  "hidden", params, output_unshard_dimension=0, output_reduction="sum")


def tile_loss_(model, tiles: int) -> None:
    """The CausalLM's forward, given `labels` (or SP's `shift_labels`), returns the mean loss over the labelled
    tokens from `tiled_loss_sum` (or their sum / `num_items_in_batch` when given, as transformers' loss) and
    logits=None; without labels it runs as before (evaluation, generation)."""
    import torch
    from transformers.modeling_outputs import CausalLMOutputWithPast

    base, head = model.get_decoder(), model.get_output_embeddings()
    embedding = {id(p) for p in model.get_input_embeddings().parameters()}
    tied = [p for p in head.parameters() if id(p) in embedding]
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    softcap = getattr(text, "final_logit_softcapping", None)
    original = model.forward

    def forward(input_ids=None, labels=None, shift_labels=None, **kw):
        if labels is None and shift_labels is None:
            return original(input_ids=input_ids, **kw)
        kw.pop("logits_to_keep", None)
        denominator = kw.pop("num_items_in_batch", None)  # the step's trained tokens (hfscale.models.loss.lm_loss)
        out = base(input_ids=input_ids, **kw)
        if shift_labels is None:  # next token of each position; the last has none (as transformers' loss)
            shift_labels = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
        if denominator is None:
            denominator = (shift_labels != -100).sum().clamp(min=1)
        loss = tiled_loss_sum(head, out.last_hidden_state, shift_labels, tiles, softcap, tied) / denominator
        return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=out.past_key_values)

    model.forward = forward
    model.loss_tiles = tiles  # hfscale.models.loss.lm_loss passes its labels to this forward


# --- activation offload ------------------------------------------------------------------------------------

class Offload:
    """torch.autograd.graph.save_on_cpu (pinned where CUDA is present) for every tensor saved for backward
    except the parameters (save_on_cpu alone would copy every weight a matmul saves to host memory on each
    forward: 2 bytes x parameters of PCIe traffic and host RAM for nothing), and each saved tensor copied once:
    save_on_cpu copies per save, and autograd saves one tensor several times (cross-entropy's log-softmax output
    for its own backward and for nll_loss's: measured on the tiny Gemma 3, 1.79x the distinct bytes). A repeat
    save of the same view of a live storage gets the earlier copy (a weak reference tells a live storage from a
    freed one whose address was reused). `host_bytes` counts what it holds in host memory. Parameters are
    recognised by storage at save time (ZeRO-3's gathered weights included). `host`: the (pack_hook, unpack_hook)
    pair that moves a tensor out and back, save_on_cpu's by default (the planner's trace passes one that keeps only
    the shape, `trace._FakeHost`, so that a saved tensor leaves the traced device as it leaves a GPU)."""

    def __init__(self, model, host=None):
        self.model = model
        self.host = host
        self.host_bytes = 0

    @contextlib.contextmanager
    def __call__(self):
        import torch
        from torch.multiprocessing.reductions import StorageWeakRef

        inner = self.host or torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
        keep, seen = object(), {}

        def pack(t):
            st = t.untyped_storage()
            if st._cdata in {p.untyped_storage()._cdata for p in self.model.parameters()}:
                return keep, t
            key = (st._cdata, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
            hit = seen.get(key)
            if hit is not None and not hit[0].expired():
                return hit[1]
            packed = inner.pack_hook(t)
            self.host_bytes += t.numel() * t.element_size()
            seen[key] = (StorageWeakRef(st), packed)
            return packed

        def unpack(packed):
            return packed[1] if packed[0] is keep else inner.unpack_hook(packed)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield self


def with_levers(loss_fn, levers: Levers, model):
    """A loop's `loss_fn(model, batch[, denominator])` whose forward runs under the offload when the switch is on (the tiled
    levers live in the model itself, `apply_levers_`)."""
    if not levers.offload_activations:
        return loss_fn
    offload = Offload(model)

    def offloaded(m, batch, *rest):
        with offload():
            return loss_fn(m, batch, *rest)

    offloaded.offload = offload
    return offloaded
