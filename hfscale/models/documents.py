"""Model inputs of a packed batch: documents in one row never attend to each other, whatever attention kernel runs.

The batch contract (the data layer's collator makes it; `check_packed_batch` says what breaks it):

    input_ids     Long[B, L]
    labels        Long[B, L]  the token where it is trained, -100 elsewhere (padding, untrained turns, and the
                              first token of every document: nothing before it in its row may predict it);
                              the model shifts (labels[:, t] is predicted from position t - 1), as in transformers
    position_ids  Long[B, L]  0, 1, 2, ... restarting at 0 at each document; padding after the last document is
                              one dummy document of its own (0, 1, ...) with every label -100

A document starts exactly where position_ids is 0. Nothing else is in the dict, so `model(**batch)` runs in
transformers' Trainer once `respect_documents_(model)` is on the model.

What each kernel is given (transformers 5.24, read in masking_utils.py / modeling_flash_attention_utils.py):
  - sdpa, eager (and flex): transformers builds the block-diagonal causal mask itself from position_ids
    (`find_packed_sequence_indices`: a new document wherever positions do not step by 1), for every layer type
    (Gemma's sliding-window layers get the window inside each document) -- but ONLY when the forward has no cache
    and no 2-D attention_mask. In train mode the models make a DynamicCache whenever config.use_cache is true (the
    default; gradient checkpointing turns it off), and then the rows are plain causal: documents attend across
    their boundaries without a word (measured: tiny Gemma 3, sdpa, 100 + 70 tokens + 22 padding, loss 8.3782 vs
    8.3937 for the documents one by one). So every forward of a packed batch passes use_cache=False.
    tests/test_documents.py proves loss and gradients equal to the documents run one by one (Gemma 3, Gemma 4,
    Llama, Qwen 3; sdpa and eager; CPU).
  - flash_attention_2/3: transformers reads packing from position_ids only for a batch of one row; for B > 1 it
    needs the varlen arguments over the B x L flattened tokens (`flash_varlen_kwargs`), which the forward is given.
    Flash does not run on CPU: the values are tested, the kernel has NOT run here.
  - under DeepSpeed Ulysses the attention function gets no mask (DeepSpeed's wrapper drops 4-D masks) and the
    gathered, global position_ids: `document_attention` (hfscale.scale.ulysses.use_document_sdpa) rebuilds the
    mask from them with `block_causal_mask`.
"""

from __future__ import annotations

IGNORE_INDEX = -100
BATCH_KEYS = ("input_ids", "labels", "position_ids")
FLASH_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def document_ids(position_ids):
    """Long[B, L]: which document of its row each token belongs to (0, 1, ...; a new one wherever position is 0)."""
    import torch

    return torch.cumsum(position_ids == 0, dim=-1) - 1


def check_packed_batch(batch: dict) -> None:
    """Refuse (ValueError naming the fix) a batch that breaks the contract above: other keys, shapes or dtypes
    that differ, a row that does not start a document, positions that neither step by 1 nor restart at 0, or
    a document's first token carrying a label (it would be trained on the previous document's last token)."""
    import torch

    keys = set(batch)
    if keys != set(BATCH_KEYS):
        raise ValueError(f"a packed batch holds exactly {', '.join(BATCH_KEYS)} (got {', '.join(sorted(keys))}); "
                         "make the collator return only those")
    shapes = {k: tuple(batch[k].shape) for k in BATCH_KEYS}
    if len(set(shapes.values())) != 1 or len(shapes["input_ids"]) != 2:
        raise ValueError(f"input_ids, labels and position_ids must all be [B, L] (got {shapes})")
    if any(batch[k].dtype != torch.long for k in BATCH_KEYS):
        raise ValueError("input_ids, labels and position_ids must be torch.long")
    pos, labels = batch["position_ids"], batch["labels"]
    if (pos[:, 0] != 0).any():
        raise ValueError("every row must start a document (position_ids[:, 0] == 0)")
    step = pos[:, 1:] - pos[:, :-1]
    if ((step != 1) & (pos[:, 1:] != 0)).any():
        raise ValueError("position_ids must count 0, 1, 2, ... within a document and restart at 0 at the next")
    if (labels[pos == 0] != IGNORE_INDEX).any():
        raise ValueError("the first token of every document must have label -100 (nothing before it in the row "
                         "may predict it)")


def block_causal_mask(position_ids, sliding_window: int | None = None):
    """Bool[B, 1, L, L]: key k visible to query q when k <= q, both lie in the same document and (with a
    sliding window) q - k < sliding_window. True = attend, as sdpa takes a boolean mask."""
    import torch

    doc = document_ids(position_ids)
    idx = torch.arange(position_ids.shape[-1], device=position_ids.device)
    q, k = idx[:, None], idx[None, :]
    keep = (k <= q)[None] & (doc[:, :, None] == doc[:, None, :])
    if sliding_window:
        keep = keep & (q - k < sliding_window)[None]
    return keep[:, None]


def flash_varlen_kwargs(position_ids) -> dict:
    """flash-attention's varlen arguments for a packed batch, over its B x L tokens flattened in row order (what
    transformers' flash path does with q/k/v when it is given them): cu_seq_lens_q/k int32 [D + 1] (the start of
    each of the D documents, then B x L), max_length_q/k the longest document (an int). Not run on a flash kernel
    here (CPU only); the values are tested."""
    import torch

    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).reshape(-1).to(torch.int32)
    cu = torch.cat([starts, torch.tensor([flat.numel()], dtype=torch.int32, device=flat.device)])
    longest = int((cu[1:] - cu[:-1]).max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def is_flash(attn_implementation: str | None) -> bool:
    return bool(attn_implementation) and "flash" in str(attn_implementation)


def forward_kwargs(batch: dict, attn_implementation: str | None) -> dict:
    """What to pass to `model(...)` for a packed batch: the batch, use_cache=False (so transformers builds the
    block-diagonal masks for sdpa / eager / flex), and for flash kernels the varlen arguments."""
    out = {**batch, "use_cache": False}
    if is_flash(attn_implementation) and "position_ids" in batch:
        out.update(flash_varlen_kwargs(batch["position_ids"]))
    return out


def unwrapped(model):
    """The transformers model inside DDP / DeepSpeed / FSDP wrappers (`.module`); a PeftModel stays as it is (it
    answers the model's attributes)."""
    while not hasattr(getattr(model, "config", None), "_attn_implementation") and hasattr(model, "module"):
        model = model.module
    return model


def attn_implementation(model) -> str | None:
    """The attention kernel of a transformers model, through DDP / DeepSpeed / FSDP wrappers (`.module`)."""
    return getattr(getattr(unwrapped(model), "config", None), "_attn_implementation", None)


def respect_documents_(model):
    """Make `model(**batch)` (transformers' Trainer, TRL, users' loops) keep packed documents apart: a forward
    pre-hook that adds `forward_kwargs`' extras to every call given position_ids. In place; returns the hook's
    handle (`.remove()` undoes it). The kernel is read at each call, so a later set_attn_implementation counts."""

    def hook(module, args, kwargs):
        pos = kwargs.get("position_ids")
        if pos is None or kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
            return None  # not a packed training batch (generation keeps its cache)
        extra = forward_kwargs({"position_ids": pos}, attn_implementation(module))
        for k, v in extra.items():
            kwargs.setdefault(k, v)
        return args, kwargs

    return model.register_forward_pre_hook(hook, with_kwargs=True)


__all__ = ["BATCH_KEYS", "FLASH_KWARGS", "IGNORE_INDEX", "attn_implementation", "block_causal_mask",
           "check_packed_batch", "document_ids", "flash_varlen_kwargs", "forward_kwargs", "is_flash",
           "respect_documents_", "unwrapped"]
