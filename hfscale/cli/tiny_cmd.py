"""`hfscale tiny`: save the built-in tiny Gemma 3 (config, seeded weights, tokenizer) in transformers format."""

from __future__ import annotations


def add_parser(sub):
    p = sub.add_parser(
        "tiny",
        help="save the built-in tiny Gemma 3 as a transformers directory",
        description="Save the built-in tiny Gemma-3-architecture model (seeded random weights, safetensors) "
        "and its tokenizer as a directory that AutoModelForCausalLM / AutoTokenizer load offline.",
        epilog="example:\n  hfscale tiny --out tiny_model && python -c \"import transformers as t; t.AutoModelForCausalLM.from_pretrained('tiny_model')\"",
    )
    p.add_argument("--out", required=True, help="directory to write (missing parent directories are created)")
    p.add_argument("--seed", type=int, default=0, help="0 <= seed < 2**63 (default: %(default)s)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.set_defaults(run=run)


def run(args) -> int:
    from pathlib import Path

    from ..util.atomic import check_writable, staged
    from ..util.errors import HfscaleError
    from ..models.builtin import TINY, save_pretrained_dir

    if not 0 <= args.seed < 2**63:  # torch.manual_seed takes a 64-bit integer
        raise HfscaleError(f"--seed {args.seed} is out of range; give an integer from 0 to {2**63 - 1}")

    out = Path(args.out)
    check_writable({out: "--out"}, args.force)
    with staged(out, directory=True) as tmp:  # the directory appears whole or not at all
        save_pretrained_dir(TINY, tmp, seed=args.seed)
    n = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({n / 1e6:.1f} MB): {', '.join(sorted(f.name for f in out.iterdir()))}")
    return 0
