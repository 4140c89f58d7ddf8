"""Training code under DeepSpeed Ulysses sequence parallelism (accelerate `sp_backend="deepspeed"`): what a loop
needs beyond `accelerator.prepare`, each piece measured on 2 CPU ranks (gloo, DeepSpeed 0.19.8, accelerate 1.16,
transformers 5.24; tests/test_parallel_engine.py).

  - position_ids in every batch (`with_position_ids`): the Ulysses data-loader adapter refuses batches without
    them and shards them with the tokens; after its all-gather each rank's attention sees the global positions.
    Packed rows keep arange(S) positions, exactly what the same rows see without SP.
  - the loss (`sp_loss`): the adapter removes `labels` and gives each rank `shift_labels` for its tokens, so the
    model computes no loss; the token-weighted mean over the SP group is summed with a differentiable all-reduce.
  - sliding windows (`use_window_sdpa`): Ulysses sets attention_mask = None for sdpa, so Gemma's sliding-window
    layers attend to the whole sequence (measured on the tiny Gemma 3, window 64, 256 tokens: logits differ from
    position 64 on, max |diff| 1.3-1.6). This re-registers transformers' sdpa so that, given no mask and a
    sliding_window, it rebuilds the causal window mask from the (gathered, global) position_ids. It
    materialises a B x S x S boolean mask per sliding layer: for CPU proofs and moderate S; on GPUs use
    flash_attention_2, which receives sliding_window itself.
"""

from __future__ import annotations


def with_position_ids(batch: dict) -> dict:
    """Add position_ids = arange(S) per row (a new dict; input_ids [B, S])."""
    import torch

    ids = batch["input_ids"]
    return {**batch, "position_ids": torch.arange(ids.shape[1]).expand_as(ids).clone()}


def sp_loss(logits, shift_labels, group):
    """Mean next-token cross-entropy over the whole sequence, from one rank's shard of it: the local sum and
    count all-reduced over the SP group (the sum differentiably, so each rank's backward carries the total)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.nn.functional as dnn

    flat = shift_labels.reshape(-1)
    local = torch.nn.functional.cross_entropy(logits.float().reshape(flat.numel(), -1), flat, ignore_index=-100,
                                              reduction="sum")
    count = (flat != -100).sum().to(local.dtype)
    dist.all_reduce(count, group=group)
    return dnn.all_reduce(local, group=group) / count.clamp(min=1)


def window_mask(position_ids, sliding_window: int):
    """[B, 1, S, S] boolean: key k visible to query q when k <= q, q - k < window, and both lie in the same
    document (positions restart at 0 for each packed document)."""
    import torch

    p = position_ids
    doc = torch.cumsum(p == 0, dim=-1)
    q, k = p[:, None, :, None], p[:, None, None, :]
    return (k <= q) & (q - k < sliding_window) & (doc[:, None, :, None] == doc[:, None, None, :])


def use_window_sdpa() -> None:
    """Register the window-aware sdpa under transformers' "sdpa" key; call before `accelerator.prepare`
    (Ulysses wraps whatever "sdpa" is when it registers). A layer that receives a mask is passed through."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def window_sdpa(module, query, key, value, attention_mask, *args, sliding_window=None, position_ids=None, **kw):
        if attention_mask is None and sliding_window and position_ids is not None and query.shape[2] > sliding_window:
            attention_mask = window_mask(position_ids, sliding_window)
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, position_ids=position_ids, **kw)

    AttentionInterface.register("sdpa", window_sdpa)


def launch_parallel(environ):
    """The sp / tp / cp sizes a launch asks for (accelerate's launcher exports its parallelism_config keys as
    PARALLELISM_CONFIG_*), as a validated hfscale Parallel; read once at a recipe's start."""
    from ..errors import ConfigError
    from .spec import Parallel

    if environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
        return Parallel()
    try:
        sizes = {k: int(environ.get(f"PARALLELISM_CONFIG_{k.upper()}_SIZE", "1") or 1) for k in ("sp", "tp", "cp")}
    except ValueError:
        raise ConfigError("parallelism_config sizes must be integers; fix the accelerate YAML") from None
    attn = environ.get("PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION", "sdpa")
    return Parallel(**sizes, sp_attention=attn if attn not in ("None", "") else "sdpa")


def sp_lm_loss(group):
    """A `loss_fn(model, batch)` for hfscale.train.loop.train_steps under Ulysses, where the ranks of one SP group
    read the same sequences (train_steps' data_rank): each rank computes its 1/sp slice of the tokens, at their
    global positions, and the loss is the mean over the whole sequences (sp_loss), as without SP."""
    import torch
    import torch.distributed as dist

    def loss_fn(model, batch):
        sp, rank = dist.get_world_size(group), dist.get_rank(group)
        S = batch.shape[1]
        if S % sp:
            raise ValueError(f"seq_len {S} does not divide by sp {sp}")
        lo, hi = rank * S // sp, (rank + 1) * S // sp
        labels = torch.nn.functional.pad(batch, (0, 1), value=-100)[:, 1:]  # next token; the last has none
        pos = torch.arange(S, device=batch.device).expand_as(batch)
        out = model(input_ids=batch[:, lo:hi], position_ids=pos[:, lo:hi])
        return sp_loss(out.logits, labels[:, lo:hi], group)

    return loss_fn
