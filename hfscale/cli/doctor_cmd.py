"""`hfscale doctor`: pre-flight checks. Exit 0 clean (warnings allowed), 1 on an error finding, 2 on unreadable input."""

from __future__ import annotations

import json


def add_parser(sub):
    from ..scale.optim import ADAMW

    p = sub.add_parser(
        "doctor",
        help="check accelerate / DeepSpeed / TrainingArguments / model for mistakes before launching",
        description="Static pre-flight checks across the files of a training job, in one pass.",
        epilog="examples:\n  hfscale doctor --accelerate accelerate_configs/zero3.yaml\n"
        "  hfscale doctor --accelerate a.yaml --deepspeed d.json --args recipe.yaml --model gemma3_config.json --json\n"
        "  hfscale doctor --deepspeed d.json --num-processes 16 --num-machines 2 --gpus-per-machine 8",
    )
    p.add_argument("--accelerate", help="accelerate YAML (its deepspeed_config_file is followed)")
    p.add_argument("--deepspeed", help="DeepSpeed JSON")
    p.add_argument("--args", help="TrainingArguments / recipe YAML or JSON")
    p.add_argument("--model", help="config.json path, model directory, built-in name or hub name")
    p.add_argument("--num-processes", type=int)
    p.add_argument("--num-machines", type=int)
    p.add_argument("--gpus-per-machine", type=int)
    p.add_argument("--adamw", default="fused", choices=ADAMW,
                   help="the AdamW implementation the plan assumed (hfscale plan --adamw; default %(default)s): a "
                   "Trainer optim, DeepSpeed optimizer or recipe adamw running another is a warning")
    p.add_argument("--json", action="store_true", help="print the findings as a JSON list")
    p.add_argument("--max-findings", type=int, default=50,
                   help="list at most this many findings, then count the rest (0: all; default: %(default)s)")
    p.set_defaults(run=run)


def run(args) -> int:
    from ..doctor import check, render_table
    from ..doctor.findings import more_line
    from ..util.errors import HfscaleError

    if args.max_findings < 0:
        raise HfscaleError(f"--max-findings must be 0 (all) or more (got {args.max_findings})")
    if not any((args.accelerate, args.deepspeed, args.args, args.model)):
        raise HfscaleError("give at least one of --accelerate, --deepspeed, --args, --model")
    # libraries imported by the checks (DeepSpeed) log to stdout; keep stdout for the report alone
    import os
    import sys

    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        import torch

        from ..util.hosts import bf16_support

        # a launch from this GPU-less host runs on its CPU: warn where that CPU emulates bf16
        cpu_launch = not torch.cuda.is_available()
        findings = check(args.accelerate, args.deepspeed, args.args, args.model, args.num_processes, args.num_machines,
                         args.gpus_per_machine, host_bf16=bf16_support("cpu") if cpu_launch else None,
                         cpu_launch=cpu_launch, planned_adamw=args.adamw)
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
    limit = args.max_findings or None
    if args.json:  # stdout stays one JSON list; the count of the rest goes to stderr
        print(json.dumps([f.to_dict() for f in findings[:limit]], indent=1))
        if limit is not None and len(findings) > limit:
            print(more_line(len(findings) - limit), file=sys.stderr)
    else:
        print(render_table(findings, limit))
    return 1 if any(f.severity == "error" for f in findings) else 0
