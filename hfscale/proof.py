"""Prove a scale config on the real engine: a short training of a model under `accelerate launch`,
with each rank reporting what it actually holds.

    accelerate launch --config_file accelerate_configs/zero3.yaml -m hfscale.proof --out proof/
    hfscale prove --config accelerate_configs/zero3.yaml        # launches the above, then checks

Each rank writes rank{R}.json: world size and rank as accelerate, torch.distributed and the engine
see them, the sample indices it trained on, how many elements of the parameters / optimizer state it
holds (and where), and the loss of every optimizer step (the mean over all ranks).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m hfscale.proof", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for rank{R}.json")
    p.add_argument("--model", default="tiny-gemma3")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step over all ranks")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    return p.parse_args(argv)


def _zero_holdings(engine, model) -> dict:
    """Elements of parameters and optimizer state this rank holds under DeepSpeed."""
    opt = engine.optimizer
    out: dict = {"zero_stage": engine.zero_optimization_stage(), "optimizer_class": type(opt).__name__}
    base = getattr(opt, "optimizer", opt)
    out["base_optimizer_class"] = type(base).__name__
    params = list(model.parameters())
    if out["zero_stage"] == 3:
        full = sum(p.ds_numel for p in params)
        local = sum(p.ds_tensor.numel() for p in params)
        world = engine.dp_world_size
        # DeepSpeed pads each parameter to a multiple of the world size before cutting it
        halves = sum(p.ds_tensor.numel() == math.ceil(p.ds_numel / world) for p in params)
        out.update(
            param_numel_full=full,
            param_numel_local=local,
            params_partitioned_evenly=halves,
            params_total=len(params),
            param_devices=sorted({str(p.ds_tensor.device) for p in params}),
        )
    else:
        out.update(param_numel_full=sum(p.numel() for p in params), param_numel_local=sum(p.numel() for p in params))
    state_numel, state_devices, state_keys = 0, set(), set()
    for st in base.state.values():
        for k, v in st.items():
            if hasattr(v, "numel") and v.dim() > 0:
                state_numel += v.numel()
                state_devices.add(str(v.device))
                state_keys.add(k)
    out.update(
        optimizer_state_numel_local=state_numel,
        optimizer_state_devices=sorted(state_devices),
        optimizer_state_keys=sorted(state_keys),
    )
    return out


def _fsdp_holdings(model) -> dict:
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
    full = sum(p.numel() for p in params)
    return {"param_numel_full": full, "param_numel_local": local, "dtensor_params": sum(isinstance(p, DTensor) for p in params)}


def _nvme_files(path: str | None) -> dict:
    if not path or not os.path.isdir(path):
        return {}
    files = [f for f in Path(path).rglob("*") if f.is_file()]
    return {"nvme_files": len(files), "nvme_bytes": sum(f.stat().st_size for f in files)}


def run(args) -> dict:
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from .corpus import load_text, packed_blocks
    from .models import build_model, load_tokenizer
    from .scale.runtime import make_accelerator, make_optimizer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.global_batch % (args.micro_batch * world):
        raise SystemExit(f"global batch {args.global_batch} is not micro {args.micro_batch} x world {world} x an integer")
    accum = args.global_batch // (args.micro_batch * world)
    accelerator = make_accelerator(gradient_accumulation_steps=accum)

    # --- data: the first steps x global batch blocks of the corpus, each tagged with its index ---
    tokenizer = load_tokenizer(args.model)
    n = args.steps * args.global_batch
    blocks = packed_blocks(tokenizer, load_text()["train"]["text"][:400], args.seq_len)[:n]
    data = TensorDataset(blocks, torch.arange(len(blocks)))
    loader = DataLoader(data, batch_size=args.micro_batch, shuffle=False)

    # --- model / optimizer: same seed on every rank and in the single-process reference ---
    model = build_model(args.model, seed=0)
    optimizer = make_optimizer(accelerator, model, lr=args.lr)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    report: dict = {
        "config": os.environ.get("ACCELERATE_CONFIG_FILE_USED", ""),
        "distributed_type": str(accelerator.distributed_type).split(".")[-1],
        "accelerate_num_processes": accelerator.num_processes,
        "accelerate_process_index": accelerator.process_index,
        "torch_world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "torch_rank": dist.get_rank() if dist.is_initialized() else 0,
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "micro_batch": args.micro_batch,
        "gradient_accumulation_steps": accum,
        "global_batch": args.global_batch,
        "mixed_precision": accelerator.mixed_precision,
    }
    engine = getattr(accelerator, "deepspeed_engine_wrapped", None)
    if engine is not None:
        engine = engine.engine
        report["deepspeed_world_size"] = engine.world_size
        report["deepspeed_dp_world_size"] = engine.dp_world_size
        report["deepspeed_rank"] = engine.global_rank
        report["deepspeed_train_batch_size"] = engine.train_batch_size()
        report["deepspeed_micro_batch"] = engine.train_micro_batch_size_per_gpu()
        report["deepspeed_grad_accum"] = engine.gradient_accumulation_steps()
        report["deepspeed_bf16"] = engine.bfloat16_enabled()

    # --- train ---
    seen: list[int] = []
    losses: list[float] = []
    model.train()
    acc_loss = torch.zeros((), dtype=torch.float64)
    micro = 0
    for batch, idx in loader:
        seen.extend(idx.tolist())
        with accelerator.accumulate(model):
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        acc_loss += loss.detach().double()
        micro += 1
        if micro % accum == 0:
            # mean over this rank's micro batches, then over ranks = the global-batch loss
            step_loss = accelerator.reduce(acc_loss / accum, reduction="mean")
            losses.append(float(step_loss))
            acc_loss.zero_()
    report["sample_indices"] = seen
    report["losses"] = losses

    # --- what this rank holds ---
    if engine is not None:
        report.update(_zero_holdings(engine, model))
        zc = accelerator.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {})
        report.update(_nvme_files(zc.get("offload_optimizer", {}).get("nvme_path")))
    elif report["distributed_type"] == "FSDP":
        report.update(_fsdp_holdings(model))
    else:
        params = list(accelerator.unwrap_model(model).parameters())
        report.update(param_numel_full=sum(p.numel() for p in params), param_numel_local=sum(p.numel() for p in params))

    # --- a consolidated state dict must be the whole model (ZeRO-3: the 16-bit gather on save) ---
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        report["state_dict_numel"] = sum(v.numel() for v in state.values())
    accelerator.wait_for_everyone()
    return report


def main(argv=None) -> int:
    args = _parse(argv)
    report = run(args)
    from .atomic import write_text_atomic

    rank = report["torch_rank"]
    write_text_atomic(Path(args.out) / f"rank{rank}.json", json.dumps(report, indent=1))
    if rank == 0:
        print(f"[hfscale proof] {report['distributed_type']} world {report['torch_world_size']}: losses {[round(x, 4) for x in report['losses']]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
