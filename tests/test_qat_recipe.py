"""recipes/qat_clm.py for real: 2 processes under ZeRO-2 (accelerate launch + DeepSpeed over gloo),
fine-tuning the trained tiny Gemma 3 against the 8da4w grid, converting, saving and reporting; the data through
train_clm's token store (text here, chat with its masks in the 1-process run)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "qat_clm.py"
QAT_YAML = ROOT / "recipes" / "tiny" / "qat.yaml"
FAST = ["--seq-len", "64", "--global-batch-tokens", "512", "--micro-batch", "2", "--eval-blocks", "8",
        "--eval-every", "0", "--save-every", "0", "--progress", "false"]


@pytest.fixture(scope="module")
def trained():
    from hfscale.testing.trained import trained_tiny

    return str(trained_tiny())


def test_recipe_refuses_a_random_init_and_bad_settings(tmp_path):
    for extra, needle in [(["--model", "tiny-gemma3"], "random init"),
                          (["--scheme", "nf4"], "no QAT form"),
                          (["--distill", "1.5"], "distill must be in [0, 1]")]:
        r = subprocess.run([sys.executable, str(RECIPE), "--config", str(QAT_YAML), "--output-dir", str(tmp_path / "o"), *extra],
                           capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
        lines = [ln for ln in r.stderr.splitlines() if ln.startswith("qat_clm")]
        assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr
        assert "Traceback" not in r.stderr and not (tmp_path / "o").exists()


@pytest.mark.engine
def test_qat_recipe_zero2_two_processes(tmp_path, trained):
    from transformers import AutoModelForCausalLM

    from hfscale.compress.evaluate import perplexity
    from hfscale.proofs.engine import free_port
    from hfscale.train.metrics import read_records

    out = tmp_path / "qat"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "accelerate_configs/zero2.yaml"),
           "--num_processes", "2", "--num_machines", "1", "--machine_rank", "0", "--main_process_port", str(free_port()),
           str(RECIPE), "--config", str(QAT_YAML), "--model", trained, "--output-dir", str(out), "--max-steps", "4",
           "--lr", "1e-3", *FAST]
    log = tmp_path / "qat.log"
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, timeout=900,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}).returncode
    text = log.read_text()
    assert rc == 0, text[-3000:]
    assert "DistributedType.DEEPSPEED world 2: 2 micro × 2 accum × 2 ranks × 64 = 512 tokens/step" in text
    assert "fake-quantized for 8da4w (group 32), 3,001,920 trainable params" in text
    assert sorted(read_records(out / "metrics.jsonl")) == [1, 2, 3, 4]
    report = json.loads((out / "quality.json").read_text())
    ppl = report["perplexity"]
    val = held_out(trained, "builtin", 8)
    # the store's first 8 held-out rows (text, wrapped): every token but each segment's first is scored
    assert set(ppl) == {"float", "ptq", "qat"} and report["eval_tokens"] == trained_in(val) > 8 * 60
    assert ppl["ptq"] != ppl["qat"]  # the converted weights are the trained ones, not a PTQ of the start
    # what was saved is what was scored: reload and recompute on the same held-out blocks
    back = AutoModelForCausalLM.from_pretrained(out / "quantized").eval()
    assert type(back.model.layers[1].self_attn.o_proj.weight).__name__ == "IntxUnpackedToInt8Tensor"
    assert abs(perplexity(back, val) - ppl["qat"]) < 1e-6 * ppl["qat"]
    assert "PTQ loss recovered by QAT" in text
    with torch.no_grad():
        assert torch.isfinite(back(input_ids=val[0]["input_ids"][:1]).logits).all()


def held_out(model: str, data: str, rows: int, **options) -> list:
    """The run's held-out micro batches (2 rows each), from its token store (the same key: reused, not rebuilt)."""
    from hfscale.data import PackedDataset
    from hfscale.data.dataset import MicroBatches
    from hfscale.data.recipe import check_data, ready_store
    from hfscale.data.store import DataOptions
    from hfscale.util.cache import cache_root

    store = ready_store(check_data(data, model, DataOptions(64, **options), cache_root()), 0, 1)
    return list(MicroBatches(PackedDataset(store.path, "validation", limit=rows), 2))


def trained_in(batches) -> int:
    return sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)


def test_qat_recipe_lora_and_distillation_in_one_process(tmp_path, trained):
    """The recipe also runs without a launcher (1 process): LoRA adapters on the fake-quantized base,
    half the loss from the teacher's probabilities; the adapters are merged before convert. On the built-in chat
    set through the token store: assistant turns trained, the rest masked (train_clm's data path). Checkpointing and
    the tiled MLP apply here as in train_clm (hfscale.train.prepare; they were once accepted and ignored)."""
    from safetensors import safe_open

    import shutil

    out, model = tmp_path / "qat_lora", tmp_path / "trained_with_template"
    shutil.copytree(trained, model)  # the trained fixture, given the built-in chat template (as train_clm saves it)
    shutil.copy(ROOT / "hfscale" / "models" / "data" / "chat_template.jinja", model / "chat_template.jinja")
    r = subprocess.run([sys.executable, str(RECIPE), "--config", str(QAT_YAML), "--model", str(model), "--output-dir", str(out),
                        "--scheme", "int4wo", "--group-size", "0", "--lora-rank", "4", "--distill", "0.5", "--max-steps", "2",
                        "--lr", "1e-2", *FAST, "--data", "builtin-chat", "--overflow", "split", "--checkpointing", "every:2",
                        "--tiled-mlp", "2", "--tiled-norm", "2", "--offload-activations", "true"], capture_output=True, text=True, cwd=ROOT, timeout=600,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "(LoRA r=4)" in r.stdout and "distill 0.5" in r.stdout
    # every lever it accepts applies (once accepted and ignored): tiled RMSNorm on each decoder norm, the checkpointed
    # layers' inputs in host memory
    assert re.search(r"; checkpointed layers \[0, 2\]; tiled MLP x2 on 4 layers; tiled RMSNorm x2 on \d+ norms; "
                     r"checkpointed activations in host memory", r.stdout), r.stdout[-2000:]
    trainable = int(r.stdout.split("group per-channel), ")[1].split(" trainable")[0].replace(",", ""))
    assert 0 < trainable < 100_000  # adapters only: r x (in + out) per projection, not the 3M base
    with safe_open(str(out / "quantized" / "model.safetensors"), framework="pt") as st:
        keys = list(st.keys())
    assert not any("lora" in k for k in keys)  # merged into the base, then quantized
    report = json.loads((out / "quality.json").read_text())
    assert report["lora_rank"] == 4 and report["distill"] == 0.5 and report["group_size"] == 0
    assert "[qat_clm] data: train: 1,597 examples" in r.stdout and "format messages, train_on assistant" in r.stdout
    val = held_out(str(model), "builtin-chat", 8, overflow="split")
    # scored: the assistant turns of the 8 held-out rows only (user turns and template masked out: ~2/3 of the
    # chat set's tokens train; text would score every token but each segment's first, > 60 of 63 per row)
    assert report["eval_tokens"] == trained_in(val) < 0.8 * 8 * 63


def test_qat_schedule_decays_to_zero_pretraining_does_not():
    """QAT's cosine ends at 0 (benchmarks/compress.py: a constant lr left 8da4w at -3.5% recovered);
    plain training keeps its 10% floor."""
    from hfscale.train.config import QATRecipeConfig, TrainConfig
    from hfscale.train.loop import lr_at

    qat = QATRecipeConfig(max_steps=100, warmup_steps=10, lr=1e-4)
    assert lr_at(100, qat) == 0.0 and 0 < lr_at(99, qat) < 1e-4 * 1e-3
    assert lr_at(10, qat) == pytest.approx(1e-4)
    plain = TrainConfig(max_steps=100, warmup_steps=10, lr=1e-4)
    assert lr_at(100, plain) == pytest.approx(1e-5)
