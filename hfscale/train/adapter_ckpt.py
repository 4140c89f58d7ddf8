"""Adapter-only checkpoints: an adapter run (LoRA, DoRA, QLoRA) saves the trained tensors and Adam's state for them,
never the frozen base, and records which base it needs.

What a checkpoint of an adapter run holds (every engine the recipe runs adapters on):
- the model state of the trained parameters alone: DDP's model.safetensors, DeepSpeed's module entries (ZeRO-1/2 the
  adapter whole, ZeRO-3 its empty placeholders; `save_checkpoint(exclude_frozen_parameters=True)`: no
  frozen_param_fragments), FSDP2's DCP shards. A QLoRA base's quantization state (absmax, quant_map, ...) is base
  too and is not written either;
- the optimizer for the trained parameters (it never held more);
- in its marker, `base`: the model source and its seed (a built-in model is built from them) or, for a directory,
  an xxh3 of its config and weight files' sizes and safetensors headers (`source_key`, cheap: no tensor is read),
  and `digest`, an xxh3 of the live frozen base's bytes (names, dtypes, shapes, values; an NF4 weight's packed bytes
  and quantization state) as the run held it (`base_digest`).

A resume rebuilds the base from the run's model source (QLoRA: re-quantized to NF4), then loads the adapter state over
it. Refused in one line: another source or seed before any process starts (`check_source`, from preflight), and a
base whose bytes differ from the digest after it is built (`check_digest`: a changed weight file, another
bitsandbytes or dtype giving other NF4 codes). Loading tolerates exactly the frozen keys missing: a load post-hook
clears them from `missing_keys`, so a strict load still fails on a missing adapter tensor.

Cost, as a fraction of the old checkpoint: the base was 2-4 B per base parameter (fp32 under DDP / FSDP2, the 16-bit
module under DeepSpeed), 54+ GB for a 27B Gemma; the adapter state is ~16 B per trained parameter. The digest reads
the base once per launch (xxh3 ~5 GB/s; ZeRO-3 gathers one parameter at a time, FSDP2 one DTensor at a time).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from ..util.errors import HfscaleError


def trained_names(module) -> set[str]:
    return {n for n, p in module.named_parameters() if p.requires_grad}


def _is_trained(key: str, trained: set[str]) -> bool:
    """`key` names a trained parameter, under any wrapper's prefix (DDP's `module.`)."""
    return key in trained or any(key.endswith("." + t) for t in trained)


@contextlib.contextmanager
def adapter_only(accelerator, model):
    """Inside: the unwrapped model's state_dict holds its trained parameters alone, and a load_state_dict accepts the
    frozen ones missing (the trained ones stay required). Yields the keyword arguments accelerate's save_state passes
    to the engine (DeepSpeed: exclude_frozen_parameters, else none). Refuses an adapter with nothing trained."""
    from .step import deepspeed_engine

    module = accelerator.unwrap_model(model)
    trained = trained_names(module)
    if not trained:
        raise HfscaleError("the adapter run has no trained parameter to checkpoint (an empty adapter); nothing saved: "
                           "check adapter targets against the model's linear names")

    def drop_base(_, state, prefix, __):
        for k in [k for k in state if k.startswith(prefix) and k[len(prefix):] not in trained]:
            del state[k]

    def allow_missing_base(_, keys):
        keys.missing_keys[:] = [k for k in keys.missing_keys if _is_trained(k, trained)]

    handles = [module.register_state_dict_post_hook(drop_base),
               module.register_load_state_dict_post_hook(allow_missing_base)]
    try:
        yield {"exclude_frozen_parameters": True} if deepspeed_engine(accelerator) is not None else {}
    finally:
        for h in handles:
            h.remove()


# --- which base ---------------------------------------------------------------------------------------------------

def source_key(model: str, seed: int) -> dict:
    """The base a run builds, from its source alone (no tensor read): a built-in name and the seed it is built with,
    or a directory's path (shown, not compared: the same weights under another path or spelling are the same base)
    and an xxh3 of each weight file's name, size and safetensors header (not config.json, whose transformers_version
    a re-save changes; what the weights are is the digest's to say, `base_digest`)."""
    from ..models.builtin import is_builtin
    from ..util.hashing import hash_text

    if is_builtin(model):
        return {"source": model, "seed": int(seed)}
    root, parts = Path(model), []
    if root.is_dir():
        for f in sorted([*root.glob("*.safetensors"), *root.glob("pytorch_model*.bin")]):
            if not f.is_file():
                continue
            parts += [f.name, str(f.stat().st_size)]
            if f.suffix == ".safetensors":
                with open(f, "rb") as fh:
                    n = int.from_bytes(fh.read(8), "little")
                    parts.append(fh.read(min(n, 100 << 20)).decode("utf-8", "replace"))
    return {"source": model, "files": hash_text(*parts) if parts else None}


def check_source(path: Path, saved: dict | None, now: dict) -> None:
    """Before any process group: refuse (one line) an adapter-only checkpoint on another base source or seed."""
    if saved is None:
        return
    if not isinstance(saved, dict):
        raise HfscaleError(f"checkpoint {path}'s marker names its base as {saved!r}, not a mapping: the marker was edited; "
                           "resume from another checkpoint or start a new --output-dir")
    # a directory is compared by its weight files (its path only shown); a built-in by its name and seed
    keys = [k for k in now if not (k == "source" and "files" in now)]
    if any(saved.get(k) != now[k] for k in keys):
        diff = ", ".join(f"{k} {saved.get(k)!r} (now {now[k]!r})" for k in keys if saved.get(k) != now[k])
        raise HfscaleError(f"checkpoint {path} holds an adapter without its base and was trained on another base ({diff}); "
                           f"resume with --model {saved.get('source')}" + (f" --seed {saved['seed']}" if "seed" in saved else "")
                           + ", or start a new --output-dir")


def base_digest(module) -> str:
    """Collective under ZeRO-3 / FSDP2 (every rank, same order). xxh3 of the frozen parameters of `module` (the
    unwrapped model): name, dtype, shape and bytes, and an NF4 weight's quantization state; ZeRO-3 gathers each
    parameter whole, FSDP2 each DTensor. The same on every rank and rank count."""
    import torch
    import xxhash

    h = xxhash.xxh3_64()

    def add(name, t):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # the buffer itself: no second host copy

    for name, p in module.named_parameters():
        if p.requires_grad:
            continue
        if hasattr(p, "ds_id"):
            import deepspeed

            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                add(name, p.data)
        else:
            add(name, p.full_tensor() if hasattr(p, "full_tensor") else p.data)
        qs = getattr(p, "quant_state", None)
        if qs is not None:
            for k, v in sorted(qs.as_dict(packed=False).items()):
                if torch.is_tensor(v):
                    add(f"{name}.{k}", v)
    return h.hexdigest()


def check_digest(path: Path, saved: dict, digest: str) -> None:
    """After the base is built: refuse (one line, every rank) a base whose bytes differ from the checkpoint's."""
    if saved.get("digest") not in (None, digest):
        raise HfscaleError(f"the base built from {saved.get('source')} differs from the one checkpoint {path} was trained "
                           f"on (its bytes hash {digest}, the checkpoint's base {saved['digest']}): another weight file, "
                           "or for QLoRA another NF4 quantization (bitsandbytes version, dtypes); resume on the base the "
                           "adapter trained on, or start a new --output-dir")
