"""`hfscale profile`: measure the memory timeline of real training steps per rank, beside the plan's prediction."""

from __future__ import annotations

import json

EPILOG = """examples:
  hfscale profile --out prof                                   # tiny Gemma, 1 process, 3 steps
  hfscale profile --config accelerate_configs/zero2.yaml --num-processes 2 --seq-len 256 --out prof_z2
  hfscale profile --model path/to/model_dir --checkpointing full --micro-batch 4 --out prof --force

writes DIR/profile.json (per rank: timeline samples, phase peaks of every step, measured peak / peak_step1,
and the plan's traced prediction for the same run) and DIR/timeline.png; on CUDA also
DIR/ranks/rank{R}_cuda_snapshot.pickle for https://pytorch.org/memory_viz.
exit codes: 0 written, 2 bad input (one line, nothing written)
"""


def add_parser(sub):
    import argparse

    from ..scale.adapters import KINDS as ADAPTER_KINDS
    from ..scale.optim import ADAMW, DEFAULT_ADAMW
    from ..util.hosts import PRECISION_CHOICES

    p = sub.add_parser("profile", help="measure memory over real training steps (per rank, by kind and phase)",
                       description="Run N real training steps of a model (built-in tiny Gemma by default) in this process "
                       "or under `accelerate launch --config_file CONFIG`, record with torch's MemTracker the bytes alive "
                       "by kind (parameters, gradients, optimizer states, activations, temporaries) after every op, "
                       "per rank, and compare the steady and step-1 peaks with `hfscale plan`'s traced prediction.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-gemma3", help="built-in name, config.json or model dir (default: %(default)s)")
    p.add_argument("--config", help="accelerate YAML to launch under (default: this process, no launcher)")
    p.add_argument("--num-processes", type=int, default=2, help="processes for --config (default: %(default)s)")
    p.add_argument("--steps", type=int, default=3, help="training steps; the last is reported as the steady one, so >= 3 (step 2 can hold one-time work such as DDP's bucket rebuild; default: %(default)s)")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--checkpointing", default="off", help="off | full | every:K")
    p.add_argument("--adamw", default=DEFAULT_ADAMW, choices=ADAMW,
                   help="torch AdamW's implementation (default %(default)s: what the recipes build and the plan assumes)")
    p.add_argument("--precision", default="auto", choices=PRECISION_CHOICES,
                   help="auto (default): the launch's precision, fp32 where this host emulates bf16; launch / bf16 / fp16 / fp32")
    p.add_argument("--adapter", default="none", choices=list(ADAPTER_KINDS),
                   help="train an adapter on the frozen base as the recipe does (qlora: NF4 base through bitsandbytes)")
    p.add_argument("--lora-rank", type=int, default=16, help="adapter rank (default: %(default)s)")
    p.add_argument("--no-predict", action="store_true", help="skip the plan's traced prediction")
    p.add_argument("--out", required=True, help="output directory (written whole, atomically)")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    p.add_argument("--json", action="store_true", help="print the per-rank summary as JSON")
    p.set_defaults(run=run)


def _check(args):
    from pathlib import Path

    from ..scale.checkpointing import parse_checkpointing
    from ..util.errors import HfscaleError
    from ..models.builtin import load_config

    for flag in ("steps", "micro_batch", "seq_len", "num_processes", "lora_rank"):
        if getattr(args, flag) < 1:
            raise HfscaleError(f"--{flag.replace('_', '-')} must be >= 1 (got {getattr(args, flag)})")
    if args.config and not Path(args.config).is_file():
        raise HfscaleError(f"accelerate config {args.config} not found; write one with `hfscale config`")
    from ..util.extras import require, uses_deepspeed

    if args.config and uses_deepspeed(args.config):
        require(f"hfscale profile --config {args.config} (DeepSpeed)", "deepspeed")
    parse_checkpointing(args.checkpointing)
    config = load_config(args.model)
    if getattr(config, "vocab_size", None) is None:
        raise HfscaleError(f"{args.model} is not a causal LM config (no vocab_size)")
    return config


def run(args) -> int:
    from pathlib import Path

    from ..util.atomic import begin_stage, check_writable, commit, discard
    from ..plan.profiler import write_report
    from ..proofs.profile import main as worker
    from ..proofs.engine import launch

    config = _check(args)
    out = Path(args.out)
    check_writable({out: "--out"}, args.force, inputs={args.model: "--model", **({args.config: "--config"} if args.config else {})})
    extra = ["--model", args.model, "--steps", str(args.steps), "--micro-batch", str(args.micro_batch),
             "--seq-len", str(args.seq_len), "--checkpointing", args.checkpointing, "--adamw", args.adamw,
             "--adapter", args.adapter, "--lora-rank", str(args.lora_rank)]
    stage = begin_stage(out, directory=True)
    try:
        if args.config:
            reports = launch(args.config, stage / "ranks", args.num_processes, extra, precision=args.precision,
                             module="hfscale.proofs.profile")
        else:
            worker(["--out", str(stage / "ranks"), "--precision", args.precision, *extra])
            reports = [json.loads((stage / "ranks" / "rank0.json").read_text())]
        name = Path(args.config).stem if args.config else "1 process"
        rows = write_report(stage, reports, None if args.no_predict else config,
                            f"{args.model}, {name}, micro batch {args.micro_batch} x {args.seq_len}, "
                            f"{reports[0]['precision']}, checkpointing {args.checkpointing}, AdamW {reports[0]['adamw']}")
        commit(stage, out)
    except BaseException:
        discard(stage)
        raise
    if args.json:
        print(json.dumps(rows))
        return 0
    for row in rows:
        m, p = row["measured"], row.get("predicted")
        line = (f"rank {row['rank']}/{row['world']} {row['engine']} zero {row['zero']} {row['precision']} AdamW {row['adamw']}: "
                f"steady peak {m['peak'] / 2**20:.2f} MiB in {m['peak_phase']}, step 1 {m['peak_step1'] / 2**20:.2f} MiB")
        if p:
            host = f" + {p['offloaded_per_rank'] / 2**20:.2f} MiB offloaded" if row["compared"] != "device" else ""
            p = {"peak": p["peak"], "peak_step1": row["compared_peak_step1"]}
            line += (f"; plan predicts {p['peak'] / 2**20:.2f} MiB{host} ({row['error']['peak']:+.2%}), "
                     f"step 1 {p['peak_step1'] / 2**20:.2f} MiB ({row['error']['peak_step1']:+.2%})")
        print(line)
    print(f"wrote {out}/profile.json and {out}/timeline.png")
    return 0
