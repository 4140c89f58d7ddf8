"""`hfscale profile`'s launched worker: one rank of real training steps of a model, measured by
`hfscale.plan.profiler.MemoryProfiler`, its report written as rank{R}.json.

    hfscale profile --steps 3 --out prof/                                   # the tiny model, 1 process
    hfscale profile --config accelerate_configs/zero2.yaml --num-processes 2 --out prof/
    accelerate launch --config_file X.yaml -m hfscale.proofs.profile --out prof/ranks   # what the above runs

Run on CPU here (2 processes over gloo, DDP and DeepSpeed ZeRO 0-3): tests/test_profile.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

from ..plan.profiler import MemoryProfiler, RankProfile
from ..train.step import backward, deepspeed_engine, optimizer_step


# --- the worker: one rank of `accelerate launch -m hfscale.proofs.profile` (or a plain process) ------------


def _parse(argv):
    from ..util.hosts import PRECISION_CHOICES

    p = argparse.ArgumentParser(prog="python -m hfscale.proofs.profile", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for rank{R}.json")
    p.add_argument("--model", default="tiny-gemma3")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--checkpointing", default="off")
    p.add_argument("--adamw", default="fused")  # hfscale.scale.optim.ADAMW (make_optimizer checks it)
    p.add_argument("--precision", default="launch", choices=PRECISION_CHOICES)
    p.add_argument("--adapter", default="none")  # hfscale.scale.adapters.KINDS (AdapterSpec checks it)
    p.add_argument("--lora-rank", type=int, default=16)
    return p.parse_args(argv)


def _model(args, precision: str, engine: str, zero: int | None, accelerator):
    """The model as the recipe trains it: built-in weights (seeded), the adapter applied; QLoRA's base loaded in NF4
    with the dtypes the recipe uses (hfscale.scale.adapters.qlora_dtypes). `zero`: DeepSpeed's stage, None without."""
    from ..models.builtin import build_model
    from ..scale.adapters import AdapterSpec, apply_adapter, load_quantized_base, qlora_dtypes
    from ..scale.runtime import without_zero_init

    spec = AdapterSpec(args.adapter, rank=args.lora_rank)
    if spec.base_bits == 4:  # the recipe's dtypes, and its refusal (FSDP2) in one line
        dtype, storage = qlora_dtypes(precision, zero, engine == "fsdp2")
        scratch = Path(args.out) / f"qlora_base_rank{accelerator.process_index}"  # the seeded weights, then quantized
        # whole on this rank (ZeRO-3's zero.Init would write empty partitions as the weights); DeepSpeed partitions
        # the quantized model in prepare, as in the recipe (build_base)
        with without_zero_init(accelerator):
            model = load_quantized_base(args.model, dtype, storage, seed=0, scratch=scratch)
        shutil.rmtree(scratch, ignore_errors=True)
    else:
        model = build_model(args.model, seed=0)
    return apply_adapter(model, spec), spec


def run(args) -> RankProfile:
    import torch

    from ..scale.checkpointing import apply_checkpointing_
    from ..util.hosts import bf16_support, resolve_precision
    from ..models.builtin import load_config
    from ..scale.runtime import make_accelerator, make_optimizer, read_launch, set_deepspeed_micro_batch

    launched = read_launch(os.environ)
    choice = resolve_precision(args.precision, launched.precision, bf16_support("cpu" if launched.on_cpu else "cuda"),
                               what=args.model)
    accelerator = make_accelerator(precision=choice.precision if choice.overridden else None)
    set_deepspeed_micro_batch(accelerator, args.micro_batch)
    config = load_config(args.model)
    engine = "fsdp2" if accelerator.is_fsdp2 else "other"
    model, spec = _model(args, choice.precision, engine, _zero_stage(accelerator), accelerator)
    apply_checkpointing_(model, args.checkpointing, launched.fsdp_checkpoints_all)
    optimizer = make_optimizer(accelerator, model, lr=1e-4, adamw=args.adamw)
    model, optimizer = accelerator.prepare(model, optimizer)
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, config.vocab_size, (args.micro_batch, args.seq_len), generator=g).to(accelerator.device)
    model.train()
    prof = MemoryProfiler(model, optimizer, deepspeed_engine(accelerator))
    seconds = []
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        with prof.phase("forward", step):
            loss = model(input_ids=ids, labels=ids).loss
        with prof.phase("backward", step):
            backward(accelerator, loss)
        del loss
        with prof.phase("optimizer", step):
            optimizer_step(accelerator, optimizer)
        seconds.append(time.perf_counter() - t0)
    out = prof.result(accelerator, optimizer, args.model, args.micro_batch, args.seq_len, args.checkpointing,
                      choice.precision, snapshot_dir=args.out)
    # wall seconds per step, under the tracker (its per-op accounting slows every step alike)
    return replace(out, adapter=spec.kind, lora_rank=spec.rank if spec.enabled else 0, step_seconds=seconds)


def _zero_stage(accelerator) -> int | None:
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return int(plugin.deepspeed_config.get("zero_optimization", {}).get("stage", 0)) if plugin is not None else None


def main(argv=None) -> int:
    from ..util.atomic import write_text_atomic
    from ..util.quiet import quiet_unless_verbose

    quiet_unless_verbose()  # a launched rank: HFSCALE_VERBOSE=1 (hfscale --verbose) shows the notices
    args = _parse(argv)
    prof = run(args)
    write_text_atomic(Path(args.out) / f"rank{prof.rank}.json", json.dumps(prof.to_dict()))
    return 0


if __name__ == "__main__":  # a launched rank: its report is written; skip the teardown race (exit_rank)
    from hfscale.scale.runtime import exit_rank

    exit_rank(main())
