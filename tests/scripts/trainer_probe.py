"""Launched by tests/test_engine.py under `accelerate launch --config_file accelerate_configs/zero2.yaml`:
HF Trainer with the shipped ds_configs/zero2.json (its "auto" values filled by Trainer) on 2 processes."""

import json
import sys
from pathlib import Path

import torch
from transformers import Trainer, TrainingArguments

from hfscale.data.corpus import load_text, packed_blocks
from hfscale.models import build_model, load_tokenizer
from hfscale.scale.presets import PRESETS
from hfscale.scale.runtime import exit_rank, training_arguments_kwargs

out, ds_file = Path(sys.argv[1]), sys.argv[2]
tok = load_tokenizer("tiny-gemma3")
blocks = packed_blocks(tok, load_text()["train"]["text"][:200], 64)[:32]


class Blocks(torch.utils.data.Dataset):
    def __len__(self):
        return len(blocks)

    def __getitem__(self, i):
        return {"input_ids": blocks[i], "labels": blocks[i]}


kw = training_arguments_kwargs(PRESETS["zero2"])
kw["deepspeed"] = ds_file
args = TrainingArguments(output_dir=str(out / "trainer"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                         max_steps=3, learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no",
                         dataloader_drop_last=True, **kw)
trainer = Trainer(model=build_model("tiny-gemma3"), args=args, train_dataset=Blocks())
trainer.train()
engine = trainer.model_wrapped
cfg = trainer.accelerator.state.deepspeed_plugin.deepspeed_config
report = {
    "rank": args.process_index,
    "args_world_size": args.world_size,
    "accelerate_num_processes": trainer.accelerator.num_processes,
    "engine_world_size": engine.world_size,
    "zero_stage": engine.zero_optimization_stage(),
    "train_batch_size": cfg["train_batch_size"],
    "micro": cfg["train_micro_batch_size_per_gpu"],
    "gradient_accumulation_steps": cfg["gradient_accumulation_steps"],
    "reduce_bucket_size": cfg["zero_optimization"]["reduce_bucket_size"],
    "bf16": engine.bfloat16_enabled(),
    "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
}
(out / f"trainer_rank{args.process_index}.json").write_text(json.dumps(report))
exit_rank(0)  # a launched script's last line: no interpreter finalization for gloo's threads to race
