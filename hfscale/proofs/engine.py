"""Prove a scale config on the real engine: a short training of a model under `accelerate launch`,
with each rank reporting what it actually holds.

    accelerate launch --config_file accelerate_configs/zero3.yaml -m hfscale.proofs.engine --out proof/
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

from ..util.hosts import PRECISION_CHOICES


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m hfscale.proofs.engine", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for rank{R}.json")
    p.add_argument("--model", default="tiny-gemma3")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step over all ranks")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--precision", default="launch", choices=PRECISION_CHOICES,
                   help="launch: as the config says; auto: the same but fp32 where this host emulates bf16")
    p.add_argument("--checkpointing", default="off", help="off | full | every:K (transformers' checkpointing)")
    return p.parse_args(argv)


def count_layer_forwards(model) -> list[int]:
    """Forward calls of each decoder layer's attention module: transformers checkpoints a layer's `forward` (the
    layer's own hooks, FSDP2's included, stay outside), so the layer's submodules are what runs again when backward
    recomputes it: after M micro steps a checkpointed layer reads 2M and an unchecked one M."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    calls = [0] * len(layers)

    def hook(i):
        def count(module, args):
            calls[i] += 1
        return count

    for i, layer in enumerate(layers):
        inner = getattr(layer, "self_attn", None) or next(layer.children())
        inner.register_forward_pre_hook(hook(i))
    return calls


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
            param_dtypes=sorted({str(p.ds_tensor.dtype) for p in params}),
        )
    else:
        out.update(param_numel_full=sum(p.numel() for p in params), param_numel_local=sum(p.numel() for p in params),
                   param_dtypes=sorted({str(p.dtype) for p in params}))
    per_key: dict[str, int] = {}
    devices = set()
    for st in base.state.values():
        for k, v in st.items():
            if hasattr(v, "numel") and v.dim() > 0:
                per_key[k] = per_key.get(k, 0) + v.numel()
                devices.add(str(v.device))
    out.update(
        optimizer_state_numel_local=sum(per_key.values()),
        optimizer_state_numel_by_key=per_key,
        optimizer_state_devices=sorted(devices),
    )
    # the fp32 partition the optimizer steps on (ZeRO-1/2: single_partition_of_fp32_groups, ZeRO-3:
    # fp32_partitioned_groups_flat) and its .grad, which DeepSpeed keeps allocated on the offload device
    # when the optimizer is offloaded (and frees after every step otherwise): what `hfscale plan` offloads
    flats = list(getattr(opt, "single_partition_of_fp32_groups", None) or getattr(opt, "fp32_partitioned_groups_flat", None) or [])
    grads = [t.grad for t in flats if t.grad is not None]
    out.update(
        fp32_master_numel_local=sum(t.numel() for t in flats),
        fp32_master_devices=sorted({str(t.device) for t in flats}),
        fp32_grad_numel_local=sum(g.numel() for g in grads),
        fp32_grad_devices=sorted({str(g.device) for g in grads}),
        offload_optimizer=bool(getattr(opt, "cpu_offload", False) or getattr(opt, "offload_optimizer", False)),
        offload_param=bool(getattr(opt, "offload_param", False)),
    )
    return out


def _fsdp_holdings(model, optimizer, world: int) -> dict:
    """What this rank holds under FSDP2: every parameter a DTensor sharded on dim 0 over the world, this rank's
    local piece the size torch.chunk gives it (ceil(dim0 / world) rows, fewer on the last ranks), and the Adam
    moments the same shards."""
    import math

    from torch.distributed.tensor import DTensor, Shard

    params = list(model.parameters())
    even = 0
    for p in params:
        if not isinstance(p, DTensor):
            continue
        mesh = p.device_mesh
        rank = mesh.get_local_rank()
        rows = p.shape[0]
        chunk = math.ceil(rows / world)
        mine = max(0, min(chunk, rows - rank * chunk))  # torch.chunk's split of dim 0
        local = p.to_local()
        if (mesh.size() == world and tuple(p.placements) == (Shard(0),) and local.shape[0] == mine
                and tuple(local.shape[1:]) == tuple(p.shape[1:])):
            even += 1
    base = getattr(optimizer, "optimizer", optimizer)
    per_key: dict[str, int] = {}
    devices = set()
    for st in base.state.values():
        for k, v in st.items():
            if hasattr(v, "dim") and v.dim() > 0:
                v_local = v.to_local() if isinstance(v, DTensor) else v
                per_key[k] = per_key.get(k, 0) + v_local.numel()
                devices.add(str(v_local.device))
    return {
        "param_numel_full": sum(p.numel() for p in params),
        "param_numel_local": sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params),
        "params_total": len(params),
        "dtensor_params": sum(isinstance(p, DTensor) for p in params),
        "params_sharded_dim0": even,  # DTensor, Shard(0) over a mesh of the world size, this rank's torch.chunk piece
        "param_dtypes": sorted({str(p.dtype) for p in params}),
        "param_devices": sorted({str(p.to_local().device if isinstance(p, DTensor) else p.device) for p in params}),
        "optimizer_state_numel_local": sum(per_key.values()),
        "optimizer_state_numel_by_key": per_key,
        "optimizer_state_devices": sorted(devices),
        "base_optimizer_class": type(base).__name__,
    }


def _nvme_files(path: str | None, rank: int) -> dict:
    """This rank's swap files under the NVMe path ({path}/zero_stage_3/optimizer/rank{R}/*.swp)."""
    if not path or not os.path.isdir(path):
        return {}
    files = {str(f.relative_to(path)): f.stat().st_size for f in Path(path).rglob(f"rank{rank}/*") if f.is_file()}
    return {"nvme_files": files, "nvme_bytes": sum(files.values())}


def run(args) -> dict:
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from ..scale.checkpointing import apply_checkpointing_
    from ..data.corpus import load_text, packed_blocks
    from ..models.builtin import build_model, load_tokenizer
    from ..util.hosts import bf16_support, resolve_precision
    from ..scale.runtime import make_accelerator, make_optimizer, read_launch

    launched = read_launch(os.environ)
    world = launched.world
    if args.global_batch % (args.micro_batch * world):
        raise SystemExit(f"global batch {args.global_batch} is not micro {args.micro_batch} x world {world} x an integer")
    accum = args.global_batch // (args.micro_batch * world)
    choice = resolve_precision(args.precision, launched.precision, bf16_support("cpu" if launched.on_cpu else "cuda"),
                               what=args.model)
    accelerator = make_accelerator(precision=choice.precision if choice.overridden else None,
                                   gradient_accumulation_steps=accum)
    if accelerator.is_main_process and choice.note:
        print(f"[hfscale proof] {choice.note}", flush=True)

    # --- data: the first steps x global batch blocks of the corpus, each tagged with its index ---
    tokenizer = load_tokenizer(args.model)
    n = args.steps * args.global_batch
    blocks = packed_blocks(tokenizer, load_text()["train"]["text"][:400], args.seq_len)[:n]
    data = TensorDataset(blocks, torch.arange(len(blocks)))
    loader = DataLoader(data, batch_size=args.micro_batch, shuffle=False)

    # --- model / optimizer: same seed on every rank and in the single-process reference ---
    model = build_model(args.model, seed=0)
    checkpointed = apply_checkpointing_(model, args.checkpointing, launched.fsdp_checkpoints_all)
    layer_calls = count_layer_forwards(model)
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
        "precision": choice.precision,
        "precision_note": choice.note,
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
    from ..models.loss import lm_loss

    losses: list[float] = []
    model.train()
    acc_loss = torch.zeros((), dtype=torch.float64)
    micro = 0
    for batch, idx in loader:
        seen.extend(idx.tolist())
        with accelerator.accumulate(model):
            loss = lm_loss(model, batch)
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
    report["dataset_size"] = len(blocks)
    report["losses"] = losses
    report["micro_steps"] = micro
    report["checkpointed_layers"] = checkpointed
    report["layer_forward_calls"] = list(layer_calls)

    # --- what this rank holds ---
    if engine is not None:
        report.update(_zero_holdings(engine, model))
        zc = accelerator.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {})
        report.update(_nvme_files(zc.get("offload_optimizer", {}).get("nvme_path"), report["torch_rank"]))
    elif report["distributed_type"] == "FSDP":
        report.update(_fsdp_holdings(model, optimizer, accelerator.num_processes))
    else:  # DDP: a full replica and a full optimizer state on every rank
        params = list(accelerator.unwrap_model(model).parameters())
        report.update(param_numel_full=sum(p.numel() for p in params), param_numel_local=sum(p.numel() for p in params))
        base = getattr(optimizer, "optimizer", optimizer)
        per_key: dict[str, int] = {}
        for st in base.state.values():
            for k, v in st.items():
                if v.dim() > 0:
                    per_key[k] = per_key.get(k, 0) + v.numel()
        report.update(optimizer_state_numel_local=sum(per_key.values()), optimizer_state_numel_by_key=per_key,
                      base_optimizer_class=type(base).__name__)

    # --- a consolidated state dict must be the whole model (ZeRO-3: the 16-bit gather on save) ---
    batch = blocks[: args.micro_batch]
    live = _logits(accelerator, model, batch) if report["distributed_type"] == "FSDP" else None
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        report["state_dict_numel"] = sum(v.numel() for v in state.values())
        if live is not None:  # the consolidated state dict, loaded into a fresh model, gives the live model's logits
            fresh = build_model(args.model, seed=1)
            fresh.load_state_dict(state)
            compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision)
            fresh = fresh.to(compute) if compute else fresh  # as the MixedPrecisionPolicy casts the shards
            report["consolidated_max_abs_logit_diff"] = (_logits(accelerator, fresh, batch) - live).abs().max().item()
    accelerator.wait_for_everyone()
    return report


def _logits(accelerator, model, batch):
    """fp32 logits of `model` on `batch` in eval mode, under the run's autocast (collective under FSDP2)."""
    import torch

    model.eval()
    with torch.no_grad(), accelerator.autocast():
        return model(input_ids=batch).logits.float()


def main(argv=None) -> int:
    from ..util.quiet import quiet_unless_verbose

    quiet_unless_verbose()  # a launched rank: HFSCALE_VERBOSE=1 (hfscale --verbose) shows the notices
    args = _parse(argv)
    report = run(args)
    from ..util.atomic import write_text_atomic

    rank = report["torch_rank"]
    write_text_atomic(Path(args.out) / f"rank{rank}.json", json.dumps(report, indent=1))
    if rank == 0:
        print(f"[hfscale proof] {report['distributed_type']} world {report['torch_world_size']}: losses {[round(x, 4) for x in report['losses']]}")
    return 0


if __name__ == "__main__":  # a launched rank: its report is written; skip the teardown race (exit_rank)
    from hfscale.scale.runtime import exit_rank

    exit_rank(main())


# --- launching and reading proofs (used by `hfscale prove`, the demo and the tests) ---------------


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(config: str, out: str | Path, num_processes: int = 2, extra: list[str] | None = None,
           num_machines: int = 1, timeout: float = 900, log: str | Path | None = None,
           precision: str = "launch", module: str = "hfscale.proofs.engine", port: int | None = None) -> list[dict]:
    """Run the proof (or another rank worker `module` taking --out and --precision and writing
    rank{R}.json there, e.g. hfscale.proofs.profile) under `accelerate launch --config_file config` and return
    the rank reports.

    precision: "launch" runs what the config says; "auto" the same except fp32 where this host
    emulates bf16 (the demo's and the engine tests' choice); bf16 / fp16 / fp32 force it.

    num_machines > 1 starts one launcher per machine rank on this host (127.0.0.1), the way a
    multi-node job runs, with num_processes counted over all machines.

    port: the main process's port (default: a free one now); launches run side by side need distinct ones.
    """
    import subprocess

    from ..scale.load import launch_deepspeed_file
    from ..util.errors import HfscaleError

    ds_file = launch_deepspeed_file(config)  # accelerate reads it from the launch directory: pass it found
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("rank*.json"):
        old.unlink()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // num_processes)))
    port = str(port or free_port())
    base = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
            "--num_processes", str(num_processes), "--main_process_port", port]
    if ds_file is not None:
        base += ["--deepspeed_config_file", str(ds_file)]
    script = ["-m", module, "--out", str(out), "--precision", precision, *(extra or [])]
    if num_machines == 1:
        cmds = [base + ["--num_machines", "1", "--machine_rank", "0", *script]]
    else:
        cmds = [base + ["--num_machines", str(num_machines), "--machine_rank", str(r),
                        "--main_process_ip", "127.0.0.1", *script] for r in range(num_machines)]
    log_path = Path(log) if log else out / "launch.log"
    with open(log_path, "w") as logf:
        procs = [subprocess.Popen(c, env=env, stdout=logf, stderr=subprocess.STDOUT) for c in cmds]
        try:
            codes = [p.wait(timeout=timeout) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    if any(codes):
        tail = [ln for ln in log_path.read_text(errors="replace").splitlines() if "Error" in ln or "error:" in ln]
        raise HfscaleError(f"accelerate launch exited {codes} for {config}: {(tail or ['see ' + str(log_path)])[-1].strip()[:300]}")
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"), key=lambda p: int(p.stem[4:]))]
    if len(reports) != num_processes:
        raise HfscaleError(f"expected {num_processes} rank reports in {out}, found {len(reports)}")
    return reports


def summarize(name: str, reports: list[dict], reference: list[dict] | None = None) -> dict:
    """The facts a proof establishes, as one flat row (what `hfscale prove` and the demo print)."""
    r0 = reports[0]
    all_idx = [i for r in reports for i in r["sample_indices"]]
    row = {
        "config": name,
        "engine": r0["distributed_type"],
        "world (accelerate/torch/engine)": "/".join(
            str(r0.get(k, "-")) for k in ("accelerate_num_processes", "torch_world_size", "deepspeed_world_size")
        ),
        "ranks distinct": len({r["torch_rank"] for r in reports}) == len(reports),
        "data split (disjoint, complete)": sorted(all_idx) == list(range(r0["dataset_size"])),
        "params/rank": f"{r0['param_numel_local']:,}/{r0['param_numel_full']:,}",
        "Adam exp_avg/rank": f"{r0.get('optimizer_state_numel_by_key', {}).get('exp_avg', 0):,}" + (f" on {','.join(r0['optimizer_state_devices'])}" if r0.get("optimizer_state_devices") else ""),
        "optimizer": r0.get("base_optimizer_class", "AdamW (DDP)"),
        "precision": r0.get("precision", "-"),
        "final loss": round(r0["losses"][-1], 4),
    }
    if reference:
        diffs = [abs(a - b) for a, b in zip(r0["losses"], reference[0]["losses"])]
        row["max |Δloss| vs 1 process"] = f"{max(diffs):.2e}"
    return row


def print_table(rows: list[dict]) -> None:
    if not rows:
        return
    keys = list(dict.fromkeys(k for r in rows for k in r))
    widths = {k: max(len(k), *(len(str(r.get(k, ""))) for r in rows)) for k in keys}
    print("  ".join(k.ljust(widths[k]) for k in keys))
    for r in rows:
        print("  ".join(str(r.get(k, "")).ljust(widths[k]) for k in keys))
