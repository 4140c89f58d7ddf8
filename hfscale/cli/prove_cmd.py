"""`hfscale prove`: run a short training under an accelerate config and show what each rank held."""

from __future__ import annotations

import json


def add_parser(sub):
    p = sub.add_parser(
        "prove",
        help="prove an accelerate config on this host with a short real training",
        description="Launch a short training of a model under `accelerate launch --config_file CONFIG` "
        "and report, from inside the ranks, world size, data split, parameter / optimizer-state sharding "
        "and the loss; optionally compare the loss with a 1-process run of the same global batch.",
        epilog="examples:\n  hfscale prove --config accelerate_configs/zero3.yaml --num-processes 2 --reference\n"
        "  hfscale prove --config accelerate_configs/multinode_zero3.yaml --num-processes 2 --num-machines 2",
    )
    p.add_argument("--config", required=True, help="accelerate YAML")
    p.add_argument("--num-processes", type=int, default=2)
    p.add_argument("--num-machines", type=int, default=1, help="simulate N machines on this host (one launcher each)")
    p.add_argument("--model", default="tiny-gemma3")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--reference", action="store_true", help="also run 1 process and compare losses")
    p.add_argument("--out", default="proof_out", help="directory for rank reports and logs, created if missing; "
                   "its ranks/ and reference/ are replaced (default: %(default)s)")
    from ..util.hosts import PRECISION_CHOICES

    p.add_argument("--precision", default="launch", choices=PRECISION_CHOICES,
                   help="launch (default): the config's precision; auto: the same, but fp32 where this host emulates "
                   "bf16; bf16 / fp16 / fp32: force it")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run)


def run(args) -> int:
    from pathlib import Path

    from ..util.atomic import check_overlap, check_parents
    from ..util.errors import HfscaleError
    from ..proofs.engine import launch, print_table, summarize

    if not Path(args.config).is_file():
        raise HfscaleError(f"accelerate config {args.config} not found; write one with `hfscale config`")
    if args.num_processes < 1 or args.num_machines < 1 or args.num_processes % args.num_machines:
        raise HfscaleError("--num-processes must be a positive multiple of --num-machines")
    from ..util.extras import require, uses_deepspeed

    if uses_deepspeed(args.config):
        require(f"hfscale prove --config {args.config} (DeepSpeed)", "deepspeed")
    extra = ["--model", args.model, "--steps", str(args.steps)]
    out = Path(args.out)
    written = {out / "ranks": "--out", out / "reference": "--out"}  # what a proof replaces under --out
    check_overlap(written, inputs={args.config: "--config", args.model: "--model"})
    check_parents(written)
    reports = launch(args.config, out / "ranks", args.num_processes, extra, num_machines=args.num_machines,
                     precision=args.precision)
    ref = launch(args.config, out / "reference", 1, extra, precision=args.precision) if args.reference else None
    row = summarize(Path(args.config).stem, reports, ref)
    if args.json:
        print(json.dumps(row))
    else:
        print_table([row])
    ok = row["ranks distinct"] and row["data split (disjoint, complete)"]
    return 0 if ok else 1
