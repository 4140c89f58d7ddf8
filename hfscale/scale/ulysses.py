"""Training code under DeepSpeed Ulysses sequence parallelism (accelerate `sp_backend="deepspeed"`): what a loop
needs beyond `accelerator.prepare`, each piece measured on 2 CPU ranks (gloo, DeepSpeed 0.19.8, accelerate 1.16,
transformers 5.24; tests/test_parallel_engine.py).

  - position_ids in every batch (`with_position_ids`): the Ulysses data-loader adapter refuses batches without
    them and shards them with the tokens; after its all-gather each rank's attention sees the global positions.
    Full blocks get arange(S); a packed batch (hfscale.models.documents) keeps its own, restarting at 0 at each
    document, so the boundaries survive the split: each rank's slice carries its documents' positions and the
    all-gather puts the whole row's back together (tests/test_documents.py, a pure test of the split).
  - the loss (`sp_loss`): the adapter removes `labels` and gives each rank `shift_labels` for its tokens, so the
    model computes no loss; the token-weighted mean over the SP group is summed with a differentiable all-reduce.
  - sliding windows and packed documents (`use_window_sdpa`): Ulysses sets attention_mask = None for sdpa, so
    Gemma's sliding-window layers attend to the whole sequence (measured on the tiny Gemma 3, window 64, 256
    tokens: logits differ from position 64 on, max |diff| 1.3-1.6) and packed documents attend to each other.
    This re-registers transformers' sdpa so that, given no mask, it rebuilds the causal mask -- the window where
    the layer has one, the documents where the row holds several -- from the (gathered, global) position_ids
    (hfscale.models.documents.block_causal_mask). It materialises a B x S x S boolean mask per such layer: for
    CPU proofs and moderate S; on GPUs use flash_attention_2, which receives sliding_window itself and, for one
    row per rank, finds the documents in the gathered position_ids (transformers' _is_packed_sequence; not run
    here).
  - layers of different head shapes (`per_layer_heads`, Gemma 4: global layers with fewer K/V heads of twice
    the size): DeepSpeed sizes its one UlyssesSPAttentionHF from the config's num_key_value_heads / head_dim,
    which transformers refuses to read on Gemma 4 (AmbiguousGlobalPerLayerAttributeError at
    accelerator.prepare). Around prepare, this lets DeepSpeed's own registration run (its checks, its process
    groups) with the global values readable, then routes each attention call to a UlyssesSPAttentionHF built
    for that call's (query heads, K/V heads, head size): DeepSpeed's class, one instance per layer shape.
"""

from __future__ import annotations

import contextlib


def with_position_ids(batch: dict) -> dict:
    """The batch with position_ids (a new dict; input_ids [B, S]): a packed batch keeps its own (restarting at
    each document), full blocks get arange(S) per row."""
    import torch

    if batch.get("position_ids") is not None:
        return dict(batch)
    ids = batch["input_ids"]
    return {**batch, "position_ids": torch.arange(ids.shape[1]).expand_as(ids).clone()}


def sp_loss(logits, shift_labels, group, denominator=None):
    """Next-token cross-entropy over the whole sequence, from one rank's shard of it: the local sum all-reduced
    over the SP group (differentiably, so each rank's backward carries the total), divided by `denominator` (the
    step's trained-token count, hfscale.models.loss) or, without one, by the group's count of labelled tokens."""
    import torch

    flat = shift_labels.reshape(-1)
    local = torch.nn.functional.cross_entropy(logits.float().reshape(flat.numel(), -1), flat, ignore_index=-100,
                                              reduction="sum")
    return sp_mean(local, (flat != -100).sum(), group, denominator)


def sp_mean(local_sum, count, group, denominator=None):
    """sum over the SP group / count over the SP group (or / denominator when given), the sum all-reduced
    differentiably."""
    import torch.distributed as dist
    import torch.distributed.nn.functional as dnn

    total = dnn.all_reduce(local_sum, group=group)
    if denominator is not None:
        return total / denominator
    count = count.to(local_sum.dtype)
    dist.all_reduce(count, group=group)
    return total / count.clamp(min=1)


def needs_mask(position_ids, sliding_window: int | None) -> bool:
    """Whether a layer given no mask must get one: a window shorter than the row, or a row of several documents."""
    return bool((sliding_window and position_ids.shape[-1] > sliding_window) or (position_ids[..., 1:] == 0).any())


def use_window_sdpa():
    """Register the window- and document-aware sdpa under transformers' "sdpa" key; call before
    `accelerator.prepare` (Ulysses wraps whatever "sdpa" is when it registers). A layer that receives a mask is
    passed through. Returns the registered function."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from ..models.documents import block_causal_mask

    def window_sdpa(module, query, key, value, attention_mask, *args, sliding_window=None, position_ids=None, **kw):
        if attention_mask is None and position_ids is not None and needs_mask(position_ids, sliding_window):
            attention_mask = block_causal_mask(position_ids.expand(query.shape[0], -1), sliding_window)
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, position_ids=position_ids, **kw)

    AttentionInterface.register("sdpa", window_sdpa)
    return window_sdpa


def heterogeneous(config) -> bool:
    """Whether the config has per-layer attributes that one global value cannot describe (Gemma 4)."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    return c.__dict__.get("_heterogeneity_spec") is not None


def per_shape_attention(core, group, micro_batch: int, core_name: str | None = None, **kw):
    """An attention function for transformers' registry that runs `core` under Ulysses with DeepSpeed's
    UlyssesSPAttentionHF sized for each call's heads (one instance per (q heads, K/V heads, head size)); masks
    are dropped as DeepSpeed's own wrapper drops them (flex_attention's BlockMask kept)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    made: dict = {}

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        shape = (query.shape[1], key.shape[1], query.shape[-1])
        if shape not in made:
            made[shape] = UlyssesSPAttentionHF(attn=core, batch_size=micro_batch, attn_head_count=shape[0],
                                               attn_head_size=shape[2], kv_head_count=shape[1],
                                               num_hidden_layers=1, process_group=group, **kw)
            made[shape].core_attn_implementation = core_name
        if type(attention_mask).__name__ != "BlockMask":
            attention_mask = None
        return made[shape](module, query, key, value, attention_mask, *args, **kwargs)

    attention.instances = made
    return attention


@contextlib.contextmanager
def per_layer_heads(model):
    """Around `accelerator.prepare(model, ...)` under Ulysses (a no-op for models whose layers share one head
    shape): DeepSpeed's register_with_transformers runs as it is, with the config's global per-layer values
    readable for its single read, and the attention it registers is replaced by `per_shape_attention` over the
    same core kernel, process group and sequence-length settings."""
    if not heterogeneous(model.config):
        yield
        return
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    original = UlyssesSPAttentionHF.__dict__["register_with_transformers"]
    text = model.config.get_text_config()

    def register(cls, model_name_or_path, core_attn_implementation, sequence_parallel_size, micro_batch_size,
                 seq_length=None, seq_length_is_variable=True, disable_in_eval=False, **rest):
        allowed = text.allow_global_per_layer_attribute_access
        text.allow_global_per_layer_attribute_access = True
        core = ALL_ATTENTION_FUNCTIONS.get(core_attn_implementation)
        try:
            mpu = original.__func__(cls, model_name_or_path, core_attn_implementation, sequence_parallel_size,
                                    micro_batch_size, seq_length=seq_length, seq_length_is_variable=seq_length_is_variable,
                                    disable_in_eval=disable_in_eval, **rest)
        finally:
            text.allow_global_per_layer_attribute_access = allowed
        if mpu is not None:
            install_per_shape_attention(core_attn_implementation, core, mpu.get_sequence_parallel_group(), micro_batch_size,
                                        seq_length, seq_length_is_variable, disable_in_eval)
        return mpu

    UlyssesSPAttentionHF.register_with_transformers = classmethod(register)
    try:
        yield
    finally:
        UlyssesSPAttentionHF.register_with_transformers = original


def install_per_shape_attention(name: str, core, group, micro_batch: int, seq_length: int | None = None,
                                seq_length_is_variable: bool = True, disable_in_eval: bool = False):
    """Register `per_shape_attention(core, ...)` under transformers' attention key `name` (what DeepSpeed's
    registration does with its single-shape wrapper); returns the registered function."""
    import torch.distributed as dist
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sp = dist.get_world_size(group)
    sizes = {} if seq_length_is_variable else {"local_seq_length": seq_length // sp, "global_seq_length": seq_length}
    fn = per_shape_attention(core, group, micro_batch, name, seq_length_is_variable=seq_length_is_variable,
                             disable_in_eval=disable_in_eval, **sizes)
    ALL_ATTENTION_FUNCTIONS[name] = fn
    return fn


def launch_parallel(environ):
    """The sp / tp / cp sizes a launch asks for (accelerate's launcher exports its parallelism_config keys as
    PARALLELISM_CONFIG_*), as a validated hfscale Parallel; read once at a recipe's start."""
    from ..util.errors import ConfigError
    from .spec import Parallel

    if environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
        return Parallel()
    try:
        sizes = {k: int(environ.get(f"PARALLELISM_CONFIG_{k.upper()}_SIZE", "1") or 1) for k in ("sp", "tp", "cp")}
    except ValueError:
        raise ConfigError("parallelism_config sizes must be integers; fix the accelerate YAML") from None
    attn = environ.get("PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION", "sdpa")
    return Parallel(**sizes, sp_attention=attn if attn not in ("None", "") else "sdpa")


def sp_lm_loss(group, tiled: bool = False):
    """A `loss_fn(model, batch[, denominator])` for hfscale.train.loop.train_steps under Ulysses, where the ranks
    of one SP group read the same sequences (train_steps' data_rank): each rank computes its 1/sp slice of the
    tokens, at their global positions, and the loss is summed over the whole sequences (sp_loss), as without SP.
    `batch`: full blocks (a Long[B, S] tensor, labels = inputs: the mean over every next token, as before) or a
    packed dict (hfscale.models.documents: its labels, position ids restarting per document, divided by the
    step's `denominator` when given). `tiled`: the model computes its loss in slices
    (hfscale.scale.long_context.tile_loss_) from `shift_labels`, returning the mean over its labelled tokens,
    which times their count is the local sum."""
    import torch
    import torch.distributed as dist

    def loss_fn(model, batch, denominator=None):
        sp, rank = dist.get_world_size(group), dist.get_rank(group)
        ids, labels, pos = sp_shard_inputs(batch)
        S = ids.shape[1]
        if S % sp:
            raise ValueError(f"seq_len {S} does not divide by sp {sp}")
        lo, hi = rank * S // sp, (rank + 1) * S // sp
        mine = labels[:, lo:hi]
        # packed rows: no cache (hfscale.models.documents; the masks come from use_window_sdpa under Ulysses);
        # full blocks run as before
        extra = {} if isinstance(batch, torch.Tensor) else {"use_cache": False}
        if tiled:
            count = (mine != -100).sum()
            out = model(input_ids=ids[:, lo:hi], position_ids=pos[:, lo:hi], shift_labels=mine, **extra)
            return sp_mean(out.loss * count, count, group, denominator)
        out = model(input_ids=ids[:, lo:hi], position_ids=pos[:, lo:hi], **extra)
        return sp_loss(out.logits, mine, group, denominator)

    return loss_fn


def sp_shard_inputs(batch):
    """(input_ids, shifted labels, position_ids), each [B, S], ready to be cut into SP slices: the labels are
    shifted BEFORE the split (labels[:, t] is the token position t predicts; the last has none), so a slice's last
    token is trained on the first token of the next slice, and the position ids carry every document boundary.
    Full blocks (a tensor) get labels = the next token and arange(S) positions."""
    import torch

    if isinstance(batch, torch.Tensor):
        ids, labels = batch, batch
        pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    else:
        ids, labels, pos = batch["input_ids"], batch["labels"], batch["position_ids"]
    return ids, torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:], pos
