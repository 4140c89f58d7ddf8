"""Resuming a checkpoint on another number of ranks (a preempted job that comes back on other nodes).

What changes with the rank count, and what hfscale does about it:
- DDP: every rank holds the whole model and optimizer, and accelerate saves them once (model.safetensors,
  optimizer.bin): they load on any rank count as they are.
- DeepSpeed ZeRO-1/2/3 (CPU offload or not): each rank saved its shard of the fp32 master weights and
  Adam moments, cut for the old rank count, and DeepSpeed refuses to load them on another
  ("Automatic adjustment of ZeRO's optimizer state partitioning with a new world size is not currently
  supported"). DeepSpeed's own universal checkpointing cuts them again: `deepspeed.checkpoint.ds_to_universal`
  writes every parameter's fp32 value and moments whole, and an engine with `checkpoint.load_universal`
  takes its new shard of each. The conversion is written beside the checkpoint (`step_N.universal/`,
  staged, with its own manifest), never inside it, and reused by the next resume at any rank count.
- ZeRO-Infinity (NVMe offload): DeepSpeed does not load a universal checkpoint into NVMe-offloaded
  optimizer state, so a change of rank count there is refused in one line (resume on the saved count).
- Data: the order is a pure function of (seed, step) over the *global* batch (hfscale.data.sampler), and
  the global batch in sequences is kept (accumulation is re-derived for the new rank count), so step s
  reads the same sequences at any rank count: none twice, none skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import time
from pathlib import Path

from ..util.errors import HfscaleError

UNIVERSAL_SUFFIX = ".universal"
DS_TAG = "pytorch_model"  # the tag accelerate's save_state gives DeepSpeed's save_checkpoint


def engine_facts(accelerator) -> dict:
    """What the checkpoint of this run will be: engine, ZeRO stage, offload, ranks (stored in its marker)."""
    from .step import deepspeed_engine

    engine = deepspeed_engine(accelerator)
    fsdp = "FSDP" in str(accelerator.distributed_type)
    facts = {"ranks": accelerator.num_processes, "engine": "deepspeed" if engine is not None else "fsdp" if fsdp else "ddp"}
    if engine is not None:
        zero = engine.zero_optimization_stage()
        facts.update(zero=int(zero), offload_optimizer=str(engine.zero_offload_optimizer() and
                                                             engine._config.zero_config.offload_optimizer.device or "none"),
                     precision="bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32")
    else:  # accelerate's mixed precision: fp32 weights and optimizer state, autocast compute
        facts["precision"] = f"fp32 weights, {accelerator.mixed_precision} autocast" if accelerator.mixed_precision != "no" else "fp32"
    return facts


def saved_facts(path: Path, meta: dict) -> dict:
    """Engine and ranks of a saved checkpoint: from its marker, or (older checkpoints) from its files."""
    facts = {k: meta[k] for k in ("ranks", "engine", "zero", "offload_optimizer", "precision") if k in meta}
    if "engine" not in facts:
        facts["engine"] = "deepspeed" if (path / DS_TAG).is_dir() else "ddp"
    if "ranks" not in facts:
        if facts["engine"] == "deepspeed":
            facts["ranks"] = len(list((path / DS_TAG).glob("*optim_states.pt"))) or meta.get("world", 1)
        else:
            facts["ranks"] = meta.get("world", 1)
    return facts


def universal_dir(path: Path) -> Path:
    return path.parent / f"{path.name}{UNIVERSAL_SUFFIX}"


def check_reshape(path: Path, meta: dict, ranks: int, deepspeed_json: dict | None) -> None:
    """Before any process group exists: refuse, in one line, a change of rank count the engine cannot make."""
    saved = saved_facts(path, meta)
    if saved["ranks"] == ranks:
        return
    launch_ds = deepspeed_json is not None
    if (saved["engine"] == "deepspeed") != launch_ds:
        raise HfscaleError(f"checkpoint {path} was saved by {saved['engine']} on {saved['ranks']} ranks; this launch is "
                           f"{'DeepSpeed' if launch_ds else 'not DeepSpeed'}: resume with the engine that saved it "
                           "(the same accelerate config)")
    offload = ((deepspeed_json or {}).get("zero_optimization", {}).get("offload_optimizer") or {}).get("device")
    if saved.get("offload_optimizer") == "nvme" or offload == "nvme":
        raise HfscaleError(f"checkpoint {path} was saved on {saved['ranks']} ranks and DeepSpeed cannot load a reshaped "
                           f"(universal) checkpoint into NVMe-offloaded optimizer state: resume on {saved['ranks']} ranks, "
                           "or with optimizer offload to cpu or none")


def convert(path: Path) -> tuple[Path, bool]:
    """Main rank only. DeepSpeed's universal checkpoint of `path`, converted once beside it (staged) and reused:
    (directory, reused). The checkpoint itself is only read."""
    from deepspeed.checkpoint import ds_to_universal

    from ..util.atomic import staged, write_text_atomic
    from . import manifest
    from .state import MARKER, damage

    target = universal_dir(path)
    if (target / MARKER).is_file() and damage(target) is None:
        return target, True
    with staged(target, directory=True) as stage:
        args = argparse.Namespace(input_folder=str(path / DS_TAG), output_folder=str(stage / DS_TAG),
                                  num_extract_workers=1, num_merge_workers=1,  # no worker processes in a rank
                                  keep_temp_folder=False, strict=True, inject_missing_state=True)
        sink = io.StringIO()
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):  # its banners and progress bars
            ds_to_universal.main(args)
        files = manifest.hash_files(stage, manifest.files_of(stage))
        write_text_atomic(stage / MARKER, json.dumps({"universal_of": path.name, "files": files}, indent=1))
    return target, False


def load_universal(accelerator, path: Path) -> tuple[Path, str]:
    """Collective: the main rank converts (or reuses) `path`'s universal checkpoint, then every rank loads it."""
    from accelerate.utils import broadcast_object_list

    from .step import deepspeed_engine

    engine = deepspeed_engine(accelerator)
    said = [None]
    if accelerator.is_main_process:
        t0 = time.perf_counter()
        try:
            target, reused = convert(path)
            said = [(str(target), "reused" if reused else f"converted in {time.perf_counter() - t0:.1f} s")]
        except HfscaleError as e:
            said = [f"error: {e}"]
        except Exception as e:  # DeepSpeed's converter asserts on what it cannot convert
            said = [f"error: DeepSpeed's universal conversion of {path} failed ({type(e).__name__}: "
                    f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}); resume on the saved rank count"]
    said = broadcast_object_list(said)[0]  # also the barrier: nobody loads before the conversion is in place
    if isinstance(said, str):
        raise HfscaleError(said.removeprefix("error: "))
    target, how = said
    engine._config.load_universal_checkpoint = True  # read by engine.load_checkpoint at load time only
    try:
        accelerator.load_state(target)
    finally:
        engine._config.load_universal_checkpoint = False  # the next save is an ordinary checkpoint
    return Path(target), how
