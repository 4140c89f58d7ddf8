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
  hfscale plan --model gemma-3-12b --seq-len 2048 --micro-batch 1 --adapter qlora --lora-rank 16
  hfscale plan --model gemma-3-4b --seq-len 2048 --micro-batch 1 --checkpointing full --compare-adapters

exit codes: 0 prediction (or a fitting pick), 1 nothing fits (says by how much), 2 invalid input (one line)
"""


def add_parser(sub):
    import argparse

    from ..plan.memory import OPTIMIZER_STATE_BYTES, QUANT_BYTES_PER_PARAM
    from ..scale.optim import ADAMW, DEFAULT_ADAMW
    from ..scale.adapters import KINDS as ADAPTER_KINDS
    from ..scale.spec import DEVICES, ZERO_STAGES

    p = sub.add_parser("plan", help="predict training memory and pick the cheapest strategy that fits",
                       description="Predict the per-GPU step peak of training any causal LM from its config alone (the "
                       "step traced from transformers' own code on fake tensors; seconds per model shape, cached under "
                       "$HFSCALE_CACHE), and with hardware given, rank strategies and pick the cheapest that fits.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="built-in name (tiny-gemma3, gemma-3-270m..27b, gemma-4-e2b/e4b/31b/26b-a4b), config.json, model dir or hub name")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--micro-batch", type=int, required=True)
    p.add_argument("--checkpointing", default="off", help="off | full | every:K")
    p.add_argument("--zero", type=int, default=0, choices=ZERO_STAGES)
    p.add_argument("--offload", default="none", choices=DEVICES)
    p.add_argument("--engine", default="auto", choices=["auto", "fsdp2"],
                   help="auto: DDP at --zero 0, DeepSpeed at 1-3; fsdp2: FSDP2 (fully_shard through accelerate)")
    p.add_argument("--engines", help="with hardware: the engines to rank, a comma-separated subset of ddp,deepspeed,fsdp2 "
                   "(default: all)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel ranks (default: all GPUs given, else 1)")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--optimizer", default="adamw", choices=list(OPTIMIZER_STATE_BYTES))
    p.add_argument("--adamw", default=DEFAULT_ADAMW, choices=ADAMW,
                   help="torch AdamW's implementation your loop runs, traced in the optimizer step (default fused: what "
                   "hfscale's recipes build and Trainer's default; foreach: torch's default on CUDA when none is named; "
                   "forloop: torch's default on CPU)")
    p.add_argument("--attention", default="sdpa", choices=["sdpa", "eager"], help="sdpa/flash (default) or eager")
    p.add_argument("--packing", action="store_true", help="rows packed with several documents each (hfscale data "
                   "--packing): counts the block-diagonal attention mask sdpa / eager get (flash varlen and hfscale's "
                   "varlen kernel, padding-free or not, build none: plan those without it)")
    p.add_argument("--adapter", default="none", choices=list(ADAPTER_KINDS),
                   help="train an adapter on a frozen base, as the recipe's adapter section does (peft on every decoder "
                   "q/k/v/o/gate/up/down; qlora: NF4 base through bitsandbytes); none = full fine-tuning")
    p.add_argument("--lora-rank", type=int, default=0, help="adapter rank (default 16 with --adapter); alone it means "
                   "--adapter lora; 0 = full fine-tuning")
    p.add_argument("--base-bits", type=int, default=16, choices=[16, 4], help="4 = QLoRA (NF4 base), as --adapter qlora")
    p.add_argument("--compare-adapters", action="store_true", help="predict full fine-tuning, LoRA, DoRA and QLoRA "
                   "side by side for this model and strategy (rank --lora-rank or 16)")
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
                   help="attention kernels the trace models (default: cuda with GPU hardware given, else cpu): cuda is "
                        "CUDA's flash / memory-efficient attention from their fake kernels (not compared with a GPU run)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--trace", action="store_true", help="require the traced step: a strategy that cannot be traced is "
                     "an error instead of falling back to the analytic terms")
    how.add_argument("--fast", action="store_true", help="the analytic terms only (model states + saved activations, "
                     "no temporaries or phases; families with formulas): no trace, no torch import once cached")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", help="write stacked memory bars per strategy to this PNG (missing parent directories are created)")
    p.add_argument("--write", help="write accelerate YAML, DeepSpeed JSON and training arguments for the pick into this "
                   "directory (created if missing)")
    p.add_argument("--force", action="store_true", help="overwrite existing --plot / --write outputs")
    p.set_defaults(run=run)


def _refuse_ignored_flags(args) -> None:
    # a flag that would be ignored is refused: hardware without --gpus-per-node, serving without --inference
    from ..util.errors import HfscaleError

    for needs, flags in (("--gpus-per-node", ("nodes", "gpu_mem", "cpu_mem", "global_batch_tokens", "engines")),
                         ("--inference", ("quant", "batch", "context", "ram_budget", "routing_blocks"))):
        if getattr(args, needs[2:].replace("-", "_")) in (None, False):
            given = [f"--{f.replace('_', '-')}" for f in flags if getattr(args, f) is not None]
            if given:
                raise HfscaleError(f"{given[0]} is only used with {needs} (it would be ignored); add {needs} or drop {given[0]}")


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f}"


def run(args) -> int:
    from pathlib import Path

    from ..util.atomic import check_writable
    from ..util.errors import HfscaleError
    from ..plan.api import Serving, plan
    from ..plan.planner import Hardware, parse_size

    _refuse_ignored_flags(args)
    hw = None
    if args.gpus_per_node is not None:
        hw = Hardware(args.gpus_per_node, 1 if args.nodes is None else args.nodes,
                      parse_size(args.gpu_mem or "80GB"), parse_size(args.cpu_mem or "512GB"))
    if args.compare_adapters:
        return _compare(args, hw)
    if (args.write or args.plot) and hw is None:
        raise HfscaleError("--write and --plot rank strategies: give the hardware (--gpus-per-node, --gpu-mem)")
    check_writable({args.write: "--write", args.plot: "--plot"}, args.force, inputs={args.model: "--model"})
    if args.plot:  # matplotlib is the [plot] extra
        from ..util.extras import require

        require("hfscale plan --plot", "plot")
    serving = None
    if args.inference:
        budget = parse_size(args.ram_budget) if args.ram_budget is not None else None
        routing = None
        if args.routing_blocks is not None and args.routing_blocks < 0:
            raise HfscaleError(f"--routing-blocks must be >= 0 (got {args.routing_blocks})")
        if args.routing_blocks:  # measured by the experts runtime, then planned over
            from ..experts.routing import calibration_routing

            routing = calibration_routing(args.model, args.routing_blocks, budget)
        serving = Serving(args.quant or "bf16", 1 if args.batch is None else args.batch, args.context, budget, routing)
    result = plan(args.model, args.seq_len, args.micro_batch, checkpointing=args.checkpointing, zero=args.zero,
                  offload=args.offload, dp=args.dp, precision=args.precision, optimizer=args.optimizer,
                  attention=args.attention, lora_rank=args.lora_rank, base_bits=args.base_bits, sp=args.sp, tp=args.tp,
                  cp=args.cp, hardware=hw, global_batch_tokens=args.global_batch_tokens,
                  method="trace" if args.trace else "fast" if args.fast else "auto", kernels=args.kernels,
                  serving=serving, engine=args.engine, adamw=args.adamw,
                  engines=None if args.engines is None else [e.strip() for e in args.engines.split(",") if e.strip()],
                  progress=not args.json, packing=args.packing, adapter=args.adapter)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print("\n".join(_lines(result)))
    if args.plot:
        from ..plan.plot import plot_candidates

        plot_candidates(list(result.candidates), args.plot, gpu_mem=hw.gpu_mem,
                        title=f"{args.model} seq {args.seq_len} on {hw.nodes}x{hw.gpus_per_node}x{hw.gpu_mem / 1e9:.0f}GB")
        if not args.json:
            print(f"wrote {args.plot}")
    if args.write:
        if result.pick is None:
            raise HfscaleError("nothing fits, so there is no pick to write; " + result.nothing_fits)
        from ..plan.write import write_plan

        for f in write_plan(result.pick, hw, Path(args.write), force=args.force, model=args.model, seq_len=args.seq_len,
                            adamw=result.adamw):
            if not args.json:
                print(f"wrote {f}")
    return 1 if hw is not None and result.pick is None else 0


def _compare(args, hw) -> int:
    """--compare-adapters: one library call, its rows printed."""
    from ..util.errors import HfscaleError
    from ..plan.adapters import compare_adapters

    if args.write or args.plot or args.inference or args.adapter != "none" or args.base_bits != 16:
        raise HfscaleError("--compare-adapters plans every adapter kind itself; drop --adapter / --base-bits / --write "
                           "/ --plot / --inference")
    rows = compare_adapters(args.model, args.seq_len, args.micro_batch, rank=args.lora_rank or 16, hardware=hw,
                            checkpointing=args.checkpointing, zero=args.zero, offload=args.offload, dp=args.dp,
                            precision=args.precision, optimizer=args.optimizer, attention=args.attention, sp=args.sp,
                            method="trace" if args.trace else "fast" if args.fast else "auto", kernels=args.kernels,
                            engine=args.engine, adamw=args.adamw, packing=args.packing)
    if args.json:
        print(json.dumps([r.to_dict() for r in rows]))
        return 0
    full = rows[0].peak
    print(f"{args.model}: seq {args.seq_len}, micro batch {args.micro_batch}, per-GPU step peak by adapter")
    print(f"  {'adapter':44} {'trainable':>12} {'peak GB':>8} {'x full':>7}  from")
    for r in rows:
        print(f"  {r.label:44} {r.trainable_params:>12,} {_gb(r.peak):>8} {r.peak / full:>7.2f}  "
              f"{'traced step' if r.source == 'trace' else 'analytic terms'}")
    notes = {r.note for r in rows if r.note}
    for n in sorted(notes):
        print(f"note: {n}")
    return 0


def _lines(r) -> list[str]:
    """The Plan as text."""
    from ..plan.memory import CUDA_CONTEXT_BYTES, FRAGMENTATION

    p, s = r.prediction, r.strategy
    out = [f"{r.model}: {p.params / 1e9:.3f}B parameters; {s.label}, dp {s.dp}, seq {s.seq_len}, {s.precision}"
           + (f", AdamW {r.adamw}" if s.optimizer == "adamw" else "")]
    if p.source == "trace":
        t = p.trace
        out.append(f"step peak GB {_gb(p.peak)} in {p.peak_phase} (step 1: {_gb(p.peak_step1)}); phases steady / step 1: "
                   + ", ".join(f"{k} {_gb(p.phases[k])} / {_gb(p.phases_step1[k])}" for k in p.phases))
        out.append("  at the peak: " + ", ".join(f"{k} {_gb(v)}" for k, v in sorted(p.breakdown.items(), key=lambda kv: -kv[1])))
        out.append(f"  (traced on fake tensors in {t['seconds']} s as {t['precision']}; assumes {t['assumes']})")
    else:
        out.append(f"analytic terms, not a traced step peak: {p.not_traced}")
    if p.terms:
        t = p.terms
        out.append("analytic terms GB  weights  grads  optimizer  activations  recompute  zero3-live  total")
        out.append(f"                   {_gb(t['weights']):>7}  {_gb(t['gradients']):>5}  {_gb(t['optimizer']):>9}  "
                   f"{_gb(t['activations']):>11}  {_gb(t['recompute_working']):>9}  {_gb(t['zero3_live']):>10}  "
                   f"{_gb(p.terms_total):>5}")
    out.append(f"(not included: CUDA context {CUDA_CONTEXT_BYTES / 2**30:.1f} GiB, "
               f"~{FRAGMENTATION:.0%} allocator fragmentation; offloaded per rank {_gb(p.offloaded_per_rank)} GB)")
    out += [f"note: {n}" for n in r.notes]
    if r.inference is not None:
        i, sv = r.inference, r.serving
        out.append(f"inference ({sv.quant}, batch {sv.batch}, context {sv.context or s.seq_len}): weights {_gb(i['weights'])} GB"
                   f" + KV cache {_gb(i['kv_cache'])} GB = {_gb(i['total'])} GB")
        if r.moe_serving is not None:
            from ..plan.moe_serving import lines

            out += lines(r.moe_serving)
    if r.hardware is not None:
        hw = r.hardware
        basis = {"trace": "traced step peak", "analytic": "analytic total"}
        kinds = sorted({basis[c.prediction.source] for c in r.candidates})
        out.append(f"\ncandidates on {hw.nodes}x{hw.gpus_per_node} GPUs of {hw.gpu_mem / 1e9:.0f} GB "
                   f"(peak = {' / '.join(kinds)} x 1.1 + context):")
        out.append(f"  {'strategy':34} {'accum':>5} {'peak GB':>8} {'cost':>6}  fits")
        for c in r.candidates[:12]:
            out.append(f"  {c.label:34} {c.grad_accum:>5} {c.peak_bytes / 1e9:>8.1f} {c.cost:>6.2f}  {'yes' if c.fits else 'no'}")
        if r.pick:
            b = r.pick
            out.append(f"\npick: {b.label} (accum {b.grad_accum}): {b.peak_bytes / 1e9:.1f} GB per GPU, "
                       f"{b.cpu_bytes_per_node / 1e9:.1f} GB of host memory per node")
            if "levers" in b.prediction.extra:
                lv = b.prediction.extra["levers"]
                out.append(f"  long-context levers: tiled_loss {lv['tiled_loss']} slices, tiled_mlp {lv['tiled_mlp']} slices, "
                           f"tiled_norm {lv.get('tiled_norm', 0)} slices, offload_activations {str(lv['offload_activations']).lower()}; step time x"
                           f"{b.prediction.extra['time_factor']:.2f} (hfscale/plan/long_context.py's time model)")
        else:
            out.append(f"\n{r.nothing_fits}")
    return out
