"""Train a causal LM with accelerate (+ DeepSpeed), on one CPU box or a GPU cluster.

    accelerate launch --config_file accelerate_configs/zero2.yaml --num_processes 2 \
        recipes/train_clm.py --config recipes/tiny/train.yaml

    # after a crash or preemption, the same command with:   --resume latest

    # long context, DeepSpeed Ulysses over the 2 ranks (the model's heads are checked before it loads):
    hfscale config zero3 --name zero3_sp2_cpu --sp 2 --num-processes 2 --sp-attention sdpa
    accelerate launch --config_file accelerate_configs/zero3_sp2_cpu.yaml recipes/train_clm.py --config recipes/tiny/train.yaml

Every setting lives in hfscale.train.config.TrainConfig; a recipe YAML sets them and `--key value`
overrides one (`--seq-len 256`). The run writes OUTPUT_DIR/metrics.jsonl (one line per step and
per evaluation), OUTPUT_DIR/checkpoints/step_N (accelerate state, last K kept) and finally
OUTPUT_DIR/model, a transformers directory that `from_pretrained` loads.

Adapters (hfscale.scale.adapters): `--adapter lora|dora|qlora --lora-rank 16` (or `adapter: {kind: lora, rank: 16}`
in the YAML) trains low-rank adapters on every decoder linear of a frozen base (QLoRA: an NF4 base, bitsandbytes);
the run then also writes OUTPUT_DIR/adapter (a peft directory) and OUTPUT_DIR/model is the adapter merged into the
base reloaded in its own dtype, which quantize / GGUF / .pte / prune / eval take unchanged.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path


def main(argv=None) -> int:
    from hfscale.train.config import TrainConfig
    from hfscale.train.recipe import run_recipe

    return run_recipe(argv, __doc__, TrainConfig, train, check_launch=check_launch,
                      config_help="recipe YAML (recipes/<family>/<size>.yaml)")


def check_launch(cfg, pre, parallel) -> None:
    """train_clm's own refusals, once the model's config and the launch are known (before any process group)."""
    check_adapter(cfg, pre)
    check_parallel(cfg, pre, parallel)


def check_parallel(cfg, pre, parallel) -> None:
    """sp / tp / cp from the launch's parallelism_config (hfscale.scale.ulysses.launch_parallel, read by run_recipe),
    checked against the model before it loads (heads, sliding windows: on sdpa the window is rebuilt under SP by
    hfscale.scale.ulysses.use_window_sdpa)."""
    from hfscale.scale.parallel import require_model_fits
    from hfscale.scale.runtime import refuse_parallel_on_cpu

    if parallel.size > 1:
        refuse_parallel_on_cpu(os.environ)
        if parallel.tp > 1 or parallel.cp > 1:
            from hfscale.util.errors import HfscaleError

            raise HfscaleError(f"train_clm runs data and sequence parallelism; this launch asks for tp {parallel.tp} / cp "
                               f"{parallel.cp}: use an accelerate config with --sp (hfscale config zero3 --sp N), or load "
                               "the model with DistributedConfig(tp_plan=\"auto\") in your own script")
        require_model_fits(parallel, pre.model_config, cfg.model, seq_len=cfg.seq_len, window_sdpa=True)
    if cfg.attention:  # before anything is written: a kernel this model or host cannot run is one line
        from hfscale.models.varlen import check_attention

        check_attention(cfg.attention, pre.model_config)
    from hfscale.data.dataset import check_padding_free

    check_padding_free(cfg.padding_free, cfg.attention, parallel.sp)  # one row per micro batch: not under SP
    if parallel.sp > 1 and cfg.attention == "varlen":
        from hfscale.util.errors import HfscaleError

        raise HfscaleError("attention: varlen does not run under Ulysses SP (it wraps sdpa or flash only); drop attention "
                           "(the launch's sp_attn_implementation decides the kernel)")


def train(cfg, force, pre, parallel, store) -> int:
    from hfscale.models import build_model
    from hfscale.data.recipe import run_rows
    from hfscale.train.loop import evaluate, resume_from, start_run, train_steps
    from hfscale.train.metrics import MetricsLog
    from hfscale.train.prepare import prepare_training
    from hfscale.train.state import model_fingerprint, save_final, save_final_adapter
    from hfscale.scale.adapters import template_tokens_note
    from hfscale.train.adapter_ckpt import base_digest, source_key
    from hfscale.data.sampler import data_parallel

    # under SP the ranks of one group read the same rows: the batch plan counts groups (hfscale.data.sampler)
    sp_plan, data_rank = data_parallel(pre.plan, parallel.sp, int(os.environ.get("RANK", "0")))
    if parallel.sp > 1:
        import dataclasses

        pre = dataclasses.replace(pre, plan=sp_plan)
    else:
        data_rank = None
    plan, data, ckpts, resume = pre.plan, pre.data, pre.ckpts, pre.resume
    # --- launch: process group (gloo on CPU hosts), clean output dir, batch arithmetic ---
    accelerator = start_run(cfg, force, pre, tag="train_clm")
    main_rank = accelerator.is_main_process
    out = Path(cfg.output_dir)

    # --- data: the token store's packed rows (labels masked, positions restarting per document), memory-mapped ---
    tokenizer = data.tokenizer  # the model's, with the built-in chat template for the tiny model (saved with it)
    # step s, micro a, rank r: the sampler's rows as one packed micro batch; the step's loss divides by its
    # trained-token count over every micro batch and rank, read from the store (no communication)
    rows = run_rows(store, plan, cfg.seed, cfg.max_train_blocks, cfg.eval_blocks, cfg.padding_free)
    train_rows, reader, val_batches, val_rows = rows.train, rows.reader, rows.val, rows.val.dataset

    # --- model: the base (NF4 for QLoRA); attention, checkpointing, the levers, the adapter, SP, AdamW, prepared ---
    spec = cfg.adapter_spec
    run = prepare_training(accelerator, cfg, pre, build_base(cfg, spec, pre, accelerator), parallel=parallel)
    model, optimizer, loss_fn = run.model, run.optimizer, run.loss_fn
    if main_rank:
        print(f"[train_clm] {cfg.model}: {run.params:,} params"
              + (f" ({spec.describe()}: {run.trained:,} trained)" if spec.enabled else "") + ", "
              f"{len(train_rows):,} train / {len(val_rows)} eval rows, AdamW {run.adamw}"
              + (f", attention {cfg.attention}" if cfg.attention else "")
              + (", padding-free (one row per micro batch)" if cfg.padding_free else "") + run.facts())
        if note := template_tokens_note(spec, store.options.get("format"), zero_stage_of(pre), pre.launch.fsdp):
            print(f"[train_clm] note: {note}")
    # an adapter's checkpoints hold no base: they record which (source, and the live frozen bytes' digest) instead
    base = {**source_key(cfg.model, cfg.seed), "digest": base_digest(accelerator.unwrap_model(model))} if spec.enabled else None
    start = resume_from(accelerator, resume, "train_clm", model, base)
    if base and resume is not None and "base" not in resume.meta:  # a checkpoint from before adapter-only saves loaded
        base["digest"] = base_digest(accelerator.unwrap_model(model))  # its own base: the next checkpoints name that one
    log = MetricsLog(out / "metrics.jsonl", enabled=main_rank)
    meta = {"model": cfg.model, "model_fingerprint": model_fingerprint(pre.model_config, spec), "world": plan.world,
            "tokens_per_step": plan.tokens_per_step, "data_key": store.key, **({"base": base} if base else {})}

    # --- train ---
    train_steps(accelerator, model, optimizer, cfg, plan, train_rows, val_batches, ckpts, log, start, meta, loss_fn=loss_fn,
                data_rank=data_rank, read_batch=reader.batch, step_tokens=reader.trained)

    # --- evaluate and save ---
    ev = evaluate(model, accelerator, val_batches, plan.micro_batch)
    log.write({"kind": "eval", "step": cfg.max_steps, "loss": ev, "ppl": math.exp(ev), "final": True})
    if spec.enabled:  # the adapter, and merged into the base reloaded in its own dtype (never at 4 bits)
        saved = save_final_adapter(accelerator, model, tokenizer, out, lambda: build_model(cfg.model, seed=cfg.seed))
        if main_rank:
            print(f"[train_clm] eval loss {ev:.4f} (ppl {math.exp(ev):.2f}); saved {saved['adapter']}: {saved['numel']:,} "
                  f"adapter elements, {saved['bytes'] / 1e6:.2f} MB; merged into the base: {saved['path']}, "
                  f"{saved['model_numel']:,} parameter elements")
    else:
        saved = save_final(accelerator, model, tokenizer, out / "model")
        if main_rank:
            print(f"[train_clm] eval loss {ev:.4f} (ppl {math.exp(ev):.2f}); saved {saved['path']}: "
                  f"{saved['numel']:,} parameter elements (model {saved['model_numel']:,}), {saved['bytes'] / 1e6:.1f} MB")
    accelerator.end_training()
    return 0


def build_base(cfg, spec, pre, accelerator):
    """The model; for an adapter, the frozen base it trains on. A built-in name's (random, seeded) base is written whole
    by every rank to a directory of its own and loaded from there: under ZeRO-3 zero.Init would draw another random
    init than build_model, the base the adapter is merged into at the end, and transformers quantizes (QLoRA: NF4
    decoder linears, stored as hfscale.scale.adapters.qlora_dtypes says) on from_pretrained only. Loads run under
    ZeRO-3's zero.Init (partitioned); FSDP2 QLoRA is refused before this (check_adapter)."""
    import tempfile

    from hfscale.models import build_model
    from hfscale.models.builtin import is_builtin
    from hfscale.scale.adapters import load_quantized_base, write_weights
    from hfscale.scale.runtime import without_zero_init

    if not spec.enabled:
        return build_model(cfg.model, seed=cfg.seed)
    with tempfile.TemporaryDirectory(prefix="hfscale-base-") as tmp:
        path = cfg.model
        if is_builtin(cfg.model):
            with without_zero_init(accelerator):
                path = str(write_weights(build_model(cfg.model, seed=cfg.seed), tmp))
        if spec.base_bits == 16:
            model = build_model(path)
        else:
            compute, storage = qlora_dtypes_of(pre)
            device_map = "cpu" if pre.launch.on_cpu and pre.launch.deepspeed is None else None  # DeepSpeed places it
            model = load_quantized_base(path, compute, storage, device_map=device_map)
    model.config.name_or_path = cfg.model
    return model


def zero_stage_of(pre) -> int | None:
    ds = pre.launch.deepspeed
    return (ds or {}).get("zero_optimization", {}).get("stage", 0) if ds is not None else None


def qlora_dtypes_of(pre):
    from hfscale.scale.adapters import qlora_dtypes

    return qlora_dtypes(pre.precision.precision, zero_stage_of(pre), pre.launch.fsdp)


def check_adapter(cfg, pre) -> None:
    """Before any process group: what this launch cannot do with the adapter, one line each."""
    spec = cfg.adapter_spec
    if spec.changes_base:
        from hfscale.util.errors import ConfigError

        raise ConfigError(f"lora_init {spec.init} rewrites the base weights, and train_clm merges the adapter into the base "
                          "it reloads; use lora_init default or gaussian here, or hfscale.scale.adapters.apply_adapter in "
                          "your own loop")
    if spec.base_bits == 4:
        qlora_dtypes_of(pre)
    if spec.trainable_tokens or spec.embedding:  # failed under ZeRO-3 / FSDP2 here (TOKENS_REFUSED, EMBEDDING_REFUSED)
        from hfscale.scale.adapters import check_engine

        check_engine(spec, zero_stage_of(pre), pre.launch.fsdp)


if __name__ == "__main__":  # every rank ends through exit_rank: no interpreter finalization to race gloo's threads
    from hfscale.scale.runtime import exit_rank

    exit_rank(main())
