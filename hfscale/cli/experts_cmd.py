"""`hfscale experts`: generate or score text with an MoE model whose routed experts stay on disk, read
into an LRU cache bounded by --ram-budget (hfscale/experts)."""

from __future__ import annotations

import json

EPILOG = """exit codes: 0 done; 2 bad input (not an MoE model, a budget below one layer's top-k experts, a missing
or unreadable model directory, an expert file that fails or outlasts --read-timeout), one line on stderr.

examples:
  hfscale experts path/to/gemma4-moe --ram-budget 2GB --prompt "The history of" --max-new-tokens 32
  hfscale experts path/to/gemma4-moe --ram-budget 300MB --prefetch --blocks 8 --json   # held-out perplexity
  hfscale experts path/to/gemma4-moe --ram-budget 300MB --reader mmap --read-timeout 30 --prompt "Hi"
"""


def add_parser(sub):
    import argparse

    from ..experts import READERS

    p = sub.add_parser("experts", help="run an MoE model with its experts on disk under a RAM budget",
                       description="Load a transformers MoE model (Gemma 4 26B-A4B style, Mixtral, Qwen-MoE) from a "
                       "local safetensors directory with its routed experts left on disk; the experts routing asks "
                       "for are read into an LRU cache of at most --ram-budget bytes. Generates from --prompt, or "
                       "scores held-out perplexity; prints cache statistics and peak RSS.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="local transformers directory with safetensors")
    p.add_argument("--ram-budget", required=True, help="bytes for cached experts, e.g. 2GB or 512MiB")
    p.add_argument("--prompt", help="generate greedily from this text (default: score held-out perplexity)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--blocks", type=int, default=8, help="held-out sequences to score (without --prompt)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--prefetch", action="store_true", help="read the next layer's likely experts ahead (its router "
                   "applied to the current layer's output)")
    p.add_argument("--reader", default="pread", choices=READERS, help="pread (default: copies each expert; a file "
                   "truncated at any time is a clean error) or mmap (maps each expert in place, no copy, unmapped on "
                   "eviction; a file truncated while mapped kills the process with SIGBUS)")
    p.add_argument("--read-timeout", type=float, default=None, metavar="S", help="give up with an error when reading "
                   "one expert takes longer than S seconds (default: wait)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def run(args) -> int:
    import time

    import torch

    from ..util.errors import HfscaleError
    from ..experts import from_pretrained
    from ..models.builtin import load_tokenizer

    if args.max_new_tokens < 1 or args.blocks < 1 or args.seq_len < 2:
        raise HfscaleError("--max-new-tokens and --blocks must be >= 1, --seq-len >= 2")
    if args.read_timeout is not None and not 0 < args.read_timeout < 1e6:
        raise HfscaleError(f"--read-timeout must be a positive number of seconds (got {args.read_timeout})")
    tok = load_tokenizer(args.model)
    model = from_pretrained(args.model, ram_budget=args.ram_budget, prefetch=args.prefetch, reader=args.reader,
                            read_timeout_s=args.read_timeout)
    off = model.hfscale_experts
    out: dict = {"model": args.model, "ram_budget": off.budget, "reader": args.reader, "prefetch": args.prefetch}
    t0 = time.perf_counter()
    with torch.no_grad():
        if args.prompt is not None:
            ids = tok(args.prompt, return_tensors="pt").input_ids
            gen = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
            new = gen.shape[1] - ids.shape[1]
            out["text"] = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
            out["tokens"] = new
        else:
            from ..compress.evaluate import EvalData, heldout_blocks, score

            blocks = heldout_blocks(tok, EvalData(seq_len=args.seq_len, n_blocks=args.blocks))
            nll, n, _ = score(model, blocks, batch_size=1)
            import math

            out["perplexity"] = math.exp(nll / n)
            out["tokens"] = int(blocks.numel())
    secs = time.perf_counter() - t0
    out["seconds"] = round(secs, 3)
    out["tokens_per_s"] = round(out["tokens"] / secs, 2)
    out["cache"] = off.stats()
    out["peak_rss_bytes"] = peak_rss_bytes()
    off.close()
    if args.json:
        print(json.dumps(out))
        return 0
    if "text" in out:
        print(out["text"])
    else:
        print(f"perplexity {out['perplexity']:.3f} over {out['tokens']} tokens")
    c = out["cache"]
    print(f"{out['tokens']} tokens in {secs:.2f} s ({out['tokens_per_s']} tok/s); cache {c['cache_experts']} experts "
          f"({off.budget / 1e6:.1f} MB) of {c['streamed_bytes'] / 1e6:.1f} MB on disk: hit rate {c['hit_rate']:.3f}, "
          f"read {c['bytes_read'] / 1e6:.1f} MB ({c['bytes_read'] / max(out['tokens'], 1) / 1e6:.2f} MB/token)"
          + (f", read-ahead used {c['prefetch_hits']}/{c['prefetched']}" if args.prefetch else "")
          + f"; peak RSS {out['peak_rss_bytes'] / 1e6:.0f} MB")
    return 0
