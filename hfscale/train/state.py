"""Checkpoints that survive failure: save every N steps, keep the last K, resume the latest, and a
final consolidated transformers directory that is checked before success is reported.

Layout under OUTPUT_DIR/checkpoints/:
  step_00000020/                                  a complete checkpoint (accelerate save_state + hfscale_state.json)
  .hfscale-stage.<host>.<pid>.<start>.step_00000030/  a save in progress, or one a crash interrupted
                                                  (hfscale.atomic's stage): never resumed from
A checkpoint becomes visible only by renaming its stage after every rank has written its shard and
the marker is on disk, so a kill at any moment leaves the previous checkpoints intact and usable;
the next run removes the stage of a writer that is gone.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..errors import HfscaleError

MARKER = "hfscale_state.json"
PREFIX = "step_"


def model_fingerprint(config) -> dict:
    """What must agree between a checkpoint and the model that resumes from it."""
    keys = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "intermediate_size")
    cfg = getattr(config, "text_config", None) or config
    return {k: getattr(cfg, k, None) for k in keys}


# Test seams, empty in production: each hook is called as hook(point, step, rank) at "step" (after an
# optimizer step) and "save" (after this rank wrote its checkpoint shard, before it is marked complete).
# The recovery tests install one that SIGKILLs the process there (tests/scripts/faulty_recipe.py);
# nothing here reads the environment.
FAULT_HOOKS: list = []


def fault(point: str, step: int, rank: int) -> None:
    for hook in FAULT_HOOKS:
        hook(point, step, rank)


class Checkpoints:
    def __init__(self, output_dir: str | os.PathLike, keep_last: int):
        self.root = Path(output_dir) / "checkpoints"
        self.keep_last = keep_last

    def complete(self) -> list[tuple[int, Path]]:
        found = []
        if self.root.is_dir():
            for d in self.root.iterdir():
                if d.is_dir() and d.name.startswith(PREFIX) and d.name[len(PREFIX):].isdigit() and (d / MARKER).is_file():
                    found.append((int(d.name[len(PREFIX):]), d))
        return sorted(found)

    def clean_partial(self) -> list[Path]:
        """Remove saves a crash interrupted (main process only, before training starts): stages whose
        writer is gone, and `step_N.partial` directories of runs from before hfscale.atomic staged them."""
        from ..atomic import clean_stale

        legacy = list(self.root.glob(f"{PREFIX}*.partial")) if self.root.is_dir() else []
        for d in legacy:
            shutil.rmtree(d, ignore_errors=True)
        return clean_stale(self.root) + legacy

    def resolve(self, resume: str | None, fingerprint: dict) -> tuple[Path, dict] | None:
        """The checkpoint to resume from (None for a fresh start), validated against the model."""
        if not resume:
            return None
        if resume == "latest":
            done = self.complete()
            if not done:
                return None  # nothing saved yet: `--resume latest` on a first run starts fresh
            path = done[-1][1]
        else:
            path = Path(resume)
            if not (path / MARKER).is_file():
                raise HfscaleError(f"{resume} is not a complete hfscale checkpoint (no {MARKER}); "
                                   f"use --resume latest or a directory under {self.root}")
        meta = json.loads((path / MARKER).read_text())
        if meta.get("model_fingerprint") != fingerprint:
            diff = {k: (meta.get("model_fingerprint", {}).get(k), v) for k, v in fingerprint.items()
                    if meta.get("model_fingerprint", {}).get(k) != v}
            raise HfscaleError(f"checkpoint {path} was saved from a different model ({diff} as saved vs now); "
                               "resume with the same --model or start a new --output-dir")
        return path, meta

    def save(self, accelerator, step: int, meta: dict) -> Path:
        """Collective: every rank calls it. Returns the completed checkpoint directory."""
        from accelerate.utils import broadcast_object_list

        from ..atomic import begin_stage, commit, write_text_atomic

        final = self.root / f"{PREFIX}{step:08d}"
        # the main rank makes the stage; its name (pid-specific) is broadcast, which is also the barrier
        stage = [str(begin_stage(final, directory=True)) if accelerator.is_main_process else None]
        stage = Path(broadcast_object_list(stage)[0])
        accelerator.save_state(str(stage))  # model, optimizer (ZeRO shards per rank), RNG states
        fault("save", step, accelerator.process_index)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            write_text_atomic(stage / MARKER, json.dumps({**meta, "step": step}, indent=1))
            commit(stage, final)  # replaces an older save of the same step in one swap
            for _, old in self.complete()[: -self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        accelerator.wait_for_everyone()
        return final


def unique_numel(model) -> int:
    """Parameter elements of the whole model (ZeRO-3 keeps the full size in ds_numel); tied weights once."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


def saved_numel(directory: Path) -> tuple[int, int]:
    """(elements, bytes) of all tensors in a directory's safetensors files, read from their headers."""
    from safetensors import safe_open

    numel = nbytes = 0
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                sl = st.get_slice(k)
                n = 1
                for d in sl.get_shape():
                    n *= d
                numel += n
        nbytes += f.stat().st_size
    return numel, nbytes


def _drop_tied(model, state: dict) -> dict:
    """DeepSpeed's consolidated state dict holds tied weights (Gemma's lm_head = embed_tokens) as two
    tensors; keep one, as transformers does, when the model ties them and they are equal."""
    import torch

    tied = getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or {}
    if not isinstance(tied, dict) or not getattr(model.config, "tie_word_embeddings", False):
        return state
    keep = dict(state)
    for k, target in tied.items():
        if k in keep and target in keep and torch.equal(keep[k], keep[target]):
            del keep[k]
    return keep


def save_final(accelerator, model, tokenizer, out: str | os.PathLike) -> dict:
    """Collective. Consolidate (ZeRO-3: 16-bit gather), write a transformers directory atomically,
    and refuse success if it holds fewer parameter elements than the model."""
    out = Path(out)
    expected = unique_numel(accelerator.unwrap_model(model))
    state = accelerator.get_state_dict(model)  # gathers ZeRO-3 shards to the main process
    result: dict = {}
    if accelerator.is_main_process:
        from ..atomic import staged

        state = _drop_tied(accelerator.unwrap_model(model), state)
        # checkpointing switched the KV cache off for training; the saved model is for inference and fine-tuning
        accelerator.unwrap_model(model).config.use_cache = True
        with staged(out, directory=True) as tmp:  # removed again if the check below refuses
            accelerator.unwrap_model(model).save_pretrained(tmp, state_dict=state, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            numel, nbytes = saved_numel(tmp)
            if numel < expected:
                raise HfscaleError(
                    f"the consolidated save holds {numel:,} parameter elements but the model has {expected:,}; "
                    "for ZeRO-3 set stage3_gather_16bit_weights_on_model_save: true in the DeepSpeed JSON"
                )
        result = {"path": str(out), "numel": numel, "model_numel": expected, "bytes": nbytes}
    accelerator.wait_for_everyone()
    return result
