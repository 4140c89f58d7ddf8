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

The old full-block path (a [B, S] tensor whose labels are its inputs) keeps transformers' per-batch mean,
bit for bit (`lm_loss(model, tensor)`).
"""

from __future__ import annotations

from .documents import IGNORE_INDEX, attn_implementation, forward_kwargs


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


def lm_loss(model, batch, denominator=None):
    """Next-token loss of one micro batch.

    - `batch` a Long[B, S] tensor (the old full blocks, labels = inputs): the batch mean, as before.
    - `batch` a packed dict (hfscale.models.documents): documents kept apart (use_cache=False, flash varlen
      arguments), summed over the trained tokens and divided by `denominator` (the step's trained-token count,
      an int or a 0-dim tensor); without one, divided by this micro batch's own count (its mean)."""
    import torch

    if isinstance(batch, torch.Tensor):
        return model(input_ids=batch, labels=batch).loss
    kwargs = forward_kwargs(batch, attn_implementation(model))
    if denominator is not None:
        kwargs["num_items_in_batch"] = denominator
    return model(**kwargs).loss


def token_nll(logits, labels):
    """(summed next-token NLL over the trained positions in fp32, their count): logits [B, S, V] at every position,
    labels [B, S] in the contract's form (-100 where not trained)."""
    import torch.nn.functional as F

    target = labels[:, 1:]
    flat = logits[:, :-1].float().reshape(-1, logits.shape[-1])
    nll = F.cross_entropy(flat, target.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    return nll, (target != IGNORE_INDEX).sum()


__all__ = ["backward_scale", "global_trained_tokens", "lm_loss", "token_nll", "trained_tokens"]
