"""Checkpoints that survive failure: save every N steps, keep the last K, resume the latest, and a
final consolidated transformers directory that is checked before success is reported.

Layout under OUTPUT_DIR/checkpoints/:
  step_00000020/                                  a complete checkpoint (accelerate save_state + hfscale_state.json)
  .hfscale-stage.<host>.<pid>.<start>.step_00000030/  a save in progress, or one a crash interrupted
                                                  (hfscale.util.atomic's stage): never resumed from
A checkpoint becomes visible only by renaming its stage after every rank has written its shard and
the marker is on disk, so a kill at any moment leaves the previous checkpoints intact and usable;
the next run removes the stage of a writer that is gone.

The marker holds the manifest (hfscale.train.manifest: every file's size and xxh3 hash), so it is
written last and is the commit mark. `--resume latest` checks the newest checkpoint against it on
every rank and falls back, in one line, to the newest intact one; none intact is one line, exit 2.
A save that fails (no space, an I/O error) on any rank removes its stage, keeps the previous
checkpoints, and every rank exits with EXIT_SAVE_FAILED after one line naming the fix.
  step_00000020.universal/                         DeepSpeed's universal form of step_00000020, made
                                                  when it is resumed on another rank count (train.reshape)
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..util.errors import HfscaleError, first_line

MARKER = "hfscale_state.json"
PREFIX = "step_"
# exit statuses a scheduler reads (sysexits.h): the save failed (no space, I/O error): fix the disk and resume;
# stopped by SIGTERM/SIGUSR1 after a checkpoint at the step boundary: requeue and resume
EXIT_SAVE_FAILED = 74  # EX_IOERR
EXIT_PREEMPTED = 75  # EX_TEMPFAIL


class CheckpointWriteError(HfscaleError):
    """A checkpoint could not be written; the previous ones are intact. Exit with EXIT_SAVE_FAILED."""
    status = EXIT_SAVE_FAILED


@dataclass(frozen=True)
class Resume:
    """The checkpoint a run continues from, and the newer ones it passed over as damaged."""
    path: Path
    meta: dict
    skipped: tuple = ()  # ((path, why), ...), newest first

    @property
    def step(self) -> int:
        return self.meta["step"]

    def note(self) -> str | None:
        if not self.skipped:
            return None
        (path, why), more = self.skipped[0], len(self.skipped) - 1
        return (f"checkpoint {path.name} is damaged ({why}){f' and {more} newer too' if more else ''}; "
                f"resuming from {self.path.name}, the newest intact one")


def damage(path: Path, meta: dict | None = None) -> str | None:
    """Why the checkpoint at `path` cannot be trusted (its files against the manifest in its marker), or None.
    A checkpoint from an hfscale that wrote no manifest is trusted as before."""
    from . import manifest

    if meta is None:
        try:
            meta = json.loads((path / MARKER).read_text())
        except (OSError, ValueError) as e:
            return f"{MARKER} unreadable: {e}"
    files = meta.get("files")
    if files is None:
        return None
    return manifest.problem(path, files, exclude=(MARKER,))


def model_fingerprint(config, adapter=None) -> dict:
    """What must agree between a checkpoint and the model that resumes from it; with an adapter
    (hfscale.scale.adapters.AdapterSpec) also its settings: another rank or target set is another set of tensors."""
    keys = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "intermediate_size")
    cfg = getattr(config, "text_config", None) or config
    out = {k: getattr(cfg, k, None) for k in keys}
    if adapter is not None and adapter.enabled:
        out["adapter"] = adapter.to_dict()
    return out


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
        writer is gone, and `step_N.partial` directories of runs from before hfscale.util.atomic staged them."""
        from ..util.atomic import clean_stale

        legacy = list(self.root.glob(f"{PREFIX}*.partial")) if self.root.is_dir() else []
        for d in legacy:
            shutil.rmtree(d, ignore_errors=True)
        return clean_stale(self.root) + legacy

    def resolve(self, resume: str | None, fingerprint: dict, tokens_per_step: int | None = None) -> Resume | None:
        """The checkpoint to resume from (None for a fresh start), checked against its manifest (every rank
        does this) and the model. `latest` passes over damaged checkpoints to the newest intact one."""
        if not resume:
            return None
        skipped = []
        if resume == "latest":
            done = self.complete()
            if not done:
                return None  # nothing saved yet: `--resume latest` on a first run starts fresh
            for _, path in reversed(done):
                why = damage(path)
                if why is None:
                    break
                skipped.append((path, why))
            else:
                raise HfscaleError(f"no intact checkpoint under {self.root}: {len(done)} checked, the newest "
                                   f"{done[-1][1].name}: {skipped[0][1]}; start over with --force or another --output-dir")
        else:
            path = Path(resume)
            if not (path / MARKER).is_file():
                raise HfscaleError(f"{resume} is not a complete hfscale checkpoint (no {MARKER}); "
                                   f"use --resume latest or a directory under {self.root}")
            why = damage(path)
            if why is not None:
                raise HfscaleError(f"checkpoint {resume} is damaged ({why}); use --resume latest to take the newest "
                                   "intact one, or another checkpoint")
        meta = json.loads((path / MARKER).read_text())
        if meta.get("model_fingerprint") != fingerprint:
            saved = meta.get("model_fingerprint", {})
            diff = {k: (saved.get(k), fingerprint.get(k)) for k in {**saved, **fingerprint}
                    if saved.get(k) != fingerprint.get(k)}
            raise HfscaleError(f"checkpoint {path} was saved from a different model ({diff} as saved vs now); "
                               "resume with the same --model or start a new --output-dir")
        saved_tokens = meta.get("tokens_per_step")
        if tokens_per_step is not None and saved_tokens is not None and saved_tokens != tokens_per_step:
            # the data position is step x global batch: another global batch would skip or repeat sequences
            raise HfscaleError(f"checkpoint {path} trained {saved_tokens:,} tokens/step and this run asks for "
                               f"{tokens_per_step:,}; resume with --global-batch-tokens {saved_tokens} (the rank count "
                               "may change: accumulation is re-derived)")
        return Resume(path, meta, tuple(skipped))

    def space_note(self, model, accelerator, adapter_only: bool = False) -> str | None:
        """One line if the output directory's file system cannot hold keep_last checkpoints plus the one being
        written (estimated from the newest checkpoint's manifest, else from the model), else None."""
        done = self.complete()
        per = None
        if done:
            files = json.loads((done[-1][1] / MARKER).read_text()).get("files")
            per = sum(v[0] for v in files.values()) if files else None
        if per is None:  # trained: fp32 weights + two fp32 Adam moments = 12 bytes/param; DeepSpeed adds its module's
            from .reshape import engine_facts  # copy; a frozen base is saved as its weights alone, or not (adapter_only)

            facts = engine_facts(accelerator)
            module = 0 if facts["engine"] != "deepspeed" else 2 if facts.get("precision") in ("bf16", "fp16") else 4
            unwrapped = accelerator.unwrap_model(model)
            trained = sum(getattr(p, "ds_numel", p.numel()) for p in unwrapped.parameters() if p.requires_grad)
            frozen = unique_numel(unwrapped) - trained
            per = trained * (12 + module) + (0 if adapter_only else frozen * (module or 4))
        held = sum(f.stat().st_size for _, d in done[-self.keep_last:] for f in d.rglob("*") if f.is_file())
        probe = self.root if self.root.exists() else self.root.parent
        free = shutil.disk_usage(probe).free
        need = per * (self.keep_last + 1)
        if free + held >= need:
            return None
        return (f"{probe} has {free / 2**20:,.0f} MiB free; keep_last {self.keep_last} checkpoints of ~{per / 2**20:,.0f} MiB "
                f"plus the one being written need {need / 2**20:,.0f} MiB: free space, lower --keep-last, or choose "
                "another --output-dir (a save that runs out of space stops the run)")

    def save(self, accelerator, step: int, meta: dict, model=None) -> Path:
        """Collective: every rank calls it. Returns the completed checkpoint directory, or raises
        CheckpointWriteError on every rank (stage removed, previous checkpoints kept). A `meta` with `base` (an adapter
        run, hfscale.train.adapter_ckpt) saves `model`'s trained tensors and their optimizer alone, never the base."""
        import contextlib

        from accelerate.utils import broadcast_object_list, gather_object

        from .adapter_ckpt import adapter_only

        from ..util.atomic import begin_stage, commit, discard, write_text_atomic
        from . import manifest
        from .reshape import engine_facts

        final = self.root / f"{PREFIX}{step:08d}"
        rank, world = accelerator.process_index, accelerator.num_processes
        scope = contextlib.ExitStack()
        save_kwargs = scope.enter_context(adapter_only(accelerator, model)) if meta.get("base") else {}  # refused: nothing staged
        # the main rank makes the stage; its name (pid-specific) is broadcast, which is also the barrier
        stage = [None]
        if accelerator.is_main_process:
            try:
                stage = [str(begin_stage(final, directory=True))]
            except HfscaleError as e:
                stage = [f"error: {e}"]
        try:
            stage = broadcast_object_list(stage)[0]
        except BaseException:  # a peer gone: the adapter-only hooks come off the model all the same
            scope.close()
            raise
        if stage.startswith("error: "):
            scope.close()
            raise CheckpointWriteError(f"checkpoint {final.name}: {stage[7:]}")
        stage = Path(stage)
        failed, hashed = None, {}
        try:
            with scope:
                accelerator.save_state(str(stage), **save_kwargs)  # model, optimizer (ZeRO shards per rank), RNG states
        except (OSError, RuntimeError) as e:  # ENOSPC reaches here as torch's "basic_ios::clear: iostream error"
            failed = _write_failure(e)
        fault("save", step, rank)
        accelerator.wait_for_everyone()  # every rank, failed or not: then all files are written
        if failed is None:  # every rank hashes a share of the files
            try:
                names = manifest.files_of(stage, exclude=(MARKER,))
                hashed = manifest.hash_files(stage, manifest.share(names, rank, world))
            except OSError as e:
                failed = _write_failure(e)
        reports = gather_object([(failed, hashed)])
        problems = [(r, f) for r, (f, _) in enumerate(reports) if f]
        error = None
        if problems:
            error = _save_error(final, problems[0][0], problems[0][1], self.complete())
        elif accelerator.is_main_process:
            files = {k: v for _, h in reports for k, v in h.items()}
            try:
                write_text_atomic(stage / MARKER, json.dumps({**meta, **engine_facts(accelerator), "step": step,
                                                              "files": files}, indent=1))
                commit(stage, final)  # replaces an older save of the same step in one swap
            except (OSError, HfscaleError) as e:
                error = _save_error(final, 0, first_line(e), self.complete())
            else:
                for _, old in self.complete()[: -self.keep_last]:
                    shutil.rmtree(old, ignore_errors=True)
                for u in self.root.glob(f"{PREFIX}*.universal"):  # conversions whose checkpoint is gone
                    if not (self.root / u.name[: -len(".universal")]).is_dir():
                        shutil.rmtree(u, ignore_errors=True)
        if accelerator.is_main_process and error is not None:
            discard(stage)
        error = broadcast_object_list([error])[0]  # the main rank's verdict: every rank raises or none
        if error is not None:
            raise CheckpointWriteError(error)
        return final

def _write_failure(e: BaseException) -> str:
    """One line for a failed write; inside DeepSpeed's save_checkpoint it also takes the barrier DeepSpeed
    ends that call with, which this rank skipped, so the ranks' collectives stay matched."""
    import traceback

    if any(f.name == "save_checkpoint" and "deepspeed" in f.filename for f in traceback.extract_tb(e.__traceback__)):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
    return f"{type(e).__name__}: {first_line(e, 200)}"


def _save_error(final: Path, rank: int, what: str, kept: list) -> str:
    usage = shutil.disk_usage(final.parent if final.parent.exists() else final.parent.parent)
    prev = f"the previous checkpoint {kept[-1][1].name} is kept" if kept else "no earlier checkpoint exists"
    return (f"saving checkpoint {final.name} failed on rank {rank} ({what}; {usage.free / 2**20:,.1f} MiB free of "
            f"{usage.total / 2**20:,.1f} MiB under {final.parent}); free space there or choose another --output-dir, "
            f"then rerun with --resume latest ({prev})")


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
        from ..util.atomic import staged

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


def adapter_state(accelerator, model) -> dict:
    """Collective. The trained (adapter) parameters, whole, on every rank: ZeRO-3 gathers them from their
    partitions (a save of the partitioned tensors is the 40-byte adapter of trl #4416 / peft #2892), FSDP2 its
    DTensor shards; DDP and ZeRO-1/2 hold them whole."""
    unwrapped = accelerator.unwrap_model(model)
    named = [(n, p) for n, p in unwrapped.named_parameters() if p.requires_grad]
    if any(hasattr(p, "ds_id") for _, p in named):
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
            return {n: p.detach().float().cpu().clone() for n, p in named}
    out = {}
    for n, p in named:
        t = p.detach()
        out[n] = (t.full_tensor() if hasattr(t, "full_tensor") else t).float().cpu().clone()
    return out


def save_final_adapter(accelerator, model, tokenizer, out: str | os.PathLike, build_base) -> dict:
    """Collective. OUTPUT_DIR/adapter (a peft directory PeftModel.from_pretrained loads) and OUTPUT_DIR/model (the
    adapter merged into `build_base()`, the unquantized base in its own dtype: never merged at 4 bits), both staged.
    Refuses success, nothing written, when the adapter file misses a tensor or holds one partial (every trained
    tensor with its full shape: ZeRO-3's ds_shape, FSDP2's global shape)."""
    from ..scale.adapters import merge_into_base

    out = Path(out)
    unwrapped = accelerator.unwrap_model(model)
    expected = {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in unwrapped.named_parameters() if p.requires_grad}
    state = adapter_state(accelerator, model)
    result: dict = {}
    if accelerator.is_main_process:
        from ..util.atomic import staged

        wrong = [n for n, t in state.items() if tuple(t.shape) != expected[n] or t.numel() == 0]
        if not state or wrong:
            raise HfscaleError(f"the adapter gathered for saving is {'empty' if not state else 'partial'} "
                               f"({wrong[:1] or 'no trained tensors'}); nothing saved: this is a bug, report it with the "
                               "launch config")
        from ..scale.adapters import tied_head_factors

        state = {**state, **tied_head_factors(unwrapped, state)}  # a tied lm_head's factors: the embedding's, transposed
        with staged(out / "adapter", directory=True) as tmp:
            # save_embedding_layers False: peft would add the whole (frozen) embedding where one is adapted
            unwrapped.save_pretrained(tmp, state_dict=state, safe_serialization=True, save_embedding_layers=False)
            numel, nbytes = saved_numel(tmp)
            want = sum(t.numel() for t in state.values())
            if numel != want:
                raise HfscaleError(f"the adapter file holds {numel:,} elements of the {want:,} trained; nothing saved: "
                                   "this is a bug, report it with the launch config")
        from ..scale.runtime import without_zero_init

        with without_zero_init(accelerator):  # built whole on this rank alone: zero.Init would wait for the others
            base = build_base()
        merged = merge_into_base(base, out / "adapter")
        merged.config.use_cache = True
        with staged(out / "model", directory=True) as tmp:
            merged.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            model_numel, model_bytes = saved_numel(tmp)
        result = {"path": str(out / "model"), "adapter": str(out / "adapter"), "numel": numel, "bytes": nbytes,
                  "model_numel": model_numel, "model_bytes": model_bytes}
    accelerator.wait_for_everyone()
    return result
