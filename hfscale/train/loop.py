"""The pieces both recipes (train_clm.py, qat_clm.py) run: pre-flight, launch, the step loop, and
evaluation. The recipes stay readable scripts that say *what* happens in which order; this module
holds *how*, once.

The step loop: every optimizer step reads `accum` micro batches per rank, chosen as a pure function
of (seed, step, micro, rank) so a resumed run reads exactly what an uninterrupted one would; loss and
peak memory travel in one collective per step; checkpoints are complete-or-absent (train.state).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path


def lr_at(step: int, cfg) -> float:
    """Linear warm-up over warmup_steps, then cosine from lr down to lr x min_lr_ratio at max_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def preflight(cfg, force: bool):
    """Every check that can fail on the user's input, before a process group or a model exists."""
    from ..corpus import load_text
    from ..errors import HfscaleError
    from ..models import load_config
    from .batching import plan_batch
    from .state import Checkpoints, model_fingerprint

    world = int(os.environ.get("WORLD_SIZE", "1"))
    model_config = load_config(cfg.model)
    limit = getattr(getattr(model_config, "text_config", None) or model_config, "max_position_embeddings", None)
    if limit and cfg.seq_len > limit:
        raise HfscaleError(f"seq_len {cfg.seq_len} is longer than {cfg.model} supports ({limit}); use --seq-len {limit} or less")
    plan = plan_batch(cfg.global_batch_tokens, cfg.seq_len, world, cfg.micro_batch)
    data = load_text(cfg.data, cfg.validation)  # missing or unreadable files fail here
    ckpts = Checkpoints(cfg.output_dir, cfg.keep_last)
    resume = ckpts.resolve(cfg.resume, model_fingerprint(model_config))
    out = Path(cfg.output_dir)
    if resume is None and not force and (ckpts.complete() or (out / "model").exists()):
        raise HfscaleError(f"{out} already holds a run; pass --resume latest to continue it, --force to start over, "
                           "or another --output-dir")
    if cfg.doctor:
        run_doctor(cfg, plan, world)
    return model_config, plan, data, ckpts, resume


def run_doctor(cfg, plan, world: int) -> None:
    """hfscale doctor on what this launch will use: the DeepSpeed JSON, the model and the batch shape."""
    from ..doctor import check
    from ..errors import HfscaleError

    ds_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    with tempfile.TemporaryDirectory() as tmp:
        args_file = Path(tmp) / "recipe_args.json"
        args_file.write_text(json.dumps({
            "per_device_train_batch_size": plan.micro_batch,
            "gradient_accumulation_steps": plan.accum,
            "bf16": os.environ.get("ACCELERATE_MIXED_PRECISION", "no") == "bf16" or bool(ds_file),
            "gradient_checkpointing": cfg.checkpointing != "off",
        }))
        findings = check(deepspeed=ds_file if ds_file and Path(ds_file).is_file() else None, args=args_file,
                         model=cfg.model, num_processes=world)
    errors = [f for f in findings if f.severity == "error"]
    if errors:
        f = errors[0]
        raise HfscaleError(f"hfscale doctor: {f.where}: {f.what}; {f.fix} (run `hfscale doctor` for all findings)")


def start_run(cfg, force: bool, plan, ckpts, resume, tag: str):
    """Accelerator (right on CPU hosts too), a clean OUTPUT_DIR on the main rank, the batch arithmetic printed."""
    from ..scale.runtime import make_accelerator

    accelerator = make_accelerator(gradient_accumulation_steps=plan.accum)
    out = Path(cfg.output_dir)
    if accelerator.is_main_process:
        if force and resume is None:
            for old in (out / "checkpoints", out / "model", out / "metrics.jsonl"):
                shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)
        gone = ckpts.clean_partial()
        out.mkdir(parents=True, exist_ok=True)
        (out / "recipe.json").write_text(json.dumps({k: v for k, v in vars(cfg).items() if k != "extra"}, indent=1))
        print(f"[{tag}] {accelerator.distributed_type} world {accelerator.num_processes}: {plan.arithmetic()}")
        for g in gone:
            print(f"[{tag}] removed the interrupted save {g.name}")
    accelerator.wait_for_everyone()
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None:  # no DataLoader goes through prepare(), so DeepSpeed's "auto" micro batch is set here
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = plan.micro_batch
    return accelerator


def load_blocks(cfg, tokenizer, data):
    """Train and held-out blocks: tokenised, packed to seq_len, bos ... eos per document."""
    from ..corpus import packed_blocks

    train_blocks = packed_blocks(tokenizer, data["train"]["text"], cfg.seq_len)
    if cfg.max_train_blocks:
        train_blocks = train_blocks[: cfg.max_train_blocks]
    return train_blocks, packed_blocks(tokenizer, data["validation"]["text"], cfg.seq_len)[: cfg.eval_blocks]


def evaluate(model, accelerator, val, micro_batch: int) -> float:
    """Mean next-token loss over the held-out blocks; every rank scores an equal share."""
    import torch

    world, rank = accelerator.num_processes, accelerator.process_index
    share = len(val) // world
    mine = val[rank * share : (rank + 1) * share]
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    model.eval()
    with torch.no_grad():
        for i in range(0, share, micro_batch):
            batch = mine[i : i + micro_batch].to(accelerator.device)
            loss = model(input_ids=batch, labels=batch).loss
            total += torch.tensor([loss.item() * len(batch), len(batch)], dtype=torch.float64, device=total.device)
    model.train()
    total = accelerator.reduce(total, reduction="sum")
    return float(total[0] / total[1])


def lm_loss(model, batch):
    return model(input_ids=batch, labels=batch).loss


def resume_from(accelerator, resume, tag: str) -> int:
    if resume is None:
        return 0
    path, meta = resume
    accelerator.load_state(str(path))
    if accelerator.is_main_process:
        print(f"[{tag}] resumed from {path} at step {meta['step']}")
    return meta["step"]


def train_steps(accelerator, model, optimizer, cfg, plan, train_blocks, val_blocks, ckpts, log, start: int,
                meta: dict, loss_fn=lm_loss) -> None:
    """Steps start..max_steps: accumulate, clip (DeepSpeed clips per its JSON), log, evaluate, checkpoint."""
    import torch
    from tqdm.auto import tqdm

    from .batching import rank_indices
    from .metrics import peak_memory_bytes
    from .state import fault

    deepspeed = getattr(accelerator.state, "deepspeed_plugin", None) is not None
    model.train()
    bar = tqdm(total=cfg.max_steps, initial=start, desc="train", disable=not (accelerator.is_main_process and cfg.progress))
    for step in range(start, cfg.max_steps):
        t0, c0 = time.perf_counter(), time.process_time()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        step_loss = torch.zeros((), dtype=torch.float64, device=accelerator.device)
        for micro in range(plan.accum):
            idx = rank_indices(plan, len(train_blocks), cfg.seed, step, micro, accelerator.process_index)
            batch = train_blocks[idx].to(accelerator.device)
            with accelerator.accumulate(model):
                loss = loss_fn(model, batch)
                accelerator.backward(loss)
                if accelerator.sync_gradients and not deepspeed:
                    accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            step_loss += loss.detach().double() / plan.accum
        # one collective per step: every rank's mean loss (-> the global-batch loss) and its peak memory
        peak, kind = peak_memory_bytes()
        mine = torch.stack([step_loss, torch.tensor(float(peak), dtype=torch.float64, device=step_loss.device)])
        every = accelerator.gather(mine.unsqueeze(0))
        step_loss, peak = float(every[:, 0].mean()), int(every[:, 1].max())
        done = step + 1
        if done % cfg.log_every == 0 or done == cfg.max_steps:
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            log.write({"kind": "train", "step": done, "loss": step_loss, "lr": lr_at(step, cfg),
                       "tokens_per_s": plan.tokens_per_step / dt, "step_s": dt, "cpu_s": cpu, "peak_mem_bytes": peak, "mem": kind,
                       "tokens_seen": done * plan.tokens_per_step})
        bar.update(1)
        bar.set_postfix(loss=f"{step_loss:.3f}")
        fault("step", done, accelerator.process_index)
        if cfg.eval_every and done % cfg.eval_every == 0 and done < cfg.max_steps:
            ev = evaluate(model, accelerator, val_blocks, plan.micro_batch)
            log.write({"kind": "eval", "step": done, "loss": ev, "ppl": math.exp(ev)})
        if cfg.save_every and (done % cfg.save_every == 0 or done == cfg.max_steps):
            ckpts.save(accelerator, done, meta)
    bar.close()
