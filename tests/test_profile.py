"""`hfscale profile` (hfscale/plan/profiler.py): the measured per-rank timeline, and the plan's step peak checked
against it inside real ranks: one process, DDP and DeepSpeed ZeRO over 2 processes (gloo, CPU)."""

import json
import os
import stat

import pytest

from conftest import ROOT, run_cli_concurrently

SMALL = ["--steps", "3", "--micro-batch", "2", "--seq-len", "64"]


def _profile(cli, out, *extra):
    r = cli("profile", *SMALL, "--out", out, *extra, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads((out / "profile.json").read_text()), r


def test_one_process_timeline_equals_the_plan(tmp_path, cli):
    """Full checkpointing at 1 x 32 tokens, where the optimizer step carries the peak (issue 39): the recipe's own
    optimizer (make_optimizer: fused AdamW) is the one the plan traces, and its step matches the plan."""
    doc, r = _profile(cli, tmp_path / "p", "--precision", "fp32", "--checkpointing", "full", "--micro-batch", "1",
                      "--seq-len", "32")
    (row,) = doc["ranks"]
    m, p = row["measured"], row["predicted"]
    assert row["world"] == 1 and row["precision"] == "fp32" and row["compared"] == "device" and row["adamw"] == "fused"
    # the fake-tensor trace of transformers' own code equals the real steps but for a few scalars (at 1 x 32
    # the real backward holds one 4-byte scalar more at its peak; at 2 x 128 they are equal to the byte)
    for key in ("phases", "phases_step1"):
        for ph in m[key]:
            assert abs(p[key][ph] - m[key][ph]) <= 64, (key, ph, p[key], m[key])
    # step 1's peak is its optimizer step (AdamW's moments are made there): within 1% of the plan (measured: equal);
    # the steady optimizer step (fused: in place) is within 1% too, 6.3 MB under backward's peak here
    assert max(m["phases_step1"], key=m["phases_step1"].get) == "optimizer"
    for key in ("phases", "phases_step1"):
        assert abs(p[key]["optimizer"] / m[key]["optimizer"] - 1) <= 0.01
    # step 1 has no AdamW moments until its optimizer step: 2 fp32 moments of 3,001,920 parameters later
    assert m["phases"]["forward"] - m["phases_step1"]["forward"] == 8 * 3_001_920 + 216  # + step counters
    assert sum(m["peak_breakdown"].values()) == m["peak"]
    rank = json.loads((tmp_path / "p" / "ranks" / "rank0.json").read_text())
    labels = {s[1] for s in rank["samples"]}
    assert labels == {f"step {i} {ph}" for i in (1, 2, 3) for ph in ("forward", "backward", "optimizer")}
    # gradients made in backward count as gradients (not temporaries) though each phase has its own context
    assert any(s[2].get("gradients", 0) > 0 for s in rank["samples"] if s[1] == "step 2 backward")
    assert max(sum(s[2].values()) for s in rank["samples"] if s[1].startswith("step 3")) == m["peak"]
    png = (tmp_path / "p" / "timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    for f in ("profile.json", "timeline.png"):
        assert stat.S_IMODE(os.stat(tmp_path / "p" / f).st_mode) == 0o666 & ~_umask()
    assert "plan predicts" in r.stdout and ("(-0.00%)" in r.stdout or "(+0.00%)" in r.stdout)


def _umask() -> int:
    u = os.umask(0)
    os.umask(u)
    return u


@pytest.mark.engine
@pytest.mark.parametrize("config", ["ddp", "zero3", "zero2_offload"])
def test_plan_matches_ranks_of_real_engines(config, tmp_path, cli):
    """Measured inside both ranks of `accelerate launch`: DDP's buckets (C++, read from DDP), DeepSpeed's flat
    master / gradient partitions, ZeRO-3's gathered parameters, CPU offload: the plan within 0.01% on the
    steady peak and 0.5% on step 1 (measured: <= 0.003% / 0.24%), but ZeRO-3's step 1 (below)."""
    doc, _ = _profile(cli, tmp_path / "p", "--config", ROOT / "accelerate_configs" / f"{config}.yaml",
                      "--num-processes", "2", "--precision", "fp32")
    ranks = doc["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world"] == 2 for r in ranks)
    for r in ranks:
        assert r["engine"] == ("MULTI_CPU" if config == "ddp" else "deepspeed")
        assert r["zero"] == {"ddp": 0, "zero3": 3, "zero2_offload": 2}[config]
        # make_optimizer's fused AdamW inside the engine's wrappers; offload runs DeepSpeed's CPU Adam (in place)
        assert r["adamw"] == ("DeepSpeedCPUAdam" if config == "zero2_offload" else "fused")
        assert abs(r["error"]["peak"]) < 1e-4, r
        if config == "zero3":
            # with fused AdamW step 1's peak is ZeRO-3's first backward, which the plan under-predicts: at its start
            # DeepSpeed gathers the tied lm_head (786,432 x 4 = 3,145,728 B, counted as a temporary) that
            # plan/zero.py takes as released in step 1 (measured -5.07%; the for-loop's larger step-1 optimizer
            # peak hid it before issue 39). Held here so that a fix or a change shows; step 1's optimizer step is exact
            m1, p1 = r["measured"]["phases_step1"], r["predicted"]["phases_step1"]
            assert abs(p1["optimizer"] / m1["optimizer"] - 1) < 1e-4 and -0.06 < r["error"]["peak_step1"] < -0.04, r
        else:
            assert abs(r["error"]["peak_step1"]) < 5e-3, r
    if config == "ddp":  # DDP's first buckets are invisible to MemTracker: read from DDP, one gradient copy
        assert ranks[0]["invisible_to_tracker"] == {"ddp_buckets": 4 * 3_001_920}
    if config == "zero2_offload":  # measured on one memory: the device part + what offload moved to the host
        assert ranks[0]["compared"].startswith("device + offloaded") and ranks[0]["predicted"]["offloaded_per_rank"] > 0
    # ZeRO-3 holds a half of every partition: its steady peak is below DDP's full replica (same shape)
    if config == "zero3":
        p = ranks[0]["predicted"]["peak_breakdown"]
        assert p["master_weights"] == p["param_partition"] == 4 * 1_500_960


def test_bad_input_is_one_line_and_writes_nothing(tmp_path):
    out, kept = tmp_path / "p", tmp_path / "kept" / "p"
    kept.mkdir(parents=True)
    (kept / "keep").write_text("x")
    cases = ((["--steps", "0"], "--steps"), (["--checkpointing", "every:0"], "every"),
             (["--config", tmp_path / "missing.yaml"], "not found"), (["--model", tmp_path / "nope"], "not found"))
    # the five real CLI runs at once (their imports overlap); none of them may write, so the checks after all five
    # see what any one of them wrote
    *runs, r = run_cli_concurrently(*[("profile", *args, "--out", out) for args, _ in cases], ("profile", "--out", kept))
    for (args, word), bad in zip(cases, runs, strict=True):
        assert bad.returncode == 2 and word in bad.stderr, (args, bad.stderr)
        assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr
    assert not out.exists() and os.listdir(tmp_path) == ["kept"]
    assert r.returncode == 2 and "--force" in r.stderr and os.listdir(kept) == ["keep"] and (kept / "keep").read_text() == "x"


@pytest.mark.engine
def test_recipe_profile_memory(tmp_path):
    """recipes/train_clm.py --profile-memory 3 under ZeRO-2 on 2 processes, 2 micro batches per step: every rank's
    timeline and the report land in OUTPUT_DIR/memory, and the plan predicts each rank within 1% (measured
    +0.00% / +0.24%). Rank 1 peaks higher than rank 0 (60.7 vs 56.6 MiB): its partition holds the last layers, so
    its gradient partition is allocated early in backward while the activations are still alive; the plan walks
    DeepSpeed's buckets over the traced gradient arrivals per rank (hfscale/plan/zero.py). Before that walk the
    plan under-predicted rank 1 by 6.7%."""
    import subprocess
    import sys

    from hfscale.proofs.engine import free_port

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "accelerate_configs" / "zero2.yaml"),
           "--num_processes", "2", "--num_machines", "1", "--machine_rank", "0", "--main_process_port", str(free_port()),
           str(ROOT / "recipes" / "train_clm.py"), "--config", str(ROOT / "recipes" / "tiny" / "train.yaml"),
           "--output-dir", str(out), "--max-steps", "3", "--profile-memory", "3", "--seq-len", "64",
           "--global-batch-tokens", "512", "--micro-batch", "2", "--eval-every", "0", "--save-every", "0",
           "--progress", "false", "--checkpointing", "off", "--precision", "fp32"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    mem = out / "memory"
    assert sorted(p.name for p in mem.iterdir()) == ["profile.json", "rank0.json", "rank1.json", "timeline.png"]
    doc = json.loads((mem / "profile.json").read_text())
    assert [x["rank"] for x in doc["ranks"]] == [0, 1] and doc["steps"] == 3
    rank = json.loads((mem / "rank0.json").read_text())
    assert rank["grad_accum"] == 2 and rank["zero"] == 2 and rank["world"] == 2
    r0, r1 = doc["ranks"]
    for rk in (r0, r1):
        assert abs(rk["error"]["peak"]) < 0.01, (rk["rank"], rk["error"], rk["measured"]["phases"], rk["predicted"]["phases"])
    # the ranks differ, and so do their predictions, in the same direction
    assert r1["measured"]["peak"] > r0["measured"]["peak"] * 1.03
    assert r1["predicted"]["peak"] > r0["predicted"]["peak"] * 1.03
    assert "[memory] steady peak" in r.stdout


def test_varlen_runs_are_planned_as_unpacked_sdpa():
    """A profiled run under hfscale's varlen kernel (padded rows or padding_free) is compared with the plan's unpacked
    sdpa step: the kernel builds no mask and runs sdpa per group of documents (measured on the tiny recipe, 1 process,
    seq_len 64, micro batch 2: -0.18% for both layouts, docs/data.md); before, its profile had no prediction."""
    from hfscale.models.builtin import load_config
    from hfscale.models.varlen import NAME
    from hfscale.plan.profiler import predict

    r = {"precision": "fp32", "adamw": "fused", "micro_batch": 2, "seq_len": 64, "checkpointing": "off", "zero": 0,
         "world": 1, "offload": "none", "engine": "NO", "rank": 0, "device": "cpu"}
    config = load_config("tiny-gemma3")
    got = predict(config, {**r, "attention": NAME})
    assert "error" not in got and got == predict(config, {**r, "attention": "sdpa"})
