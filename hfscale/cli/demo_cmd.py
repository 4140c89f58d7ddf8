"""`hfscale demo`: the main job on the embedded default (see README)."""

from __future__ import annotations


def add_parser(sub):
    p = sub.add_parser("demo", help="write a config set and prove ZeRO training of the tiny model on 2 processes")
    p.add_argument("--out", default="demo_out")
    p.set_defaults(run=run)


def run(args) -> int:
    from ..proofs.demo import run_demo
    from ..util.extras import require

    for extra in ("deepspeed", "quant", "edge"):  # it proves ZeRO, QAT-trains and exports
        require("hfscale demo", extra)

    return run_demo(args.out)
