"""Quantization-aware fine-tuning of a trained checkpoint, then convert, save and report.

    accelerate launch --config_file accelerate_configs/zero2.yaml --num_processes 2 \
        recipes/qat_clm.py --config recipes/tiny/qat.yaml --model runs/tiny/model

    # options: --scheme 8da4w|int4wo|q4_0  --group-size 0 (per-channel)  --lora-rank 8  --distill 1.0
    #          --include-embeddings true (q4_0: the tied embedding / head on the grid too, for --embed-qtype Q4_0)

The model computes with its linears fake-quantized to the scheme's grid (hfscale.compress.qat) and
learns weights that survive the rounding; the end converts them to the real quantization. Writes
OUTPUT_DIR/quantized (a transformers dir that `from_pretrained` reloads; for q4_0 float weights on
llama.cpp's grid, for `hfscale quantize --format gguf --qtype Q4_0`), OUTPUT_DIR/quality.json and
prints float / PTQ / QAT perplexity side by side with the share of PTQ's loss QAT recovered.
Everything else (the data: any format, its loss masks, the token store and packing; batching, checkpoints,
--resume latest, metrics.jsonl; activation checkpointing and the long-context levers: hfscale.train.prepare) is
train_clm.py's; what this recipe cannot honour (attention, padding_free, --adapter, Ulysses SP, tiled_loss with distill) is refused
in one line (hfscale.train.recipe).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path


def main(argv=None) -> int:
    from hfscale.train.config import QATRecipeConfig
    from hfscale.train.recipe import run_recipe

    return run_recipe(argv, __doc__, QATRecipeConfig, train, check=check,
                      config_help="recipe YAML (recipes/<family>/<size>_qat.yaml)")


def check(cfg) -> None:
    """Before anything loads: QAT starts from trained weights."""
    from hfscale.models import is_builtin
    from hfscale.util.errors import HfscaleError

    if is_builtin(cfg.model):
        raise HfscaleError(f"QAT fine-tunes a trained checkpoint; {cfg.model} is a random init: pass --model "
                           "runs/tiny/model (from recipes/train_clm.py) or another trained directory")


def build_student(cfg, spec):
    """The trained checkpoint, fake-quantized, optionally with LoRA adapters on top (as it trained)."""
    from hfscale.scale.adapters import apply_adapter

    return apply_adapter(fake_quantized(cfg, spec), lora_of(cfg))


def fake_quantized(cfg, spec):
    """The trained checkpoint with its linears fake-quantized to the scheme's grid (hfscale.compress.qat)."""
    from hfscale.compress.qat import prepare_qat_
    from hfscale.models import build_model

    return prepare_qat_(build_model(cfg.model), spec)


def lora_of(cfg):
    """--lora-rank N: LoRA on the fake-quantized base (hfscale.compress.qat.lora_spec); 0: the whole model trains."""
    from hfscale.compress.qat import lora_spec
    from hfscale.scale.adapters import AdapterSpec

    return lora_spec(cfg.lora_rank) if cfg.lora_rank else AdapterSpec()


def train(cfg, force, pre, parallel, store) -> int:
    from hfscale.compress.schemes import QuantSpec
    from hfscale.data.recipe import run_rows
    from hfscale.models import build_model
    from hfscale.train.distill import distill_loss_fn
    from hfscale.train.loop import evaluate, resume_from, start_run, train_steps
    from hfscale.train.metrics import MetricsLog
    from hfscale.train.prepare import prepare_training
    from hfscale.train.state import model_fingerprint

    spec = QuantSpec(cfg.scheme, group_size=cfg.group_size, include_embeddings=cfg.include_embeddings)
    plan, data, ckpts, resume = pre.plan, pre.data, pre.ckpts, pre.resume
    # --- launch ---
    accelerator = start_run(cfg, force, pre, tag="qat_clm")
    main_rank = accelerator.is_main_process
    out = Path(cfg.output_dir)

    # --- data: the token store's packed rows, as train_clm reads them (masks, documents apart, trained-token loss) ---
    tokenizer = data.tokenizer
    rows = run_rows(store, plan, cfg.seed, cfg.max_train_blocks, cfg.eval_blocks)

    # --- model: fake-quantized student (checkpointing and the levers on it, LoRA on top), optional frozen teacher
    # (the unquantized checkpoint) ---
    run = prepare_training(accelerator, cfg, pre, fake_quantized(cfg, spec), adapter=lora_of(cfg))
    model, optimizer, loss_fn = run.model, run.optimizer, run.loss_fn
    if cfg.distill > 0:
        teacher = build_model(cfg.model).to(accelerator.device).eval().requires_grad_(False)
        loss_fn = run.wrap(distill_loss_fn(teacher, cfg.distill, cfg.temperature))
    if main_rank:
        print(f"[qat_clm] {cfg.model} fake-quantized for {spec.scheme} (group {spec.group_size or 'per-channel'}), "
              f"{run.trained:,} trainable params{' (LoRA r=' + str(cfg.lora_rank) + ')' if cfg.lora_rank else ''}, "
              f"distill {cfg.distill}, AdamW {run.adamw}{run.facts()}")
    start = resume_from(accelerator, resume, "qat_clm")
    log = MetricsLog(out / "metrics.jsonl", enabled=main_rank)
    meta = {"model": cfg.model, "model_fingerprint": model_fingerprint(pre.model_config), "world": plan.world,
            "tokens_per_step": plan.tokens_per_step, "scheme": spec.scheme, "data_key": store.key}

    # --- train (against the grid) ---
    train_steps(accelerator, model, optimizer, cfg, plan, rows.train, rows.val, ckpts, log, start, meta, loss_fn,
                tag="qat_clm", read_batch=rows.reader.batch, step_tokens=rows.reader.trained)
    ev = evaluate(model, accelerator, rows.val, plan.micro_batch)
    log.write({"kind": "eval", "step": cfg.max_steps, "loss": ev, "ppl": math.exp(ev), "final": True, "fake_quant": True})

    # --- convert and save: the full weights (ZeRO shards gathered) into a fresh copy on the main rank ---
    state = accelerator.get_state_dict(model)
    if main_rank:
        finish(cfg, spec, state, tokenizer, rows, out)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return 0


def finish(cfg, spec, state, tokenizer, data_rows, out: Path) -> None:
    import torch

    from hfscale.util.atomic import write_text_atomic
    from hfscale.compress.evaluate import perplexity, qat_table, recovered
    from hfscale.compress.ptq import ptq_in_memory
    from hfscale.compress.qat import convert_qat_, merge_lora
    from hfscale.compress.save import save_model_dir
    from hfscale.models import build_model

    student = build_student(cfg, spec)
    student.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    missing = [k for k in student.state_dict() if k not in state and "lm_head" not in k]
    if missing:
        raise RuntimeError(f"consolidated state misses {len(missing)} tensors (first {missing[0]}); refusing to save")
    student = merge_lora(student).float().eval()
    qat = convert_qat_(student, spec)
    save_model_dir(qat, out / "quantized", tokenizer=tokenizer, force=True)
    blocks = data_rows.val  # packed held-out micro batches: only their trained tokens are scored
    rows = {"float": perplexity(build_model(cfg.model, dtype=torch.float32), blocks), "qat": perplexity(qat, blocks)}
    if cfg.ptq_baseline:
        rows["ptq"] = perplexity(ptq_in_memory(cfg.model, spec), blocks)
    report = {"scheme": spec.scheme, "group_size": spec.group_size, "steps": cfg.max_steps, "lora_rank": cfg.lora_rank,
              "distill": cfg.distill, "eval_tokens": data_rows.val_trained, "perplexity": rows,
              "recovered": recovered(rows["float"], rows["ptq"], rows["qat"]) if "ptq" in rows else None}
    write_text_atomic(out / "quality.json", json.dumps(report, indent=1) + "\n")
    print(f"[qat_clm] saved {out / 'quantized'}; held-out perplexity over {report['eval_tokens']:,} tokens:")
    if "ptq" in rows:
        print(qat_table(rows["float"], rows["ptq"], rows["qat"], spec.scheme, label_float="float (start)"))
        if cfg.distill == 1.0:  # the only target is the starting model (its probabilities), not the data
            print("[qat_clm] recovered is measured against the starting checkpoint, which was also the only target "
                  "(distill 1.0): what QAT won back is the grid's loss, not further training")
        else:
            print("[qat_clm] recovered is measured against the starting checkpoint (torchao's convention); the fine-tune "
                  "also moves the float model, which benchmarks/compress.py separates with a same-steps control run")
    else:
        print(f"float {rows['float']:.3f} | QAT {rows['qat']:.3f}")


if __name__ == "__main__":  # every rank ends through exit_rank: no interpreter finalization to race gloo's threads
    from hfscale.scale.runtime import exit_rank

    exit_rank(main())
