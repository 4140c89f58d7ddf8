"""`hfscale eval`: held-out perplexity of one or more models and top-1 agreement with the first."""

from __future__ import annotations

import json

EPILOG = """examples:
  hfscale eval runs/tiny/model q_8da4w runs/qat/quantized          # the first model is the reference
  hfscale eval runs/tiny/model q_int4 --data my.jsonl --validation held.jsonl --blocks 256 --json
"""


EXPORTED = {".gguf": "a GGUF file (llama.cpp)", ".pte": "an ExecuTorch program (.pte)"}


def add_parser(sub):
    import argparse

    p = sub.add_parser("eval", help="perplexity and top-1 agreement of models on a held-out split",
                       description="Score each model on the same held-out tokens: perplexity, and the share of "
                       "positions whose top-1 prediction equals the first model's.", epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="+", help="built-in name, transformers dir (quantized ones too) or hub name")
    p.add_argument("--data", default="builtin", help="builtin or a .txt/.jsonl/.parquet file (its held-out split is scored)")
    p.add_argument("--validation", help="a separate held-out file")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--blocks", type=int, default=64, help="held-out sequences of --seq-len tokens")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(run=run)


def run(args) -> int:
    from pathlib import Path

    from ..compress.evaluate import EvalData, evaluate_models, rows_table
    from ..util.errors import HfscaleError
    from ..models.builtin import load_config

    ed = EvalData(args.data, args.validation, args.seq_len, args.blocks, args.batch_size)
    for m in args.models:  # an unknown model fails in one line before any scoring
        if Path(m).suffix in EXPORTED and Path(m).is_file():
            raise HfscaleError(f"{m} is {EXPORTED[Path(m).suffix]}: hfscale eval scores transformers directories and "
                               f"built-in names; an exported file is checked in its runtime when it is written "
                               f"(perplexity, top-1 vs transformers: {m}.json), or pass the directory it was exported from")
        load_config(m)
    rows = evaluate_models(args.models, ed, progress=not args.json)
    if args.json:
        print(json.dumps({"data": args.data, "seq_len": ed.seq_len, "blocks": ed.n_blocks, "rows": rows}, indent=1))
    else:
        print(rows_table(rows))
    return 0
