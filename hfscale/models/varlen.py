"""Varlen attention for packed rows on any device: each document attends only within itself, and nothing is
computed or stored at the size of a row's L x L.

    from hfscale.models.varlen import use_varlen_
    use_varlen_(model)            # model.config._attn_implementation = "hfscale_varlen" (registered with transformers)
    model(**packed_batch)         # hfscale.models.documents' contract: documents from position_ids restarting at 0

Why: with sdpa / eager, transformers keeps packed documents apart by a block-diagonal [B, 1, L, L] mask, so every
row still costs L^2 attention whatever its documents (benchmarks/results/data_pipeline.md (d)). flash-attention's
varlen kernel computes only each document's own causal block, but runs on CUDA only. This kernel does the same with
torch's sdpa: the B x L tokens are cut into documents, documents of similar length are gathered into one
[n, H, P, D] batch (P the group's longest; the shorter ones padded at their END, which causal attention never lets
a real query see), one causal sdpa per group, and the outputs scattered back. Cost ~ sum of n x P^2 over groups,
within GROUP_RATIO^-2 of sum of len^2.

Registered through transformers' own extension points (5.24, read in integrations/sdpa_attention.py and
masking_utils.py):
  - AttentionInterface["hfscale_varlen"] = `varlen_attention`; it takes the layer's kwargs: `position_ids` (a new
    document wherever a position does not follow the previous one + 1, transformers' own rule), or flash's
    `cu_seq_lens_q/k` over the B x L flattened tokens (as DataCollatorWithFlattening or
    hfscale.models.documents.flash_varlen_kwargs give them), `sliding_window` (applied inside each document: key k
    is seen by query q when q - k < window), `scaling`, `softcap` (Gemma 2's tanh capping, computed explicitly),
    `dropout`, GQA (fewer K/V heads: sdpa's enable_gqa). A document of >= 3 windows skips the keys its window hides
    (query blocks against window + block keys), as flash's window_size does.
  - AttentionMaskInterface["hfscale_varlen"] = `varlen_mask`: for a causal / sliding forward over the whole
    sequence without padding (training, a prompt's prefill) it returns None, so no dense mask is built; anything
    else (decoding with a cache, a 2-D padding mask, image tokens' bidirectional overlays, encoders) gets sdpa's
    own mask, and `varlen_attention` then runs transformers' sdpa on it: generation works unchanged.

Not handled (refused by `use_varlen_`): chunked attention (Llama 4's attention_chunk_size). With a cache in train
mode (config.use_cache, the trap in hfscale.models.documents) documents are still kept apart: the boundaries come
from the layer's position_ids, not from transformers' packed-sequence detection.
"""

from __future__ import annotations

NAME = "hfscale_varlen"
GROUP_RATIO = 0.75  # documents share a padded batch when len >= 0.75 x the group's longest: <= 1.78x the exact work
_UNSET = object()
_plans: dict = {}  # the last forward's document groups, reused by its layers (keyed by the boundaries)


# what a recipe's `attention:` may name (hfscale.train.config.TrainConfig.attention); unset: the model's own kernel
ATTENTION = {
    "varlen": "this module: each packed document attends within itself, no L x L mask; any device",
    "sdpa": "torch sdpa; packed rows get transformers' block-diagonal [B, 1, L, L] mask",
    "eager": "transformers' matmul + softmax; packed rows get the block-diagonal mask",
    "flash_attention_2": "flash-attention 2's varlen kernel (CUDA, flash-attn installed)",
    "flash_attention_3": "flash-attention 3's varlen kernel (Hopper, flash-attn 3 installed)",
}


def set_attention_(model, attention: str) -> str:
    """Set `model`'s attention kernel by its ATTENTION name (in place); returns the previous attn_implementation."""
    if attention not in ATTENTION:
        raise ValueError(f"attention {attention!r} not understood; use one of {', '.join(ATTENTION)}")
    if attention == "varlen":
        return use_varlen_(model)
    previous = model.config._attn_implementation
    model.set_attn_implementation(attention)
    return previous


def register() -> str:
    """Register the kernel and its mask function with transformers (idempotent); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, varlen_attention)
    AttentionMaskInterface.register(NAME, varlen_mask)
    return NAME


def check_attention(attention: str, config) -> None:
    """Refuse (ConfigError, one line) an `attention:` choice this model or host cannot run, before anything is
    written: varlen on chunked attention (Llama 4) or on a model whose attention is not purely causal (image
    tokens' bidirectional blocks, non-causal configs: the mask hook would drop them); flash without CUDA and its
    package."""
    import importlib.util

    from ..util.errors import ConfigError

    if attention == "varlen":
        for cfg in (config, getattr(config, "text_config", None)):
            if cfg is not None and getattr(cfg, "attention_chunk_size", None):
                raise ConfigError(f"{type(cfg).__name__} uses chunked attention (attention_chunk_size), which the varlen "
                                  "kernel does not apply; keep attention: sdpa (or flash_attention_2 on GPUs)")
        if getattr(config, "vision_config", None) is not None or getattr(config, "is_causal", True) is False:
            raise ConfigError(f"attention: varlen is for causal text models; {type(config).__name__} has image tokens "
                              "or non-causal attention it would not apply: drop attention (or use sdpa)")
    elif attention.startswith("flash"):
        import torch

        package = "flash_attn_interface" if attention == "flash_attention_3" else "flash_attn"
        if not torch.cuda.is_available() or importlib.util.find_spec(package) is None:
            raise ConfigError(f"attention: {attention} needs a CUDA GPU and the {package} package; on this host use "
                              "attention: varlen (packed documents, no L x L mask) or sdpa")


def use_varlen_(model) -> str:
    """Run `model`'s attention through this kernel (in place; through DDP / DeepSpeed `.module` wrappers). Returns
    the previous attn_implementation (set it back with model.set_attn_implementation(previous))."""
    config = model.config
    while not hasattr(config, "_attn_implementation") and hasattr(model, "module"):
        model = model.module
        config = model.config
    check_attention("varlen", config)
    previous = config._attn_implementation
    model.set_attn_implementation(register())
    return previous


def varlen_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
                allow_is_causal_skip=_UNSET, use_vmap=False, **kwargs):
    """transformers' mask hook: None (no mask: the kernel finds the documents) for a causal pass over a whole
    sequence without padding; otherwise sdpa's mask, which sends the kernel to transformers' sdpa."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    whole = (allow_is_causal_skip is not _UNSET and not use_vmap and q_length == kv_length
             and int(q_offset) == 0 and int(kv_offset) == 0
             and (attention_mask is None or bool(attention_mask[:, -kv_length:].all())))
    if whole:
        return None
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function or causal_mask_function,
                     attention_mask=attention_mask, use_vmap=use_vmap,
                     **({} if allow_is_causal_skip is _UNSET else {"allow_is_causal_skip": allow_is_causal_skip}),
                     **kwargs)


def documents(batch: int, length: int, position_ids=None, cu_seq_lens=None) -> tuple[list[int], list[int]]:
    """(starts, lengths) of the documents over the batch x length flattened tokens, in order. From cu_seq_lens
    (flash's [D + 1] offsets; must cover every token and start a document at every row), else from position_ids
    (a document starts where a position is not the previous + 1), else one document per row."""
    import torch

    total = batch * length
    if cu_seq_lens is not None:
        cu = [int(x) for x in cu_seq_lens.tolist()]
        if cu[0] != 0 or cu[-1] != total or any(b <= a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seq_lens must rise from 0 to the batch's {total} tokens (got {cu[:3]}...{cu[-1:]})")
        if not set(range(0, total, length)) <= set(cu):
            raise ValueError("a document in cu_seq_lens crosses a row boundary; pack each row's documents apart (or "
                             "give position_ids restarting at 0 per document)")
        return cu[:-1], [b - a for a, b in zip(cu, cu[1:])]
    if position_ids is None:
        return list(range(0, total, length)), [length] * batch
    pos = position_ids.expand(batch, -1)
    new = torch.ones_like(pos, dtype=torch.bool)
    new[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    starts = torch.nonzero(new.reshape(-1)).reshape(-1).tolist()
    ends = starts[1:] + [total]
    return starts, [b - a for a, b in zip(starts, ends)]


def _plan(batch: int, length: int, device, position_ids=None, cu_seq_lens=None):
    """The groups ([(P, n)]: n documents padded to P), one index Long[sum n x P] of the flattened tokens laid out
    group after group (B x L = the zero pad row), and where each token lands in that layout (Long[B x L]). One
    gather in, one gather out: per-group indexing would make autograd zero-fill the whole flattened tensor once
    per group. Cached by the boundaries themselves, so the forward's other layers reuse it (a key by tensor
    identity could match a freed batch's reused memory)."""
    import torch

    starts, lens = documents(batch, length, position_ids, cu_seq_lens)
    key = (batch, length, str(device), tuple(starts))
    if key in _plans:
        return _plans[key]
    order = sorted(range(len(lens)), key=lambda d: (-lens[d], d))
    groups, i = [], 0
    while i < len(order):
        top = lens[order[i]]
        j = i
        while j < len(order) and lens[order[j]] >= GROUP_RATIO * top:
            j += 1
        groups.append((top, order[i:j]))
        i = j
    pad = batch * length
    sizes, index, at = [], [], 0
    where = torch.empty(pad, dtype=torch.long)  # each token's row in the groups' padded layout, end to end
    for top, docs in groups:
        ar = torch.arange(top)
        s = torch.tensor([starts[d] for d in docs])[:, None]
        valid = ar[None] < torch.tensor([lens[d] for d in docs])[:, None]
        index.append(torch.where(valid, s + ar[None], pad).reshape(-1))
        where[index[-1][valid.reshape(-1)]] = at + torch.nonzero(valid.reshape(-1)).reshape(-1)
        sizes.append((top, len(docs)))
        at += top * len(docs)
    plan = (sizes, torch.cat(index).to(device), where.to(device))
    _plans.clear()
    _plans[key] = plan
    return plan


def _attend(q, k, v, mask, is_causal: bool, scaling, softcap, dropout: float):
    """softmax(q k^T x scaling [tanh-capped]) v over [n, H, P, D] / [n, Hkv, P, D]; `mask` bool (True = attend)."""
    import torch
    import torch.nn.functional as F

    gqa = q.shape[1] != k.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal and mask is None,
                                              scale=scaling, enable_gqa=gqa)
    if gqa:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scaling is None else scaling)
    scores = torch.tanh(scores / softcap) * softcap
    if is_causal and mask is None:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(F.dropout(probs, p=dropout, training=dropout > 0), v)


def _windowed(q, k, v, window: int, scaling, softcap, dropout: float):
    """Causal attention within `window` over [n, H, P, D] documents, skipping what the window hides: queries in
    blocks of C = window, block j attending to the window + C keys before its end (absolute j*C - window ...
    (j+1)*C - 1), so the cost is ~P x 2 x window instead of P^2 (used from P >= 3 x window, where it is less)."""
    import torch
    import torch.nn.functional as F

    n, H, P, D = q.shape
    C = window
    nb = -(-P // C)
    tail = nb * C - P
    qb = F.pad(q, (0, 0, 0, tail)).reshape(n, H, nb, C, D).transpose(1, 2).reshape(n * nb, H, C, D)

    def blocks(t):  # [n, h, P, D] -> [n x nb, h, C + window, D]; `window` zero keys in front, `tail` behind
        u = F.pad(t, (0, 0, window, tail)).unfold(2, C + window, C)  # [n, h, nb, D, C + window]
        return u.permute(0, 2, 1, 4, 3).reshape(n * nb, t.shape[1], C + window, D)

    i = torch.arange(C, device=q.device)[:, None]
    t = torch.arange(C + window, device=q.device)[None]
    j = torch.arange(nb, device=q.device)[:, None, None]
    # query i of block j is token j*C + i, key t is token j*C + t - window: seen when 0 <= query - key < window
    # and the key is a real token (>= 0)
    mask = (t > i) & (t <= i + window) & (j * C + t >= window)  # [nb, C, C + window]
    mask = mask[None].expand(n, nb, C, C + window).reshape(n * nb, 1, C, C + window)
    out = _attend(qb, blocks(k), blocks(v), mask, False, scaling, softcap, dropout)
    return out.reshape(n, nb, H, C, D).transpose(1, 2).reshape(n, H, nb * C, D)[:, :, :P]


def varlen_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                     sliding_window=None, softcap=None, position_ids=None, cu_seq_lens_q=None, cu_seq_lens_k=None,
                     is_causal=None, **kwargs):
    """transformers' attention-function signature: q [B, H, L, D], k / v [B, Hkv, L, D] -> ([B, L, H, D], None)."""
    import torch

    B, H, L, D = query.shape
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    if attention_mask is not None or key.shape[2] != L or not causal:
        # decoding, padding, overlays: the mask transformers built (varlen_mask delegates to sdpa_mask)
        if softcap is None:
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                          is_causal=is_causal, **kwargs)
        mask = attention_mask if attention_mask is None or attention_mask.dim() == 4 else None
        out = _attend(query, key, value, mask, causal and L > 1 and mask is None and key.shape[2] == L, scaling, softcap, dropout)
        return out.transpose(1, 2).contiguous(), None
    if cu_seq_lens_q is not None and cu_seq_lens_k is not None and not torch.equal(cu_seq_lens_q, cu_seq_lens_k):
        raise ValueError("the varlen kernel takes self-attention documents: cu_seq_lens_q must equal cu_seq_lens_k")
    sizes, index, where = _plan(B, L, query.device, position_ids, cu_seq_lens_q)
    laid = [torch.cat([t.transpose(1, 2).reshape(B * L, t.shape[1], D), t.new_zeros(1, t.shape[1], D)])[index]
            for t in (query, key, value)]  # [sum n x P, heads, D]: the zero row pads the shorter documents
    pieces, at = [], 0
    for top, n in sizes:
        q, k, v = (t[at:at + n * top].view(n, top, t.shape[1], D).transpose(1, 2) for t in laid)  # [n, heads, P, D]
        at += n * top
        if sliding_window is not None and top >= 3 * sliding_window:
            out = _windowed(q, k, v, sliding_window, scaling, softcap, dropout)
        elif sliding_window is not None and top > sliding_window:
            idx = torch.arange(top, device=query.device)
            band = (idx[None, :] <= idx[:, None]) & (idx[:, None] - idx[None, :] < sliding_window)
            out = _attend(q, k, v, band, False, scaling, softcap, dropout)
        else:
            out = _attend(q, k, v, None, True, scaling, softcap, dropout)
        pieces.append(out.transpose(1, 2).reshape(n * top, H, D))
    out = torch.cat(pieces)[where]
    return out.reshape(B, L, H, D), None


__all__ = ["ATTENTION", "GROUP_RATIO", "NAME", "set_attention_", "documents", "register", "use_varlen_", "varlen_attention", "varlen_mask"]
