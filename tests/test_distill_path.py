"""prune -> distill -> QAT Q4_0 -> GGUF, the documented path, run end to end on the tiny model through
the commands a user types; and the teacher of the distillation sharded under DeepSpeed ZeRO-3.

- `hfscale prune TEACHER --params 0.5x --out student`
- `accelerate launch --config_file accelerate_configs/zero2.yaml --num_processes 2 recipes/distill_clm.py ...`
  twice, student under ZeRO-2 both times: --teacher-placement replicated and zero3. The zero3 ranks
  each hold their 1/2 partition of every teacher tensor (numel and bytes per rank, nothing whole left
  resident), and the run's losses equal the replicated run's.
- `recipes/qat_clm.py --scheme q4_0` on the distilled model (one process here: the launcher is the
  only difference from the documented 2-process command, and it is proven for QAT in test_qat_recipe.py)
- `hfscale quantize ... --format gguf --qtype Q4_0`, then the GGUF opened in llama.cpp and its logits
  and perplexity compared with the QAT student's in transformers and with the distilled student's.
Teacher: the 40-step trained tiny Gemma 3 that tests/test_distill_recipe.py uses (cached)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DISTILL, QAT = ROOT / "recipes" / "distill_clm.py", ROOT / "recipes" / "qat_clm.py"
SMALL = ["--seq-len", "64", "--global-batch-tokens", "512", "--micro-batch", "2", "--eval-blocks", "8",
         "--eval-every", "0", "--save-every", "0", "--progress", "false", "--lr", "2e-3", "--warmup-steps", "1",
         "--max-steps", "3"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _run(cmd, log: Path):
    with open(log, "w") as f:  # a file, not a pipe: a full pipe can stall a multi-process launch
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, timeout=900, env=ENV).returncode
    return rc, log.read_text()


def _launch_distill(out: Path, student: str, teacher: str, placement: str):
    from hfscale.proofs.engine import free_port

    return _run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                 str(ROOT / "accelerate_configs/zero2.yaml"), "--num_processes", "2", "--num_machines", "1",
                 "--machine_rank", "0", "--main_process_port", str(free_port()), str(DISTILL),
                 "--config", str(ROOT / "recipes/tiny/distill.yaml"), "--model", student, "--teacher", teacher,
                 "--output-dir", str(out), "--teacher-placement", placement, *SMALL], out.parent / f"{out.name}.log")


@pytest.fixture(scope="module")
def path_runs(tmp_path_factory):
    """The pruned student (hfscale prune) and the two 2-process distillation runs."""
    from conftest import run_cli as cli

    from hfscale.testing.trained import TinyTraining, trained_tiny

    d = tmp_path_factory.mktemp("path")
    teacher = str(trained_tiny(TinyTraining(steps=40, batch=8, warmup=5), progress=False))
    r = cli("prune", teacher, "--params", "0.5x", "--out", d / "student", "--calib-blocks", "8", "--seq-len", "64", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    pruned = json.loads(r.stdout)
    runs = {}
    for placement in ("replicated", "zero3"):
        rc, log = _launch_distill(d / placement, str(d / "student"), teacher, placement)
        assert rc == 0, log[-3000:]
        runs[placement] = (d / placement, log)
    return teacher, d, pruned, runs


@pytest.mark.engine
def test_teacher_zero3_holds_its_partition_and_gives_the_replicated_loss(path_runs):
    from hfscale.train.metrics import read_records

    teacher, _, pruned, runs = path_runs
    n = pruned["params_before"]  # the teacher's parameter count (it is what was pruned)
    rep, z3 = (json.loads((runs[p][0] / "quality.json").read_text()) for p in ("replicated", "zero3"))
    assert rep["world"] == z3["world"] == 2 and (rep["teacher_placement"], z3["teacher_placement"]) == ("replicated", "zero3")
    # replicated: every rank holds every element; zero3: each rank its padded half of every tensor, none whole
    from transformers import AutoModelForCausalLM

    sizes = [p.numel() for p in AutoModelForCausalLM.from_pretrained(teacher).parameters()]
    assert sum(sizes) == n
    half = sum(math.ceil(s / 2) for s in sizes)  # DeepSpeed pads each partition to ceil(numel / world)
    assert [s["rank"] for s in z3["teacher_per_rank"]] == [0, 1]
    for s in rep["teacher_per_rank"]:
        assert (s["numel"], s["bytes"], s["resident_numel"], s["total_numel"]) == (n, 4 * n, n, n)
    for s in z3["teacher_per_rank"]:
        assert (s["numel"], s["bytes"], s["resident_numel"], s["total_numel"]) == (half, 4 * half, 0, n)
        assert s["numel"] < 0.51 * n
    assert f"ZeRO-3: per rank {half:,}, {half:,} elements" in runs["zero3"][1] and "(frozen, replicated)" in runs["replicated"][1]
    # the same losses: the teacher's logits are the whole model's either way (fp32; 1e-5 relative)
    lr_, lz = (read_records(runs[p][0] / "metrics.jsonl") for p in ("replicated", "zero3"))
    assert sorted(lr_) == sorted(lz) == [1, 2, 3]
    for step in lr_:
        assert lz[step]["loss"] == pytest.approx(lr_[step]["loss"], rel=1e-5), step
    er, ez = (read_records(runs[p][0] / "metrics.jsonl", "eval") for p in ("replicated", "zero3"))
    for step in (0, 3):
        assert ez[step]["kl"] == pytest.approx(er[step]["kl"], rel=1e-5) and ez[step]["loss"] == pytest.approx(er[step]["loss"], rel=1e-5)
    assert z3["perplexity"]["teacher"] == pytest.approx(rep["perplexity"]["teacher"], rel=1e-6)
    assert ez[3]["kl"] < ez[0]["kl"]  # and it distils: the student moved toward the teacher


@pytest.mark.engine
def test_prune_distill_qat_q4_0_gguf_path(path_runs, cli):
    import numpy as np
    import torch

    from hfscale.compress.evaluate import EvalData, heldout_blocks, perplexity
    from hfscale.export.sidecar import sidecar_path
    from hfscale.export.verify_llama import llama_logits, open_llama
    from hfscale.models import load_for_eval

    _, d, _, runs = path_runs
    distilled = runs["zero3"][0] / "model"
    rc, log = _run([sys.executable, str(QAT), "--config", str(ROOT / "recipes/tiny/qat.yaml"), "--model", str(distilled),
                    "--scheme", "q4_0", "--output-dir", str(d / "qat"), "--ptq-baseline", "false", "--lr", "1e-4",
                    *SMALL[:-6], "--max-steps", "2", "--warmup-steps", "1"], d / "qat.log")
    assert rc == 0, log[-3000:]
    gguf = d / "student-Q4_0.gguf"
    r = cli("quantize", d / "qat" / "quantized", "--format", "gguf", "--qtype", "Q4_0", "--out", gguf)
    assert r.returncode == 0, r.stderr[-2000:]
    # the GGUF in llama.cpp against the QAT student (same weights on Q4_0's grid) and the distilled student
    qat, tok = load_for_eval(str(d / "qat" / "quantized"))
    student, _ = load_for_eval(str(distilled))
    blocks = heldout_blocks(tok, EvalData(n_blocks=8, seq_len=64))
    nll, n = 0.0, 0
    top1 = []
    with open_llama(gguf, n_ctx=64) as llm:
        for b in blocks.tolist():
            lg = llama_logits(llm, b)
            with torch.no_grad():
                ref = qat(input_ids=torch.tensor([b])).logits[0].numpy()
            top1.append(float((lg.argmax(-1) == ref.argmax(-1)).mean()))
            logp = lg[:-1] - np.logaddexp.reduce(lg[:-1], axis=-1, keepdims=True)
            nll -= float(logp[np.arange(len(b) - 1), b[1:]].sum())
            n += len(b) - 1
    ppl_gguf, ppl_qat, ppl_student = math.exp(nll / n), perplexity(qat, blocks), perplexity(student, blocks)
    assert np.mean(top1) > 0.9, top1  # Q4_0 weights are the QAT grid's; the token embedding is Q8_0 in the file
    assert abs(ppl_gguf / ppl_qat - 1) < 0.02, (ppl_gguf, ppl_qat)
    assert abs(ppl_gguf / ppl_student - 1) < 0.10, (ppl_gguf, ppl_student)  # 4-bit costs little after QAT
    assert ppl_student < 0.5 * len(tok)  # the student learnt something: far below a uniform guess
    # hfscale quantize's own check in llama.cpp (its sidecar) says the same
    side = json.loads(sidecar_path(gguf).read_text())["verification"]
    assert side["perplexity"] == pytest.approx(side["perplexity_transformers_fp32"], rel=0.02)


def test_teacher_placement_refusals(tmp_path):
    """One line, exit 2, nothing written: an unknown placement, and zero3 outside a DeepSpeed launch."""
    for extra, needle in [(["--teacher-placement", "sharded"], "teacher_placement 'sharded' not understood"),
                          (["--teacher-placement", "zero3"], "not a DeepSpeed launch")]:
        env = {k: v for k, v in ENV.items() if not k.startswith("ACCELERATE_")}
        r = subprocess.run([sys.executable, str(DISTILL), "--config", str(ROOT / "recipes/tiny/distill.yaml"),
                            "--model", "tiny-gemma3", "--teacher", "tiny-gemma3", "--output-dir", str(tmp_path / "o"),
                            *extra], capture_output=True, text=True, timeout=300, env=env)
        lines = [ln for ln in r.stderr.splitlines() if ln.startswith("distill_clm")]
        assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr[-2000:]
        assert not (tmp_path / "o").exists()
