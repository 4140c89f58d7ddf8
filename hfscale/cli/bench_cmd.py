"""`hfscale bench`: prefill / decode speed, time to first token, peak RSS and size of a GGUF (llama.cpp),
an ExecuTorch .pte (executorch.runtime) or a transformers directory (the reference), each run in its
own process (hfscale.export.bench)."""

from __future__ import annotations

EPILOG = """examples:
  hfscale bench model-Q4_0.gguf                                  # 3 runs, 1024-token prompt, 256 decoded tokens
  hfscale bench teacher-F16.gguf --compare student-Q4_0.gguf     # ratios B / A measured in the same invocation
  hfscale bench model.pte --prompt-tokens 64 --decode-tokens 32 --threads 2 --json
  hfscale bench runs/tiny/model --runs 5                          # transformers (fp32 eager) as the reference

Speeds are medians over --runs fresh processes (min-max shown); A and B runs alternate. A .pte
generates one token per call, so its prefill is that many single-token steps (said in the output).
exit codes: 0 measured; 2 bad input (one line naming the fix)
"""


def add_parser(sub):
    import argparse

    p = sub.add_parser("bench", help="prefill/decode tokens/s, time to first token, peak RSS of a .gguf/.pte/transformers dir",
                       description="Measure an artifact in its own runtime: prefill tokens/s over a --prompt-tokens "
                       "prompt, decode tokens/s over --decode-tokens greedy steps, time to first token, peak RSS of "
                       "the run's process, file bytes, with the thread count stated.", epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifact", help=".gguf file, .pte file or transformers directory (A)")
    p.add_argument("--compare", metavar="B", help="a second artifact: both measured in this invocation, ratios B / A")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--runs", type=int, default=3, help="fresh processes per artifact (median and min-max reported)")
    p.add_argument("--threads", type=int, default=0, help="threads for the runtime (default: the cores available)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


RUNTIME_MODULES = {"gguf": ("llama_cpp",), "pte": ("executorch",)}  # what runs each artifact (hfscale[edge])


def run(args) -> int:
    import json

    from ..export.bench import BenchSpec, artifact_kind, bench, host_info, ratio_table, ratios, table

    spec = BenchSpec(args.prompt_tokens, args.decode_tokens, args.runs, args.threads)
    paths = [args.artifact] + ([args.compare] if args.compare else [])
    from ..util.extras import require

    for p in paths:
        kind = artifact_kind(p)  # a missing or unknown artifact: one line before any run
        if kind in RUNTIME_MODULES:
            require(f"hfscale bench {p} ({kind})", "edge", RUNTIME_MODULES[kind])
    results = bench(paths, spec, progress=not args.json)
    host = host_info(spec.n_threads)
    if args.json:
        if len(results) == 1:
            out = {**results[0].to_dict(), "host": host}
        else:
            out = {"a": results[0].to_dict(), "b": results[1].to_dict(), "ratios_b_over_a": ratios(*results), "host": host}
        print(json.dumps(out))
        return 0
    print(f"host: {host['cpu']} ({host['cpu_capability']}, bf16 {host['bf16']}), {spec.n_threads} threads; "
          f"prompt {spec.prompt_tokens} tokens, decode {spec.decode_tokens} tokens")
    print(table(results))
    for r in results:
        if r.kind == "pte":
            print(f"{r.artifact}: prefill is {spec.prompt_tokens} single-token steps ({r.prefill_mode})")
    if len(results) == 2:
        print(ratio_table(*results))
    return 0
