"""`hfscale prune`: structured pruning (layers, MLP channels, heads / KV groups, hidden size) to a
smaller transformers directory that `from_pretrained` loads without hfscale (hfscale.compress.prune)."""

from __future__ import annotations

EPILOG = """examples:
  hfscale prune runs/tiny/model --out runs/tiny_half --params 0.5x            # hidden + MLP width, ~half the parameters
  hfscale prune runs/tiny/model --out runs/tiny_3l --layers 3 --heads 2        # drop the least important layer, half the heads
  hfscale prune runs/tiny/model --out runs/tiny_d --layers 2 --layer-metric loss --calib my.txt

Importance comes from calibration text (--calib builtin: the built-in corpus's train split): MLP
channels, heads and hidden channels by activation magnitude (Minitron), layers by block influence
(ShortGPT) or the loss increase when skipped. Distill the result from the unpruned model with
recipes/distill_clm.py. The output is reloaded with from_pretrained and compared before it is reported.

exit codes: 0 written; 2 bad input (one line naming the fix; nothing written)
"""


def add_parser(sub):
    import argparse

    from ..compress.prune import LAYER_METRICS, SUPPORTED

    p = sub.add_parser("prune", help="structured pruning to a smaller transformers directory",
                       description="Prune a decoder LM (" + "; ".join(SUPPORTED.values()) + ") to fewer layers, MLP "
                       "channels, attention heads / KV groups or hidden channels, chosen by importance measured on "
                       "calibration text, and write a smaller transformers directory.", epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="built-in name (tiny-gemma3), transformers directory, or hub name")
    p.add_argument("--out", required=True, help="output directory (never the MODEL itself, inside it or around it)")
    p.add_argument("--params", help="target fraction of the parameter count, e.g. 0.5x (hidden and MLP width shrink)")
    p.add_argument("--layers", type=int, help="decoder layers to keep")
    p.add_argument("--intermediate-size", type=int, help="MLP channels to keep per layer")
    p.add_argument("--heads", type=int, help="query heads to keep (a multiple of the KV heads, or of the group size)")
    p.add_argument("--hidden-size", type=int, help="hidden (embedding) channels to keep")
    p.add_argument("--layer-metric", choices=LAYER_METRICS, default="bi",
                   help="bi: block influence 1 - cos(in, out) (ShortGPT); loss: loss increase when the layer is skipped")
    p.add_argument("--calib", default="builtin", help="calibration text: builtin or a .txt/.jsonl/.parquet file")
    p.add_argument("--calib-blocks", type=int, default=32, help="calibration sequences of --seq-len tokens")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(run=run)


def run(args) -> int:
    import json
    from pathlib import Path

    import torch

    from ..util.atomic import check_writable
    from ..compress.evaluate import calibration_blocks
    from ..compress.prune import PruneTarget, check_supported, describe, parse_fraction, prune
    from ..compress.save import save_model_dir
    from ..util.errors import HfscaleError
    from ..models.builtin import build_model, has_tokenizer, load_config, load_tokenizer

    target = PruneTarget(params=parse_fraction(args.params) if args.params is not None else None, layers=args.layers,
                         intermediate_size=args.intermediate_size, heads=args.heads, hidden_size=args.hidden_size,
                         layer_metric=args.layer_metric)
    if min(args.calib_blocks, args.seq_len) < 1:
        raise HfscaleError("--calib-blocks and --seq-len must be >= 1")
    check_writable({args.out: "--out"}, args.force, inputs={args.model: "MODEL", args.calib: "--calib"})
    if args.calib != "builtin" and not Path(args.calib).is_file():
        raise HfscaleError(f"calibration file {args.calib} not found; pass 'builtin' or an existing .txt/.jsonl/.parquet file")
    check_supported(load_config(args.model))  # unknown or unsupported model: one line before any work
    if not has_tokenizer(args.model):
        raise HfscaleError(f"{args.model} has no tokenizer files; calibration text needs one (copy the tokenizer "
                           "files of the model it came from into it)")
    tok = load_tokenizer(args.model)
    calib = calibration_blocks(tok, args.calib_blocks, args.seq_len, data=args.calib)
    model = build_model(args.model, dtype=torch.float32).eval()
    small, result = prune(model, target, calib)
    save_model_dir(small, args.out, tokenizer=tok, force=args.force, extra_files={"hfscale_prune.json": result.to_json()})
    # what was written is what a user loads: reload without hfscale's help and compare logits
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(args.out, use_safetensors=True).eval()
    with torch.no_grad():
        diff = float((back(input_ids=calib[:2]).logits - small(input_ids=calib[:2]).logits).abs().max())
    if args.json:
        print(json.dumps({**json.loads(result.to_json()), "out": str(args.out), "reload_max_abs_dlogit": diff}))
    else:
        print(f"wrote {args.out}: {describe(result)}")
        print(f"  importance from {result.calibration_tokens:,} calibration tokens; layer {result.layer_metric} scores "
              + ", ".join(f"{s:.4f}" for s in result.layer_scores)
              + f"; reloaded with from_pretrained: max |dlogit| {diff:.2e}")
    return 0
