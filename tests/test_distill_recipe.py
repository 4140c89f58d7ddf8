"""recipes/distill_clm.py for real: a pruned tiny Gemma 3 distilled from its trained teacher on 2
processes under ZeRO-2 (accelerate launch + DeepSpeed over gloo), killed with SIGKILL on one rank,
resumed with --resume latest, consolidated, saved and reloaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "distill_clm.py"
YAML = ROOT / "recipes" / "tiny" / "distill.yaml"
FAST = ["--seq-len", "64", "--global-batch-tokens", "512", "--micro-batch", "2", "--eval-blocks", "8",
        "--eval-every", "0", "--progress", "false", "--lr", "2e-3", "--warmup-steps", "1"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(teacher dir, student dir): a briefly trained tiny model (40 steps: a teacher whose distribution
    has structure, built in ~1 min) and its --params 0.5x pruning."""
    from hfscale.compress.evaluate import calibration_blocks
    from hfscale.compress.prune import PruneTarget, prune
    from hfscale.compress.save import save_model_dir
    from hfscale.models import load_for_eval
    from hfscale.testing.trained import TinyTraining, trained_tiny

    teacher = str(trained_tiny(TinyTraining(steps=40, batch=8, warmup=5), progress=False))
    model, tok = load_for_eval(teacher)
    small, r = prune(model, PruneTarget(params=0.5), calibration_blocks(tok, 8, 64))
    student = tmp_path_factory.mktemp("distill") / "student"
    save_model_dir(small, student, tokenizer=tok)
    return teacher, str(student), r.params_after


def _launch(out: Path, *args, fault=None):
    from hfscale.proofs.engine import free_port

    script = [str(ROOT / "tests" / "scripts" / "faulty_recipe.py"), fault, str(RECIPE)] if fault else [str(RECIPE)]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "accelerate_configs/zero2.yaml"),
           "--num_processes", "2", "--num_machines", "1", "--machine_rank", "0", "--main_process_port", str(free_port()),
           *script, "--config", str(YAML), "--output-dir", str(out), *FAST, *map(str, args)]
    log = out.parent / f"{out.name}.log"
    with open(log, "a") as f:  # a file, not a pipe: a full pipe can stall a multi-process launch
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, timeout=900,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}).returncode
    return rc, log.read_text()


@pytest.mark.engine
def test_distill_zero2_two_processes_kill_resume_save(tmp_path, pair):
    import torch
    from transformers import AutoModelForCausalLM

    from hfscale.models.loss import lm_loss, trained_tokens
    from hfscale.train.metrics import read_records
    from hfscale.train.state import saved_numel

    teacher, student, n_student = pair
    out = tmp_path / "run"
    # checkpointing on the student, as train_clm applies it (hfscale.train.prepare; once accepted and ignored here)
    common = ["--model", student, "--teacher", teacher, "--max-steps", "4", "--save-every", "2", "--keep-last", "1",
              "--checkpointing", "full"]
    rc, log = _launch(out, *common, fault="kill@step:3:1")  # SIGKILL rank 1 after step 3 (checkpoint at 2)
    assert rc != 0 and (out / "checkpoints" / "step_00000002").is_dir(), log[-3000:]
    rc, log = _launch(out, *common, "--resume", "latest")
    assert rc == 0, log[-3000:]
    assert "DistributedType.DEEPSPEED world 2: 2 micro × 2 accum × 2 ranks × 64 = 512 tokens/step" in log
    assert f"student {student}: {n_student:,} params" in log and "(frozen, replicated)" in log
    assert "AdamW fused; checkpointed layers [0, 1, 2, 3]" in log
    assert "resumed from" in log and "at step 2" in log
    assert sorted(read_records(out / "metrics.jsonl")) == [1, 2, 3, 4]
    ev = read_records(out / "metrics.jsonl", "eval")
    assert ev[0]["start"] and ev[4]["final"]
    assert ev[4]["kl"] < 0.8 * ev[0]["kl"], (ev[0], ev[4])  # the student moved toward the teacher
    assert ev[4]["loss"] < ev[0]["loss"]  # and its held-out cross-entropy improved
    report = json.loads((out / "quality.json").read_text())
    assert report["world"] == 2 and report["resumed_at"] == 2
    assert report["kl_to_teacher"]["start_step"] == 2 and report["kl_to_teacher"]["end"] == pytest.approx(ev[4]["kl"])
    assert report["perplexity"]["teacher"] < report["perplexity"]["student_end"]  # half the parameters, 4 steps
    # the consolidated save is the whole student and scores what the run scored
    assert saved_numel(out / "model")[0] == n_student
    back = AutoModelForCausalLM.from_pretrained(out / "model").eval()
    from test_qat_recipe import held_out

    val = held_out(student, "builtin", 8)  # the run's token store: its first 8 held-out rows, packed
    with torch.no_grad():
        ce = sum(float(lm_loss(back, b, 1)) for b in val) / sum(int(trained_tokens(b["labels"])) for b in val)
    assert abs(ce - ev[4]["loss"]) < 1e-3
    assert report["eval_tokens"] == sum(int(trained_tokens(b["labels"])) for b in val)


def test_distill_refuses_bad_pairs(tmp_path, pair):
    teacher, student, _ = pair
    for extra, needle in [(["--teacher", ""], "needs a teacher"),
                          (["--teacher", "gemma-4-e2b"], "vocabulary of 262,144 tokens"),
                          (["--ce-weight", "1"], "ce_weight must be in [0, 1)")]:
        r = subprocess.run([sys.executable, str(RECIPE), "--config", str(YAML), "--model", student, "--teacher", teacher,
                            "--output-dir", str(tmp_path / "o"), *extra], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "HF_HUB_OFFLINE": "1"})
        lines = [ln for ln in r.stderr.splitlines() if ln.startswith("distill_clm")]
        assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr[-2000:]
        assert not (tmp_path / "o").exists()
