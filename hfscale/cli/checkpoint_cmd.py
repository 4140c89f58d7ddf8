"""`hfscale checkpoint info|export`: read a recipe checkpoint (DDP, DeepSpeed ZeRO-1/2/3) without an engine."""

from __future__ import annotations


def add_parser(sub):
    import argparse

    p = sub.add_parser("checkpoint", help="what a training checkpoint holds; export it as a transformers directory",
                       description="Inspect or export a recipe checkpoint (OUTPUT_DIR/checkpoints/step_N). export writes "
                       "fp32 weights as sharded safetensors, tensor by tensor in bounded memory (no engine, no GPU).",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="examples:\n  hfscale checkpoint info runs/tiny/checkpoints/step_00000060\n"
                       "  hfscale checkpoint export runs/tiny/checkpoints/step_00000060 --out tiny_fp32 --shard-size 2GB")
    verbs = p.add_subparsers(dest="verb", required=True, parser_class=type(p))
    i = verbs.add_parser("info", help="engine, ZeRO stage, ranks, step, tokens seen, precision, manifest check")
    i.add_argument("ckpt", help="a checkpoint directory")
    e = verbs.add_parser("export", help="a transformers directory (config.json, fp32 safetensors shards, index)")
    e.add_argument("ckpt", help="a checkpoint directory")
    e.add_argument("--out", required=True, help="directory to write (staged, renamed into place)")
    e.add_argument("--shard-size", default="2GB", help="largest shard file (default: %(default)s)")
    e.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.set_defaults(run=run)


def run(args) -> int:
    from ..export.ckpt_export import export, info, parse_size

    if args.verb == "info":
        for line in info(args.ckpt).lines():
            print(line)
        return 0
    res = export(args.ckpt, args.out, parse_size(args.shard_size), force=args.force)
    print(f"wrote {res.out}: {res.tensors} tensors in {res.shards} safetensors shard{'s' if res.shards != 1 else ''}, "
          f"{res.bytes / 1e6:,.1f} MB (fp32)")
    return 0
