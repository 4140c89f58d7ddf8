"""Distil a student (a pruned model) from its teacher (the unpruned model), then save and report.

    hfscale prune runs/tiny/model --params 0.5x --out runs/tiny_half          # the student
    accelerate launch --config_file accelerate_configs/zero2.yaml --num_processes 2 \
        recipes/distill_clm.py --config recipes/tiny/distill.yaml --model runs/tiny_half --teacher runs/tiny/model

    # after a crash or preemption, the same command with:   --resume latest
    # then, to llama.cpp Q4_0 (prune -> distill -> QAT -> GGUF):
    accelerate launch --config_file accelerate_configs/zero2.yaml --num_processes 2 recipes/qat_clm.py \
        --config recipes/tiny/qat.yaml --model runs/tiny_distill/model --scheme q4_0 --output-dir runs/tiny_distill_qat
    hfscale quantize runs/tiny_distill_qat/quantized --format gguf --qtype Q4_0 --out student-Q4_0.gguf

Loss per next-token position: (1 - ce_weight) x T^2 x KL(teacher || student at temperature T) +
ce_weight x cross-entropy on the data (hfscale.train.distill). The teacher is frozen, in eval mode,
replicated on every rank, or with teacher_placement: zero3 (--teacher-placement zero3, DeepSpeed
launches) partitioned over the ranks by its own ZeRO-3 engine; the student trains under whatever the
accelerate config says (DDP, DeepSpeed ZeRO-1/2/3). quality.json records what each rank held of the teacher. Writes OUTPUT_DIR/metrics.jsonl (train loss = the distillation loss; eval
records carry the held-out CE and KL to the teacher, at step 0 and every eval_every steps),
OUTPUT_DIR/checkpoints/step_N (--resume latest), OUTPUT_DIR/model (consolidated, from_pretrained
loads it) and OUTPUT_DIR/quality.json (teacher / student-before / student-after perplexity and KL).
The student is built as train_clm builds its model (hfscale.train.prepare: checkpointing, tiled MLP / RMSNorm,
activation offload); what this recipe cannot honour (attention, padding_free, --adapter, Ulysses SP, tiled_loss) is refused in one
line (hfscale.train.recipe).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path


def main(argv=None) -> int:
    from hfscale.train.distill import DistillRecipeConfig
    from hfscale.train.recipe import run_recipe

    return run_recipe(argv, __doc__, DistillRecipeConfig, train, check=check,
                      config_help="recipe YAML (recipes/<family>/distill.yaml)")


def check(cfg) -> None:
    """Before anything loads: one vocabulary for student and teacher, and a launch that can hold the teacher's placement."""
    from hfscale.models import load_config
    from hfscale.train.distill import check_pair, check_placement

    check_pair(load_config(cfg.model), load_config(cfg.teacher), cfg.teacher)
    check_placement(cfg, os.environ)


def train(cfg, force, pre, parallel, store) -> int:
    from hfscale.data.recipe import run_rows
    from hfscale.models import build_model
    from hfscale.train.distill import gather_shares, heldout_kl, kd_loss_fn, load_teacher
    from hfscale.train.loop import evaluate, resume_from, start_run, train_steps
    from hfscale.train.metrics import MetricsLog
    from hfscale.train.prepare import prepare_training
    from hfscale.train.state import model_fingerprint, save_final

    plan, data, ckpts, resume = pre.plan, pre.data, pre.ckpts, pre.resume
    # --- launch: process group (gloo on CPU hosts), clean output dir, batch arithmetic ---
    accelerator = start_run(cfg, force, pre, tag="distill_clm")
    main_rank = accelerator.is_main_process
    out = Path(cfg.output_dir)

    # --- data: the token store's packed rows, as train_clm reads them, with the student's tokenizer (pruning keeps
    # the vocabulary): masks, documents apart in student and teacher, CE and KL over the trained tokens ---
    tokenizer = data.tokenizer
    rows = run_rows(store, plan, cfg.seed, cfg.max_train_blocks, cfg.eval_blocks)
    val_blocks = rows.val

    # --- models: trainable student (checkpointing and the levers on it), frozen teacher (replicated, or partitioned
    # by its own ZeRO-3 engine) ---
    run = prepare_training(accelerator, cfg, pre, build_model(cfg.model, seed=cfg.seed))
    model, optimizer, n_student = run.model, run.optimizer, run.params
    teacher = load_teacher(cfg.teacher, accelerator.device, cfg.teacher_placement)
    shares = gather_shares(accelerator, teacher)
    n_teacher = shares[0].total_numel
    held = "replicated" if cfg.teacher_placement == "replicated" else \
        "ZeRO-3: per rank " + ", ".join(f"{s.numel:,}" for s in shares) + " elements"
    if main_rank:
        print(f"[distill_clm] student {cfg.model}: {n_student:,} params; teacher {cfg.teacher}: {n_teacher:,} params "
              f"(frozen, {held}); KL weight {1 - cfg.ce_weight:g} at T={cfg.temperature:g}, CE weight {cfg.ce_weight:g}; "
              f"AdamW {run.adamw}{run.facts()}")
    start = resume_from(accelerator, resume, "distill_clm")
    log = MetricsLog(out / "metrics.jsonl", enabled=main_rank)
    meta = {"model": cfg.model, "teacher": cfg.teacher, "model_fingerprint": model_fingerprint(pre.model_config),
            "world": plan.world, "tokens_per_step": plan.tokens_per_step, "data_key": store.key}

    def eval_record(step: int, **extra) -> dict:
        ce = evaluate(model, accelerator, val_blocks, plan.micro_batch)
        kl = heldout_kl(model, teacher, accelerator, val_blocks, plan.micro_batch, cfg.temperature)
        rec = {"kind": "eval", "step": step, "loss": ce, "ppl": math.exp(ce), "kl": kl, **extra}
        log.write(rec)
        return rec

    # --- train: the student before any step is the baseline the report compares with ---
    first = eval_record(start, start=True)
    train_steps(accelerator, model, optimizer, cfg, plan, rows.train, val_blocks, ckpts, log, start, meta,
                run.wrap(kd_loss_fn(teacher, cfg)), tag="distill_clm", read_batch=rows.reader.batch, step_tokens=rows.reader.trained)

    # --- evaluate and save (consolidated: ZeRO shards gathered on the main rank) ---
    last = eval_record(cfg.max_steps, final=True)
    teacher_ce = evaluate(teacher, accelerator, val_blocks, plan.micro_batch)
    shares = gather_shares(accelerator, teacher)  # after every forward: what stays resident between them
    saved = save_final(accelerator, model, tokenizer, out / "model")
    if main_rank:
        from hfscale.util.atomic import write_text_atomic

        report = {"teacher": cfg.teacher, "student": cfg.model, "steps": cfg.max_steps, "world": accelerator.num_processes,
                  "tokens_per_step": plan.tokens_per_step, "eval_tokens": rows.val_trained,
                  "params": {"teacher": n_teacher, "student": n_student},
                  "perplexity": {"teacher": math.exp(teacher_ce), "student_start": first["ppl"], "student_end": last["ppl"]},
                  "kl_to_teacher": {"start_step": first["step"], "start": first["kl"], "end": last["kl"]},
                  "teacher_placement": cfg.teacher_placement, "teacher_per_rank": [vars(s) for s in shares],
                  "resumed_at": start or None}
        write_text_atomic(out / "quality.json", json.dumps(report, indent=1) + "\n")
        print(f"[distill_clm] held-out perplexity: teacher {math.exp(teacher_ce):.2f}, student {first['ppl']:.2f} "
              f"(step {first['step']}) -> {last['ppl']:.2f}; KL to teacher {first['kl']:.4f} -> {last['kl']:.4f}")
        print(f"[distill_clm] saved {saved['path']}: {saved['numel']:,} parameter elements, {saved['bytes'] / 1e6:.1f} MB")
    accelerator.end_training()
    return 0


if __name__ == "__main__":  # every rank ends through exit_rank: no interpreter finalization to race gloo's threads
    from hfscale.scale.runtime import exit_rank

    exit_rank(main())
