"""The baseline for benchmarks/train_recipe.py: the smallest correct accelerate loop on the same
model, data order and batch shape as recipes/train_clm.py — no logging, eval, checkpoints or
metrics. Prints one JSON line with per-step wall times.

    accelerate launch --config_file accelerate_configs/zero2.yaml --num_processes 2 \
        benchmarks/scripts/hand_loop.py --steps 20 --seq-len 128 --micro-batch 4 --accum 2
"""

import argparse
import json
import os
import time

import torch

from hfscale.data.corpus import load_text, packed_blocks
from hfscale.models import TINY, build_model, load_tokenizer
from hfscale.scale.runtime import exit_rank, make_accelerator, make_optimizer
from hfscale.data.sampler import BatchPlan, rank_indices

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=20)
p.add_argument("--seq-len", type=int, default=128)
p.add_argument("--micro-batch", type=int, default=4)
p.add_argument("--accum", type=int, default=2)
p.add_argument("--lr", type=float, default=3e-3)
args = p.parse_args()

accelerator = make_accelerator(gradient_accumulation_steps=args.accum)
plugin = getattr(accelerator.state, "deepspeed_plugin", None)
if plugin is not None:
    plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = args.micro_batch
plan = BatchPlan(args.micro_batch, args.accum, accelerator.num_processes, args.seq_len)
blocks = packed_blocks(load_tokenizer(TINY), load_text()["train"]["text"], args.seq_len)[:400]
model = build_model(TINY, seed=0)
optimizer = make_optimizer(accelerator, model, lr=args.lr)
model, optimizer = accelerator.prepare(model, optimizer)
model.train()
times, cpu = [], []
for step in range(args.steps):
    t0, c0 = time.perf_counter(), time.process_time()
    for micro in range(args.accum):
        batch = blocks[rank_indices(plan, len(blocks), 0, step, micro, accelerator.process_index)]
        with accelerator.accumulate(model):
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    times.append(time.perf_counter() - t0)
    cpu.append(time.process_time() - c0)
if accelerator.is_main_process:
    print("HAND_LOOP " + json.dumps({"step_s": times, "cpu_s": cpu, "tokens_per_step": plan.tokens_per_step,
                                      "world": accelerator.num_processes, "pid": os.getpid()}))
accelerator.end_training()
exit_rank(0)  # as the recipes end: no interpreter finalization for gloo's threads to race
