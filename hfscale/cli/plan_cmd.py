"""`hfscale plan`: predict per-GPU memory for a model and strategy; with hardware, rank strategies and pick one."""

from __future__ import annotations

import json

from ..plan.kernels import KERNELS

EPILOG = """examples:
  hfscale plan --model gemma-3-27b --seq-len 4096 --micro-batch 1 --zero 3 --dp 16 --checkpointing full
  hfscale plan --model gemma-3-12b --seq-len 4096 --micro-batch 1 --gpus-per-node 8 --nodes 2 --gpu-mem 80GB \\
               --global-batch-tokens 1048576 --plot plan.png --write plan_cfg
  hfscale plan --model path/to/config.json --seq-len 2048 --micro-batch 4 --json
  hfscale plan --model gemma-3-27b --seq-len 131072 --micro-batch 1 --gpus-per-node 8 --gpu-mem 80GB --write long/
  hfscale plan --model gemma-3-27b --seq-len 131072 --micro-batch 1 --zero 3 --sp 8 --checkpointing full

exit codes: 0 prediction (or a fitting pick), 1 nothing fits (says by how much), 2 invalid input (one line)
"""


def add_parser(sub):
    import argparse

    from ..plan.memory import OPTIMIZER_STATE_BYTES, QUANT_BYTES_PER_PARAM
    from ..scale.spec import DEVICES, ZERO_STAGES

    p = sub.add_parser("plan", help="predict training memory and pick the cheapest strategy that fits",
                       description="Predict per-GPU memory (weights, gradients, optimizer, activations) from a model's "
                       "config alone, and with hardware given, rank strategies and pick the cheapest that fits.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="built-in name (tiny-gemma3, gemma-3-270m..27b, gemma-4-e2b/e4b/31b/26b-a4b), config.json, model dir or hub name")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--micro-batch", type=int, required=True)
    p.add_argument("--checkpointing", default="off", help="off | full | every:K")
    p.add_argument("--zero", type=int, default=0, choices=ZERO_STAGES)
    p.add_argument("--offload", default="none", choices=DEVICES)
    p.add_argument("--dp", type=int, default=None, help="data-parallel ranks (default: all GPUs given, else 1)")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--optimizer", default="adamw", choices=list(OPTIMIZER_STATE_BYTES))
    p.add_argument("--attention", default="sdpa", choices=["sdpa", "eager"], help="sdpa/flash (default) or eager")
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA rank (peft, all decoder linears); 0 = full fine-tuning")
    p.add_argument("--base-bits", type=int, default=16, choices=[16, 4], help="4 = QLoRA (NF4 base)")
    p.add_argument("--inference", action="store_true", help="also predict serving memory: weights at --quant + KV cache")
    p.add_argument("--quant", choices=list(QUANT_BYTES_PER_PARAM), help="inference weights (default: bf16)")
    p.add_argument("--batch", type=int, help="inference batch (default: 1)")
    p.add_argument("--context", type=int, help="inference context tokens (default: --seq-len)")
    p.add_argument("--ram-budget", help="MoE: RAM for cached experts when streaming them (hfscale experts), e.g. 4GB")
    p.add_argument("--routing-blocks", type=int, help="MoE: measure routing on this many calibration blocks with the "
                   "model's weights (local directory) instead of assuming uniform routing")
    p.add_argument("--sp", type=int, help="sequence parallel size (DeepSpeed Ulysses); with hardware: plan only this size")
    p.add_argument("--tp", type=int, help="tensor parallel size (transformers tp_plan); with hardware: plan only this size")
    p.add_argument("--cp", type=int, help="context parallel size (torch, FSDP2); with hardware: plan only this size")
    p.add_argument("--gpus-per-node", type=int)
    # hardware: with --gpus-per-node, strategies are ranked for it; the other hardware flags need it
    p.add_argument("--nodes", type=int, help="nodes (default: 1)")
    p.add_argument("--gpu-mem", help="memory per GPU (default: 80GB)")
    p.add_argument("--cpu-mem", help="CPU memory per node, for offload (default: 512GB)")
    p.add_argument("--global-batch-tokens", type=int, help="tokens per optimizer step (default: micro x seq x dp)")
    p.add_argument("--kernels", choices=KERNELS, default=None,
                   help="with --trace: the attention kernels traced: cpu (default; checked against CPU runs) or cuda "
                        "(CUDA's flash / memory-efficient attention from their fake kernels; not compared with a GPU run)")
    p.add_argument("--trace", action="store_true", help="also trace the step on fake tensors with transformers' own code: "
                   "prediction.peak / peak_step1 / phases, candidates ranked on the traced peak, any causal LM "
                   "(seconds per model shape, cached under $HFSCALE_CACHE)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", help="write stacked memory bars per strategy to this PNG (missing parent directories are created)")
    p.add_argument("--write", help="write accelerate YAML, DeepSpeed JSON and training arguments for the pick into this "
                   "directory (created if missing)")
    p.add_argument("--force", action="store_true", help="overwrite existing --plot / --write outputs")
    p.set_defaults(run=run)


def _refuse_ignored_flags(args) -> None:
    # a flag that would be ignored is refused: hardware without --gpus-per-node, serving without --inference
    from ..errors import HfscaleError

    for needs, flags in (("--gpus-per-node", ("nodes", "gpu_mem", "cpu_mem", "global_batch_tokens")),
                         ("--inference", ("quant", "batch", "context", "ram_budget", "routing_blocks")),
                         ("--trace", ("kernels",))):
        if getattr(args, needs[2:].replace("-", "_")) in (None, False):
            given = [f"--{f.replace('_', '-')}" for f in flags if getattr(args, f) is not None]
            if given:
                raise HfscaleError(f"{given[0]} is only used with {needs} (it would be ignored); add {needs} or drop {given[0]}")


def _parallel_sizes(args, heads):
    """--sp / --tp / --cp as a validated Parallel, checked against the model's heads (SP assumed on flash
    attention, as on GPUs); HfscaleError (exit 2) with the value to set."""
    from ..errors import HfscaleError
    from ..scale.parallel import require_model_fits
    from ..scale.spec import Parallel

    sp, tp, cp = (1 if v is None else v for v in (args.sp, args.tp, args.cp))
    par = Parallel(sp=sp, tp=tp, cp=cp, sp_attention="flash_attention_2")
    if sp > 1 and tp > 1:
        raise HfscaleError("--sp (DeepSpeed Ulysses) and --tp (transformers TP under FSDP2) do not compose in accelerate; drop one")
    if args.gpus_per_node is not None and par.size > args.gpus_per_node:
        raise HfscaleError(f"sp x tp x cp = {par.size} spans more than one node of {args.gpus_per_node} GPUs; use sizes whose "
                           f"product is at most {args.gpus_per_node}")
    if args.gpus_per_node is not None and (args.gpus_per_node * (args.nodes or 1)) % par.size:
        raise HfscaleError(f"sp x tp x cp = {par.size} does not divide the {args.gpus_per_node * (args.nodes or 1)} GPUs; "
                           "use sizes whose product divides the GPU count")
    if par.size > 1:
        require_model_fits(par, heads, args.model, seq_len=args.seq_len)
    return par


def _no_sp_note(args, heads, sizes) -> str:
    """Why no sequence-parallel candidate was planned, when the model rules it out."""
    if heads is None or args.sp is not None or any(sp > 1 for sp, _, _ in sizes):
        return ""
    from ..scale.parallel import model_problems
    from ..scale.spec import Parallel

    errs = [p for p in model_problems(Parallel(sp=2, sp_attention="flash_attention_2"), heads) if p.severity == "error"]
    return f"; sequence parallel is no candidate: {errs[0].what}" if errs else ""


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f}"


def run(args) -> int:
    from pathlib import Path

    from ..atomic import check_writable
    from ..errors import HfscaleError
    from ..models import load_config
    from ..plan.memory import CUDA_CONTEXT_BYTES, Strategy, predict
    from ..plan.peak import for_strategy, untraceable
    from ..plan.shape import model_shape, shape_of
    from ..plan.trace import TraceError
    from ..plan.planner import Hardware, candidates, parse_size, pick, shortfall

    _refuse_ignored_flags(args)
    hw = None
    if args.gpus_per_node is not None:
        hw = Hardware(args.gpus_per_node, 1 if args.nodes is None else args.nodes,
                      parse_size(args.gpu_mem or "80GB"), parse_size(args.cpu_mem or "512GB"))
    if (args.write or args.plot) and hw is None:
        raise HfscaleError("--write and --plot rank strategies: give the hardware (--gpus-per-node, --gpu-mem)")
    check_writable({args.write: "--write", args.plot: "--plot"}, args.force, inputs={args.model: "--model"})
    if args.plot:  # issue 30: matplotlib is the [plot] extra
        from ..extras import require

        require("hfscale plan --plot", "plot")
    # the trace runs transformers' code on the real config; the analytic plan reads the cached shape (no torch)
    config = load_config(args.model) if args.trace else None
    shape = shape_of(config) if config is not None else model_shape(args.model)
    if shape.heads is None and any(v not in (None, 1) for v in (args.sp, args.tp, args.cp)):
        raise HfscaleError(shape.heads_error)
    par = _parallel_sizes(args, shape.heads)
    dp = args.dp if args.dp is not None else (hw.world // par.size if hw else 1)  # --dp 0 is refused, not made 1
    s = Strategy(zero=args.zero, dp=dp, precision=args.precision, optimizer=args.optimizer, offload=args.offload,
                 checkpointing=args.checkpointing, micro_batch=args.micro_batch, seq_len=args.seq_len,
                 attention=args.attention, lora_rank=args.lora_rank, base_bits=args.base_bits, sp=par.sp, tp=par.tp, cp=par.cp)
    d = shape.dims
    if d is None:  # an architecture without analytic formulas: the trace alone answers
        if not args.trace or untraceable(s) or args.inference:
            raise HfscaleError(f"{shape.dims_error}; with --trace (and without --inference, and --optimizer/--base-bits adamw/16) "
                               "the step is traced from transformers' own code instead")
    why_not = "not asked (--trace)" if not args.trace else untraceable(s)
    if why_not is None and par.size > 1:
        why_not = "the trace runs one process: sp / tp / cp are planned analytically (hfscale.plan.parallel)"
    kernels = args.kernels or "cpu"
    traced = (lambda strat, accum=1: for_strategy(config, strat, accum, kernels)) if why_not is None else None
    out = {"model": args.model, "params": None, "strategy": s.label, "prediction": predict(d, s) if d else {}}
    if traced:
        try:
            out["prediction"].update(traced(s))
        except TraceError as e:  # no guessed peak: the analytic terms stand alone, and say why
            if d is None:
                raise
            why_not, traced = str(e), None
            out["prediction"]["peak_not_traced"] = why_not
    else:
        out["prediction"]["peak_not_traced"] = why_not
    out["params"] = out["prediction"].get("params", d.params if d else None)
    if args.inference:
        from ..plan.memory import inference_bytes

        args.quant, args.batch = args.quant or "bf16", 1 if args.batch is None else args.batch
        if args.batch < 1 or (args.context is not None and args.context < 1):
            raise HfscaleError(f"--batch and --context must be at least 1 (got {args.batch}, {args.context})")
        out["inference"] = inference_bytes(d, args.quant, args.batch, args.context or args.seq_len)
        from ..plan.moe_serving import for_cli

        moe = for_cli(args, d, out["inference"]["kv_cache"], hw.gpu_mem if hw else None)
        if moe is not None:
            out["moe_serving"] = moe.as_dict()
    rows = best = None
    if hw:
        tokens = args.global_batch_tokens or args.micro_batch * args.seq_len * hw.world
        layers = shape.layers
        from ..plan.parallel import parallel_options

        sizes = (parallel_options(shape.heads, hw, args.seq_len, args.sp, args.tp, args.cp) if shape.heads is not None
                 else [(1, 1, 1)])
        try:
            rows = candidates(d, hw, args.seq_len, tokens, args.precision, args.attention, step_peak=traced, layers=layers,
                              parallel=sizes)
        except TraceError as e:  # a candidate the trace cannot run: rank all on the analytic terms, and say so
            if d is None:
                raise
            rows = candidates(d, hw, args.seq_len, tokens, args.precision, args.attention, layers=layers, parallel=sizes)
            out["candidates_not_traced"], traced = str(e), None
        best = pick(rows)
        out["candidates"] = rows
        out["pick"] = best
        if best is None:
            out["nothing_fits"] = shortfall(rows, hw) + _no_sp_note(args, shape.heads, sizes)
    if args.json:
        print(json.dumps(out))
    else:
        p = out["prediction"]
        print(f"{args.model}: {out['params'] / 1e9:.3f}B parameters; {s.label}, dp {dp}, seq {args.seq_len}, {args.precision}")
        if d is not None:
            print("per-GPU GB   weights  grads  optimizer  activations  recompute  zero3-live  total")
            print(f"             {_gb(p['weights']):>7}  {_gb(p['gradients']):>5}  {_gb(p['optimizer']):>9}  {_gb(p['activations']):>11}"
                  f"  {_gb(p['recompute_working']):>9}  {_gb(p['zero3_live']):>10}  {_gb(p['total']):>5}")
        if "peak" in p:
            ph, ph1 = p["phases"], p["phases_step1"]
            print(f"step peak GB {_gb(p['peak'])} in {p['peak_phase']} (step 1: {_gb(p['peak_step1'])}); phases steady / step 1: "
                  + ", ".join(f"{k} {_gb(ph[k])} / {_gb(ph1[k])}" for k in ph))
            print("  at the peak: " + ", ".join(f"{k} {_gb(v)}" for k, v in sorted(p["peak_breakdown"].items(), key=lambda kv: -kv[1])))
            print(f"  (traced on fake tensors in {p['trace']['seconds']} s as {p['trace']['precision']}; assumes {p['trace']['assumes']})")
        else:
            print(f"step peak not traced: {p['peak_not_traced']}")
        print(f"(not included: CUDA context {CUDA_CONTEXT_BYTES / 2**30:.1f} GiB, "
              f"~10% allocator fragmentation; offloaded per rank {_gb(p.get('offloaded_per_rank', 0))} GB)")
        if args.inference:
            i = out["inference"]
            print(f"inference ({args.quant}, batch {args.batch}, context {args.context or args.seq_len}): weights {_gb(i['weights'])} GB"
                  f" + KV cache {_gb(i['kv_cache'])} GB = {_gb(i['total'])} GB")
            if "moe_serving" in out:
                from ..plan.moe_serving import lines

                print("\n".join(lines(moe)))
        if rows:
            basis = "traced step peak" if traced else "analytic total"
            print(f"\ncandidates on {hw.nodes}x{hw.gpus_per_node} GPUs of {hw.gpu_mem / 1e9:.0f} GB (peak = {basis} x 1.1 + context):")
            print(f"  {'strategy':34} {'accum':>5} {'peak GB':>8} {'cost':>6}  fits")
            for r in rows[:12]:
                print(f"  {r['strategy']:34} {r['grad_accum']:>5} {r['peak_bytes'] / 1e9:>8.1f} {r['cost']:>6.2f}  {'yes' if r['fits'] else 'no'}")
            print(f"\npick: {best['strategy']} (accum {best['grad_accum']})" if best else f"\n{out['nothing_fits']}")
    if args.plot:
        from ..plan.plot import plot_candidates

        plot_candidates(rows, args.plot, title=f"{args.model} seq {args.seq_len} on {hw.nodes}x{hw.gpus_per_node}x{hw.gpu_mem / 1e9:.0f}GB",
                        gpu_mem=hw.gpu_mem)
        if not args.json:
            print(f"wrote {args.plot}")
    if args.write:
        if best is None:
            raise HfscaleError("nothing fits, so there is no pick to write; " + out["nothing_fits"])
        from ..plan.write import write_plan

        for f in write_plan(best, hw, Path(args.write), force=args.force, model=args.model, seq_len=args.seq_len):
            if not args.json:
                print(f"wrote {f}")
    return 1 if hw is not None and best is None else 0
