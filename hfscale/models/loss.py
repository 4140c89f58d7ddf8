"""The next-token loss over trained tokens: one home for every loop, evaluation and distillation in hfscale.

A step's loss is the SUM of next-token cross-entropy over the trained tokens of all its micro batches on all
ranks, divided by the step's trained-token count N (not a mean of per-micro-batch means, which would weigh a
token of a short-answer micro batch more than one of a long-answer batch):

    loss_step = sum_{ranks r, micro m} sum_{trained t in (r, m)} CE_t / N

Each micro batch's forward returns its share, sum_{t in (r, m)} CE_t / N (`lm_loss(model, batch, N)`, through
the model's own loss: transformers' `num_items_in_batch`). N comes from the data layer, which knows the
step's rows without communicating; a loop that does not know it adds up its micro batches' `trained_tokens`
and all-reduces them (`global_trained_tokens`). The engines divide each backward by the accumulation steps and
average gradients over the data-parallel ranks, so a loop calls backward on share x accum x dp ranks
(`backward_scale`) to get the gradient of loss_step.

Trained tokens: labels != -100 after the model's shift, i.e. labels[:, 1:] (the packed-batch contract in
hfscale.models.documents makes labels[:, 0] -100 anyway: the first token of a document is never trained).

The LM head and the cross-entropy run at the trained positions only (`trained_positions`): a forward pre-hook on
the model's output embeddings hands it the hidden states of the positions whose next token trains, flattened over
the micro batch ([1, N, h]), so the logits are [1, N, V] instead of [B, S, V] (Gemma's final soft-capping and any
other step the model applies to its logits still runs on them). On chat data with masked prompts that is the
head's matmul, the fp32 logits, their log-softmax and their gradients for the trained share only (measured on the
built-in chat set at seq_len 1024: 9,877 trained of 25,676 real tokens, 38%); transformers' `logits_to_keep`
takes a boolean [B, S] mask for the same cut, but indexing by a mask has a data-dependent shape the planner's fake
tensors cannot trace, so the count is read once on the host and the gather has a fixed size (`nonzero_static`).
The loss is the same sum (fp32 log-softmax, as transformers' loss upcasts) up to the order of the summation.
The model's own loss (every position) is taken instead where the cut does not apply (`own_loss`): under the
tiled-loss lever (hfscale.scale.long_context.tile_loss_, whose tiled forward computes it), for a mixture of experts
that adds its router's load-balancing loss (output_router_logits), for a model without an output embeddings module.
Under Ulysses SP the loss is hfscale.scale.ulysses.sp_lm_loss's, its head over every position of the rank's slice.

The old full-block path (a [B, S] tensor whose labels are its inputs) keeps transformers' per-batch mean,
bit for bit (`lm_loss(model, tensor)`).
"""

from __future__ import annotations

import contextlib

from .documents import IGNORE_INDEX, attn_implementation, forward_kwargs, unwrapped


def trained_tokens(labels):
    """How many tokens of `labels` [B, L] the next-token loss trains (a 0-dim int64 tensor on labels' device)."""
    return (labels[..., 1:] != IGNORE_INDEX).sum()


def global_trained_tokens(micro_labels, group=None):
    """The fallback for loops that do not know their step's trained-token count: the micro batches' labels
    of this rank counted and summed over the ranks of `group` (one all-reduce; none when torch.distributed is
    not initialised). Collective: every rank calls it with its own micro batches. Returns an int."""
    import torch
    import torch.distributed as dist

    count = sum((trained_tokens(lab).to(torch.int64) for lab in micro_labels), torch.zeros((), dtype=torch.int64))
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        count = count.to(_device_for(group))
        dist.all_reduce(count, group=group)
    return int(count)


def _device_for(group):
    import torch
    import torch.distributed as dist

    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def backward_scale(accum: int, dp_world: int) -> int:
    """What a micro batch's share (`lm_loss(model, batch, N)`) is multiplied by before the engine's backward:
    accelerate and DeepSpeed divide each backward by the accumulation steps and DDP / ZeRO average gradients over
    the data-parallel ranks, so share x accum x dp_world leaves the gradient of the step's sum / N."""
    return accum * dp_world


def trained_positions(labels, count: int | None = None):
    """(index Long[N], targets Long[N]): the positions of `labels` [B, S], flattened in row order, whose next token
    trains (labels[:, t + 1] != -100), and those next tokens. `count` = N when the caller knows it without reading
    the labels (the planner's trace on fake tensors); otherwise it is read from them (one host sync)."""
    import torch

    from torch._subclasses.fake_tensor import FakeTensor

    shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)
    keep = shifted != IGNORE_INDEX
    if count is None or not isinstance(labels, FakeTensor):  # real labels: their own count, and a given one must match
        n = int(keep.sum())
        if count is not None and count != n:
            from ..util.errors import HfscaleError

            raise HfscaleError(f"trained_positions was told {count} trained tokens where the labels train {n}")
        count = n
    index = torch.nonzero_static(keep, size=count).reshape(-1)
    return index, shifted.index_select(0, index)


@contextlib.contextmanager
def head_at(model, index):
    """While inside, the model's LM head (its output embeddings) sees only the hidden states at `index` of the
    [B, S] positions flattened, as one row [1, N, h]: a forward pre-hook, removed on the way out."""

    def gather(module, args):
        hidden = args[0]
        return (hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)[None], *args[1:])

    handle = unwrapped(model).get_output_embeddings().register_forward_pre_hook(gather)
    try:
        yield
    finally:
        handle.remove()


def own_loss(model) -> bool:
    """Whether the model's own loss (over every position, from its labels) is the one to take rather than the head at
    the trained positions: the tiled-loss lever's forward computes it per tile; a mixture of experts asked for its
    router logits adds its load-balancing loss to it (Mixtral, Qwen3-MoE: output_router_logits); a model with no
    output embeddings module has no head to cut."""
    inner = unwrapped(model)
    get_head = getattr(inner, "get_output_embeddings", None)
    return bool(getattr(inner, "loss_tiles", 0) or getattr(getattr(inner, "config", None), "output_router_logits", False)
                or get_head is None or get_head() is None)


def lm_loss(model, batch, denominator=None, trained: int | None = None):
    """Next-token loss of one micro batch.

    - `batch` a Long[B, S] tensor (the old full blocks, labels = inputs): the batch mean, as before.
    - `batch` a packed dict (hfscale.models.documents): documents kept apart (use_cache=False, flash varlen
      arguments), the head and loss at the trained positions only (`head_at`), summed over the trained tokens and
      divided by `denominator` (the step's trained-token count, an int or a 0-dim tensor); without one, divided by
      this micro batch's own count (its mean). `trained`: this micro batch's count where the labels cannot be read
      (fake tensors); None reads it."""
    import torch
    import torch.nn.functional as F

    if isinstance(batch, torch.Tensor):
        return model(input_ids=batch, labels=batch).loss
    kwargs = forward_kwargs(batch, attn_implementation(model))
    if own_loss(model):  # the model's loss over every position, from its labels
        if denominator is not None:
            kwargs["num_items_in_batch"] = denominator
        return model(**kwargs).loss
    index, targets = trained_positions(kwargs.pop("labels"), trained)
    with head_at(model, index):
        logits = model(**kwargs).logits
    if logits.shape[-2] != index.numel():  # the model made its logits without calling its output embeddings
        from ..util.errors import HfscaleError

        raise HfscaleError(f"{type(unwrapped(model)).__name__} computes its logits without its output embeddings "
                           f"module ({logits.shape[-2]} positions, {index.numel()} trained): hfscale's loss cannot cut "
                           "the head to the trained positions for it; report the model family")
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets, reduction="sum")
    if denominator is None:
        denominator = max(index.numel(), 1)
    elif isinstance(denominator, torch.Tensor):
        denominator = denominator.to(nll.device)
    return nll / denominator


def token_nll(logits, labels):
    """(summed next-token NLL over the trained positions in fp32, their count): logits [B, S, V] at every position,
    labels [B, S] in the contract's form (-100 where not trained)."""
    import torch.nn.functional as F

    target = labels[:, 1:]
    flat = logits[:, :-1].float().reshape(-1, logits.shape[-1])
    nll = F.cross_entropy(flat, target.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    return nll, (target != IGNORE_INDEX).sum()


__all__ = ["backward_scale", "global_trained_tokens", "head_at", "lm_loss", "own_loss", "token_nll",
           "trained_positions", "trained_tokens"]
