"""`hfscale data prepare|info`: tokenize once into a token store every rank memory-maps; say what a store holds."""

from __future__ import annotations

EPILOG = """examples:
  hfscale data prepare --data chat.jsonl --model tiny-gemma3 --seq-len 512 --out chat_store
  hfscale data prepare --data 'web/*.parquet:0.8,chat.jsonl:0.2' --model google/gemma-3-1b-it --seq-len 4096 \\
      --train-on assistant --packing bfd --out mix_store
  torchrun --nproc_per_node 8 -m hfscale data prepare ...     # every process tokenizes a share (RANK / WORLD_SIZE)
  hfscale data info chat_store --verify
"""


def add_parser(sub):
    import argparse

    from ..data.formats import FORMATS, TRAIN_ON
    from ..data.packing import PACKING
    from ..data.store import OVERFLOW

    p = sub.add_parser("data", help="tokenize data once into a store every rank memory-maps; inspect a store",
                       description="prepare: read .jsonl/.json/.parquet/.arrow/.txt files (globs, directories, 'builtin', "
                       "mixtures 'a:0.7,b:0.3'), render chats with the tokenizer's template, compute loss masks, pack, and "
                       "write a content-addressed token store (staged, renamed). info: what a store holds.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = p.add_subparsers(dest="verb", required=True, parser_class=type(p))
    pr = verbs.add_parser("prepare", help="tokenize, mask and pack into a token store")
    pr.add_argument("--data", required=True, help="file, glob, directory, 'builtin', hub name, or 'a:w1,b:w2'")
    pr.add_argument("--model", required=True, help="whose tokenizer: built-in name, transformers dir or hub name")
    pr.add_argument("--seq-len", type=int, required=True, help="tokens per packed row")
    pr.add_argument("--out", required=True, help="the store directory (staged, renamed into place)")
    pr.add_argument("--format", choices=list(FORMATS), help="default: detected from the columns")
    pr.add_argument("--train-on", choices=list(TRAIN_ON), help="which tokens train; default: the format's ("
                    + "; ".join(f"{k}: {v}" for k, v in TRAIN_ON.items()) + ")")
    pr.add_argument("--packing", choices=list(PACKING), help="default: wrapped for text, bfd otherwise")
    pr.add_argument("--overflow", choices=list(OVERFLOW), help="examples longer than --seq-len; default: split for "
                    "text, truncate otherwise")
    pr.add_argument("--validation", help="a held-out file (default: --heldout of the examples, by content hash)")
    pr.add_argument("--heldout", type=float, default=0.05, help="share held out when no --validation (default %(default)s)")
    pr.add_argument("--rank", type=int, help="this process's share (default: $RANK or 0)")
    pr.add_argument("--world", type=int, help="processes sharing the work (default: $WORLD_SIZE or 1)")
    pr.add_argument("--force", action="store_true", help="replace a store of other data at --out")
    i = verbs.add_parser("info", help="options, counts, trained share, packing efficiency, bytes per token")
    i.add_argument("store", help="a store directory")
    i.add_argument("--verify", action="store_true", help="also check every file's content hash")
    p.set_defaults(run=run)


def run(args) -> int:
    import os

    from ..data.store import DataOptions, open_info, prepare

    if args.verb == "info":
        info = open_info(args.store, full=args.verify)
    else:
        opts = DataOptions(args.seq_len, args.format, args.train_on, args.packing, args.overflow, args.validation,
                           args.heldout)
        rank = args.rank if args.rank is not None else int(os.environ.get("RANK", "0"))
        world = args.world if args.world is not None else int(os.environ.get("WORLD_SIZE", "1"))
        info = prepare(args.data, args.model, opts, args.out, rank=rank, world=world, force=args.force)
        if rank != 0:
            return 0
        print(("reused " if info.reused else "wrote ") + info.lines()[0])
        for line in info.lines()[1:]:
            print(line)
        return 0
    for line in info.lines():
        print(line)
    return 0
