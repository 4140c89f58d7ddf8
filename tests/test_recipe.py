"""recipes/train_clm.py and hfscale.train: batch arithmetic, data order, checkpointing, recipe
configs, bad input (one line, exit 2, nothing written), and — under real `accelerate launch` with
2 processes — DDP / ZeRO-2 / ZeRO-3 / FSDP2 training, resume after kill -9 (FSDP2: also on 1 rank), kill
during a save, and the consolidated save reloading to the live model's eval loss; adapters (QLoRA under DDP and ZeRO-3,
DoRA under DDP with a kill -9 resume and under ZeRO-3 with a 2 -> 1 resume, LoRA under ZeRO-2 with a kill during a save
and under FSDP2): only the adapter moves, saved whole, reloaded and merged, the checkpoints adapter-only."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import conftest
from hfscale.util.atomic import STAGE_PREFIX
from hfscale.util.errors import ConfigError
from hfscale.scale.adapters import qlora_dtypes, same_bits
from hfscale.scale.checkpointing import checkpointed_layers, resolve
from hfscale.testing.aligned import load_owned
from hfscale.data.sampler import plan_batch, rank_indices
from hfscale.train.config import TrainConfig, load_recipe
from hfscale.train.metrics import read_records

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "train_clm.py"
TINY_YAML = ROOT / "recipes" / "tiny" / "train.yaml"
# short runs: 2 micro x 2 accum x 2 ranks x 64 tokens = 512 tokens/step
FAST = ["--seq-len", "64", "--global-batch-tokens", "512", "--micro-batch", "2", "--eval-blocks", "8",
        "--eval-every", "0", "--progress", "false", "--max-train-blocks", "400", "--warmup-steps", "2"]


# --- batch arithmetic and data order ------------------------------------------------------------

def test_batch_plan_arithmetic():
    p = plan_batch(32_768, 512, 2, 4)
    assert (p.micro_batch, p.accum, p.world) == (4, 8, 2)
    assert p.arithmetic() == "4 micro × 8 accum × 2 ranks × 512 = 32,768 tokens/step"
    assert p.tokens_per_step == 32_768


@pytest.mark.parametrize("tokens,seq,world,micro,needle", [
    (1000, 128, 1, 1, "whole number"),
    (3 * 128, 128, 2, 1, "does not divide"),
    (8 * 128, 128, 3, 2, "does not divide"),
])
def test_batch_plan_refuses(tokens, seq, world, micro, needle):
    with pytest.raises(ConfigError, match=needle):
        plan_batch(tokens, seq, world, micro)


def test_rank_indices_disjoint_complete_deterministic():
    p = plan_batch(16 * 64, 64, 2, 2)  # 16 sequences per step: 2 micro x 4 accum x 2 ranks
    n = 40
    for step in range(5):  # crosses an epoch boundary at step 2.5
        got = [rank_indices(p, n, 7, step, a, r).tolist() for a in range(p.accum) for r in range(2)]
        flat = [i for g in got for i in g]
        assert len(flat) == 16
        if step < 2:
            assert len(set(flat)) == 16  # within one epoch no sequence repeats in a step
        assert all(0 <= i < n for i in flat)
    # a pure function of (seed, step): a resumed run reads what the uninterrupted one did
    assert rank_indices(p, n, 7, 3, 1, 1).tolist() == rank_indices(p, n, 7, 3, 1, 1).tolist()
    assert rank_indices(p, n, 7, 3, 1, 1).tolist() != rank_indices(p, n, 8, 3, 1, 1).tolist()
    # one epoch's steps cover every sequence exactly once
    p2 = plan_batch(8 * 64, 64, 2, 2)
    seen = [i for s in range(5) for a in range(p2.accum) for r in range(2) for i in rank_indices(p2, 40, 0, s, a, r).tolist()]
    assert sorted(seen) == list(range(40))


# --- activation checkpointing --------------------------------------------------------------------

def test_checkpointing_modes():
    assert resolve("auto", 26) == "every:5" and resolve("auto", 4) == "every:2" and resolve("every:1", 8) == "full"
    assert checkpointed_layers("every:3", 8) == [0, 3, 6]
    assert checkpointed_layers("full", 4) == [0, 1, 2, 3] and checkpointed_layers("off", 4) == []


def test_checkpointing_saves_memory_and_keeps_gradients():
    """Fewer bytes saved for backward as more layers are checkpointed, and the same gradients."""
    import torch

    from hfscale.models import TINY, build_model
    from hfscale.plan.measure import saved_activation_bytes
    from hfscale.scale.checkpointing import apply_checkpointing_

    ids = torch.randint(4, 4096, (2, 64), generator=torch.Generator().manual_seed(0))
    measured, grads = {}, {}
    for mode in ("off", "every:2", "full"):
        model = build_model(TINY, seed=0)
        model.train()
        assert apply_checkpointing_(model, mode) == checkpointed_layers(mode, 4)
        measured[mode] = saved_activation_bytes(model, ids, ids)
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        grads[mode] = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert measured["off"] > measured["every:2"] > measured["full"]
    for mode in ("every:2", "full"):
        assert torch.allclose(grads[mode], grads["off"], rtol=1e-4, atol=1e-6)


# --- recipe configs --------------------------------------------------------------------------------

def recipe_yamls():
    return sorted((ROOT / "recipes").glob("*/*.yaml"))


def test_recipe_yamls_parse_and_name_their_launch():
    assert len(recipe_yamls()) >= 5
    families = {p.parent.name for p in recipe_yamls()}
    assert {"tiny", "gemma3", "gemma4"} <= families
    for path in recipe_yamls():
        first = path.read_text().splitlines()[0]
        m = re.match(r"# accelerate launch --config_file (\S+) .*recipes/(\S+\.py) --config (\S+)", first)
        assert m, f"{path}: first line must be the launch command, got {first!r}"
        assert (ROOT / m.group(1)).is_file(), f"{path}: {m.group(1)} does not exist"
        assert (ROOT / "recipes" / m.group(2)).is_file()
        assert m.group(3) == str(path.relative_to(ROOT))
        if m.group(2) == "train_clm.py":
            cfg = load_recipe(str(path))
            assert cfg.global_batch_tokens % cfg.seq_len == 0


def test_recipe_config_errors():
    with pytest.raises(ConfigError, match="did you mean 'seq_len'"):
        load_recipe(None, {"seq_lenght": 5})
    with pytest.raises(ConfigError, match="not a valid int"):
        load_recipe(None, {"max_steps": "ten"})
    with pytest.raises(ConfigError, match="multiple of seq_len"):
        TrainConfig(seq_len=100, global_batch_tokens=1024)
    assert load_recipe(None, {"lr": "3e-4", "doctor": "false"}).lr == 3e-4


def test_what_a_recipe_cannot_honour_is_refused_from_one_table():
    """qat_clm / distill_clm accept every TrainConfig setting: checkpointing and the levers they now apply
    (hfscale.train.prepare); what they cannot honour is one line from hfscale.train.recipe.UNSUPPORTED, at load
    (the settings) or at launch (its parallelism), never dropped."""
    from hfscale.scale.spec import Parallel
    from hfscale.train.config import QATRecipeConfig
    from hfscale.train.distill import DistillRecipeConfig
    from hfscale.train.recipe import KERNEL_OF, UNSUPPORTED, refuse_unsupported

    for values, cls, needle in [({"attention": "varlen"}, QATRecipeConfig, "qat_clm runs the model's own attention"),
                                ({"adapter": "dora"}, DistillRecipeConfig, "distill_clm trains the whole student"),
                                ({"tiled_loss": "2", "distill": "0.5"}, QATRecipeConfig, "set tiled_loss: 0, or distill: 0"),
                                ({"tiled_loss": "2"}, DistillRecipeConfig, "distill_clm's KL to the teacher needs"),
                                ({"padding_free": "true"}, QATRecipeConfig, "qat_clm reads packed rows"),
                                ({"padding_free": "true", "attention": "varlen"}, DistillRecipeConfig, "distill_clm reads packed rows")]:
        with pytest.raises(ConfigError, match=needle):
            load_recipe(None, {"teacher": "t", **values} if cls is DistillRecipeConfig else values, cls=cls)
    qat = load_recipe(None, {"checkpointing": "full", "tiled_mlp": "2", "tiled_loss": "2", "offload_activations": "true"},
                      cls=QATRecipeConfig)  # the levers without a distill term: the next-token loss tiles
    refuse_unsupported(qat, Parallel())
    for cfg in (qat, DistillRecipeConfig(teacher="t", checkpointing="every:2", tiled_norm=2)):
        with pytest.raises(ConfigError, match=f"{cfg.recipe} runs data parallelism only; this launch asks for sp 2"):
            refuse_unsupported(cfg, Parallel(sp=2))
    refuse_unsupported(TrainConfig(attention="varlen", adapter="lora", tiled_loss=2), Parallel(sp=2))  # train_clm: all
    assert {r for r, *_ in UNSUPPORTED} - {None} == set(KERNEL_OF) == {"qat_clm", "distill_clm"}


# --- bad input: one line, exit 2, nothing written ---------------------------------------------------

def run_recipe(*args, env=None, cwd=None):
    return subprocess.run([sys.executable, str(RECIPE), *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}, timeout=600)


@pytest.mark.parametrize("extra,env,needle", [
    (["--data", "nope/train.jsonl"], {}, "not found"),
    (["--seq-len", "4096", "--global-batch-tokens", "8192"], {}, "longer than tiny-gemma3 supports (2048)"),
    (["--global-batch-tokens", "384"], {"WORLD_SIZE": "2"}, "does not divide"),
    (["--model", "no-such-model"], {}, "built-in name"),
    (["--resume", "not/a/checkpoint"], {}, "not a complete hfscale checkpoint"),
    (["--checkpointing", "some"], {}, "every:K"),
])
def test_bad_input_one_line_exit_2(tmp_path, extra, env, needle):
    out = tmp_path / "run"
    r = run_recipe("--config", TINY_YAML, "--output-dir", out, *FAST, *extra, env=env)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.startswith("train_clm")]
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    assert not out.exists()


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    """A real 2-step run in one process: the checkpoint the resume-refusal tests need. Padding-free under the varlen
    kernel (each micro batch one row of its real tokens: the recipe's `padding_free: true`), which a resume refusal
    does not depend on."""
    from hfscale.data.corpus import load_text

    base = tmp_path_factory.mktemp("single")
    ds = load_text()  # the user's own files: jsonl train, parquet validation
    ds["train"].select(range(300)).to_json(str(base / "train.jsonl"))
    ds["validation"].to_parquet(str(base / "val.parquet"))
    out = base / "run"
    r = run_recipe("--config", TINY_YAML, "--output-dir", out, *FAST, "--max-steps", "2", "--save-every", "2",
                   "--data", base / "train.jsonl", "--validation", base / "val.parquet", "--attention", "varlen",
                   "--padding-free", "true")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "1 ranks × 64 = 512 tokens/step" in r.stdout
    assert "attention varlen, padding-free (one row per micro batch)" in r.stdout
    steps = read_records(out / "metrics.jsonl")
    assert sorted(steps) == [1, 2] and all(x["trained_tokens"] > 0 and math.isfinite(x["loss"]) for x in steps.values())
    assert "AdamW fused" in r.stdout  # the start line names the implementation the plan traces
    return out


@pytest.mark.parametrize("suffix", [".txt", ".jsonl", ".parquet"])
def test_local_data_formats(tmp_path, suffix):
    import datasets

    from hfscale.data.corpus import load_text

    texts = [f"document {i} about the data model of Python objects." for i in range(40)]
    path = tmp_path / f"data{suffix}"
    if suffix == ".txt":
        path.write_text("\n".join(texts) + "\n")
    else:
        d = datasets.Dataset.from_dict({"text": texts})
        d.to_json(str(path)) if suffix == ".jsonl" else d.to_parquet(str(path))
    ds = load_text(str(path))
    assert len(ds["train"]) + len(ds["validation"]) == 40 and len(ds["validation"]) == 2  # 5% held out
    assert set(ds["train"]["text"]) | set(ds["validation"]["text"]) == set(texts)


def test_existing_run_needs_resume_or_force(one_process_run):
    before = sorted(p.name for p in one_process_run.rglob("*"))
    r = run_recipe("--config", TINY_YAML, "--output-dir", one_process_run, *FAST, "--max-steps", "2")
    assert r.returncode == 2 and "--resume latest" in r.stderr and "--force" in r.stderr
    assert sorted(p.name for p in one_process_run.rglob("*")) == before


def test_resume_on_other_data_refused(one_process_run):
    """The checkpoint records its token store's key: the same run resumed on the built-in corpus (other bytes, so
    another key) is refused in one line before anything launches, and nothing changes."""
    before = sorted(p.name for p in one_process_run.rglob("*"))
    r = run_recipe("--config", TINY_YAML, "--output-dir", one_process_run, *FAST, "--max-steps", "4", "--resume", "latest",
                   "--data", "builtin")
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("train_clm")]
    assert r.returncode == 2 and len(lines) == 1 and "was trained on other data (token store key" in lines[0], r.stderr
    assert sorted(p.name for p in one_process_run.rglob("*")) == before


def test_checkpoint_info_export_and_their_refusals(one_process_run, tmp_path, cli):
    """The single-process (DDP-format) checkpoint: info, export (the same tensors as its model.safetensors, reloading to
    the same logits); a wrong directory, a truncated file and an existing --out: one line, exit 2, nothing written."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ckpt = one_process_run / "checkpoints" / "step_00000002"
    r = cli("checkpoint", "info", ckpt)
    assert r.returncode == 0 and "step 2, ddp on 1 rank" in r.stdout and "1,024 tokens seen (512/step)" in r.stdout
    assert "intact: yes" in r.stdout
    r = cli("checkpoint", "export", ckpt, "--out", tmp_path / "fp32")
    assert r.returncode == 0 and "54 tensors in 1 safetensors shard" in r.stdout, r.stderr
    mine, theirs = load_file(tmp_path / "fp32" / "model.safetensors"), load_file(ckpt / "model.safetensors")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    ids = torch.randint(4, 4096, (1, 16), generator=torch.Generator().manual_seed(0))
    a = load_owned(tmp_path / "fp32")  # aligned like b's weights: the same kernels on every host (testing.aligned)
    b = AutoModelForCausalLM.from_config(a.config).eval()
    b.load_state_dict(theirs, strict=False)
    b.tie_weights()
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    with open(bad / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    for args, needle in [(("info", tmp_path / "nope"), "is not a directory"),
                         (("info", one_process_run), "not a complete hfscale checkpoint"),
                         (("export", bad, "--out", tmp_path / "o"), "is damaged (model.safetensors: 1,000 bytes"),
                         (("export", ckpt, "--out", tmp_path / "fp32"), "exists; pass --force"),
                         (("export", ckpt, "--out", tmp_path / "o", "--shard-size", "0GB"), "--shard-size '0GB'")]:
        r = cli("checkpoint", *args)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr, (args, r.stderr)
        assert not (tmp_path / "o").exists()


def test_damaged_checkpoints_are_found_and_none_intact_is_one_line(one_process_run, tmp_path):
    """The manifest in the marker finds a truncated, a bit-flipped, a missing and an extra file; with the only
    checkpoint damaged, --resume latest is one line, exit 2, nothing written."""
    from hfscale.train.state import damage

    run = tmp_path / "run"
    shutil.copytree(one_process_run, run)
    ckpt = run / "checkpoints" / "step_00000002"
    assert damage(ckpt) is None
    target = ckpt / "optimizer.bin"
    data = target.read_bytes()
    target.write_bytes(data[: len(data) // 2])
    assert damage(ckpt) == f"optimizer.bin: {len(data) // 2:,} bytes, the manifest says {len(data):,}"
    target.write_bytes(data)
    flip_byte(target)
    assert damage(ckpt) == "optimizer.bin: its content differs from the manifest's hash (a changed or corrupted file)"
    (ckpt / "stray.pt").write_bytes(b"x")
    assert damage(ckpt) == "stray.pt is not in its manifest"
    target.unlink()
    assert damage(ckpt) == "optimizer.bin is missing"
    before = sorted(str(p) for p in run.rglob("*"))
    r = run_recipe("--config", TINY_YAML, "--output-dir", run, *FAST, "--max-steps", "4", "--resume", "latest")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("train_clm")]
    assert "no intact checkpoint under" in line and "step_00000002: optimizer.bin is missing" in line and "--force" in line
    r = run_recipe("--config", TINY_YAML, "--output-dir", run, *FAST, "--max-steps", "4", "--resume", ckpt)
    assert r.returncode == 2 and "is damaged (optimizer.bin is missing)" in r.stderr
    r = run_recipe("--config", TINY_YAML, "--output-dir", one_process_run, *FAST, "--max-steps", "4",
                   "--global-batch-tokens", "1024", "--resume", "latest")
    assert r.returncode == 2 and "trained 512 tokens/step" in r.stderr and "--global-batch-tokens 512" in r.stderr
    assert sorted(str(p) for p in run.rglob("*")) == before


def test_resume_from_a_different_model_refused(one_process_run, tmp_path):
    from hfscale.models import tiny_config

    other = tiny_config()
    other.num_hidden_layers, other.layer_types = 2, ["sliding_attention", "full_attention"]
    other.save_pretrained(tmp_path / "other")  # a config-only model dir; nothing is trained
    r = run_recipe("--config", TINY_YAML, "--output-dir", one_process_run, *FAST, "--model", tmp_path / "other",
                   "--resume", "latest")
    assert r.returncode == 2
    assert "different model" in r.stderr and "'num_hidden_layers': (4, 2)" in r.stderr


def test_resume_on_another_base_refused(one_process_run, tmp_path):
    """An adapter-only checkpoint (its marker names the base it holds none of: hfscale.train.adapter_ckpt) resumed on
    another base (here another --seed of the built-in model): one line, exit 2, before any process group or model.
    The marker is outside the manifest, so the checkpoint stays intact with `base` written into it."""
    run = tmp_path / "run"
    shutil.copytree(one_process_run, run)
    marker = run / "checkpoints" / "step_00000002" / "hfscale_state.json"
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "base": {"source": "tiny-gemma3", "seed": 0, "digest": "0"}}))
    data = one_process_run.parent
    r = run_recipe("--config", TINY_YAML, "--output-dir", run, *FAST, "--data", data / "train.jsonl", "--validation",
                   data / "val.parquet", "--seed", "1", "--resume", "latest")
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].endswith("was trained on another base (seed 0 (now 1)); resume with --model "
                                                 "tiny-gemma3 --seed 0, or start a new --output-dir"), lines


# --- real launches: 2 processes ----------------------------------------------------------------------

def launch(config: str, out: Path, *args, env=None, check=True, fault=None, procs=2, signal_after=None, log_dir=None):
    """The recipe on `procs` processes; fault="kill@step:5:1" (or "record@DIR") runs it through
    tests/scripts/faulty_recipe.py. signal_after=N: SIGUSR1 to the launcher once step N is logged (torchrun told
    to forward it, as recipes/slurm/multinode.sbatch does). Returns (status, this launch's log)."""
    import signal
    import time

    started = start_launch(config, out, *args, env=env, fault=fault, procs=procs, log_dir=log_dir)
    if signal_after is not None:
        p = started[0]
        while p.poll() is None and max(read_records(out / "metrics.jsonl"), default=0) < signal_after:
            time.sleep(0.2)
        p.send_signal(signal.SIGUSR1)
    return finish_launch(started, check)


def start_launch(config: str, out: Path, *args, env=None, fault=None, procs=2, log_dir=None):
    """launch()'s process, started (finish_launch waits for it): two launches that read nothing the other writes run
    side by side, as a 1-rank and a 2-rank resume of copies of one checkpoint do (their imports overlap on 2 cores)."""
    script = [str(ROOT / "tests" / "scripts" / "faulty_recipe.py"), fault, str(RECIPE)] if fault else [str(RECIPE)]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "accelerate_configs" / config),
           "--num_processes", str(procs), "--num_machines", "1", "--machine_rank", "0", "--main_process_port", str(conftest.fresh_port()),
           *script, "--config", str(TINY_YAML), "--output-dir", str(out), *FAST, *map(str, args)]
    log = (log_dir or out.parent) / f"{out.name}.log"
    start = log.stat().st_size if log.exists() else 0
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", **(env or {})}
    with open(log, "a") as f:  # a file, not a pipe: a full pipe can stall a multi-process launch
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
    return p, log, start


def finish_launch(started, check=True):
    """(status, the launch's log) of a start_launch; check: status 0 asserted. A failed wait kills the launch's tree."""
    from conftest import kill_tree

    p, log, start = started
    try:
        rc = p.wait(timeout=900)
    finally:
        kill_tree(p)
    text = log.read_text()[start:]
    if check:
        assert rc == 0, text[-3000:]
    return rc, text


def eval_loss_of_saved(model_dir: Path, seq_len=64, blocks=8, micro=2, data="builtin", overflow=None) -> float:
    """The recipe's evaluation redone on the saved model: the first `blocks` held-out rows of the run's token store
    (the same key: built-in data, seq_len), as packed micro batches, the sum over their trained tokens / their count."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return eval_loss_of(model, seq_len, blocks, micro, data, overflow)


def eval_loss_of(model, seq_len=64, blocks=8, micro=2, data="builtin", overflow=None) -> float:
    """eval_loss_of_saved on a model object (a peft model, a base)."""
    import torch

    from hfscale.data import PackedDataset
    from hfscale.data.dataset import MicroBatches
    from hfscale.models.loss import lm_loss, trained_tokens
    from hfscale.data.recipe import check_data, ready_store
    from hfscale.data.store import DataOptions
    from hfscale.util.cache import cache_root

    model = model.eval()
    opts = DataOptions(seq_len, overflow=overflow)
    store = ready_store(check_data(data, "tiny-gemma3", opts, cache_root()), 0, 1)  # the run's: reused
    batches = MicroBatches(PackedDataset(store.path, "validation", limit=blocks), micro)
    with torch.no_grad():
        summed = sum(float(lm_loss(model, b, 1)) for b in batches)  # documents apart (use_cache off), summed
    return summed / sum(int(trained_tokens(b["labels"])) for b in batches)


def assert_trained_saved_reloads(out: Path, log: str, distributed: str, steps: int, keep: int, every: int, data=None):
    """What every 2-rank run of the recipe shows (asserted on the reference runs of the elastic tests below, so no
    launch of its own): the batch line, every step logged, the loss falls, `keep_last` complete checkpoints and
    nothing partial, and a consolidated save (ZeRO-3: gathered from both ranks) that reloads to the live model's
    final eval loss."""
    from hfscale.train.state import saved_numel

    assert f"DistributedType.{distributed} world 2: 2 micro × 2 accum × 2 ranks × 64 = 512 tokens/step" in log
    assert "AdamW fused" in log  # the implementation the plan traces (make_optimizer; the engine's wrappers inside)
    train = read_records(out / "metrics.jsonl")
    assert sorted(train) == list(range(1, steps + 1))
    assert train[steps]["loss"] < train[1]["loss"] - 0.3  # it learns (lr 3e-3: ~8.3 -> ~7 in 6 steps)
    assert all(r["peak_mem_bytes"] > 0 and r["tokens_per_s"] > 0 for r in train.values())
    saves = list(range(every, steps + 1, every))[-keep:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"step_{s:08d}" for s in saves]
    assert saved_numel(out / "model")[0] == 3_001_920
    assert json.loads((out / "model" / "config.json").read_text())["use_cache"] is True  # trained without, saved for decoding
    final = read_records(out / "metrics.jsonl", "eval")[steps]
    # live model (bf16 under DeepSpeed, autocast under DDP, ranks' shares) vs reloaded: measured
    # |delta| <= 5e-5; 1e-3 still catches a wrong or partial save (those move the loss by > 0.1)
    assert abs(eval_loss_of_saved(out / "model", **(data or {})) - final["loss"]) < 1e-3


FORMATS = {"chat": "messages", "pc": "prompt_completion", "tok": "tokenized", "text": "text"}


def write_four_formats(directory: Path) -> str:
    """One small file per format, made from the built-in sets (~14k tokens: under FAST's 400-row limit, so every
    source reaches the sampler): 30 conversations, 30 plain prompt/completion pairs (first user turn, first
    answer), 30 pre-tokenized examples with labels (-100 over the prompt), 3 text documents. Returns the mixture
    'chat,pc,tok,text' as --data takes it (each source its own format, train_on and overflow defaults)."""
    from hfscale.data.formats import Tok, data_tokenizer, encode
    from hfscale.data.sources import BUILTIN, BUILTIN_CHAT, Unit, builtin_files, records

    tok = Tok.of(data_tokenizer("tiny-gemma3"))
    chats = [r for _, r in records(Unit(0, str(builtin_files(BUILTIN_CHAT)["train"])))][:90]
    pairs = [{"prompt": c["messages"][0]["content"], "completion": c["messages"][1]["content"]} for c in chats[30:]]
    tokenized = []
    for i, r in enumerate(pairs[30:]):
        e = encode(r, "prompt_completion", tok, "completion", str(i))
        tokenized.append({"input_ids": e.ids, "labels": [t if m else -100 for t, m in zip(e.ids, e.mask)]})
    texts = [r for _, r in records(Unit(0, str(builtin_files(BUILTIN)["train"])))][:3]
    directory.mkdir(parents=True, exist_ok=True)
    for name, recs in (("chat", chats[:30]), ("pc", pairs[:30]), ("tok", tokenized), ("text", texts)):
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return ",".join(str(directory / f"{name}.jsonl") for name in FORMATS)


def assert_trains_four_formats(log: str, data: str, indices_dir: Path, overflow: str = "split") -> None:
    """The recipe's data lines name each source's detected format and default mask, and the rows the run read
    (indices.jsonl, every rank) hold trained tokens of every source: chat, prompt/completion and pre-tokenized
    data train their masked share only, text every token but each segment's first."""
    import numpy as np

    from hfscale.data import TokenStore
    from hfscale.data.recipe import check_data, ready_store
    from hfscale.data.store import DataOptions
    from hfscale.util.cache import cache_root

    assert f"format mixed, train_on per source, packing bfd, overflow {overflow}, seq_len 64" in log
    lines = re.findall(r"source (\d) \S+/(\w+)\.jsonl \(weight 1\): (\w+), train_on (\w+), overflow \w+: (\d+) examples, "
                       r"([\d,]+) tokens in rows, ([\d,]+) trained", log)
    got = {name: (fmt, on, int(tokens.replace(",", "")), int(trained.replace(",", "")))
           for _, name, fmt, on, _, tokens, trained in lines}
    assert {k: v[:2] for k, v in got.items()} == {"chat": ("messages", "assistant"), "pc": ("prompt_completion", "completion"),
                                                  "tok": ("tokenized", "all"), "text": ("text", "all")}, lines
    for name in ("chat", "pc", "tok"):  # prompts / user turns masked out: measured 66-75% trained
        assert 0 < got[name][3] < 0.9 * got[name][2], (name, got[name])
    assert got["text"][3] > 0.95 * got["text"][2]  # 64-token segments: 1 of 64 untrained
    store = ready_store(check_data(data, "tiny-gemma3", DataOptions(64, overflow=overflow), cache_root()), 0, 1)
    st = TokenStore(store.path, "train", expect_key=store.key)
    rows = sorted({i for idx in read_indices(indices_dir).values() for i in idx})
    trained = dict.fromkeys(FORMATS, 0)
    for r in rows:
        _, labels, pos = st.row(r)
        starts = np.flatnonzero(pos == 0).tolist() + [len(pos)]
        for (doc, _), a, b in zip(st.segments[st.row_ptr[r]:st.row_ptr[r + 1]].tolist(), starts, starts[1:]):
            name = next(n for n, s in zip(FORMATS, store.sources) if s.documents[0] <= doc < s.documents[1])
            trained[name] += int((labels[a:b] != -100).sum())
    assert sum(trained.values()) == sum(int(st.row_trained[r]) for r in rows)  # the recipe's step count, per source
    assert all(v > 0 for v in trained.values()), trained


@pytest.fixture(scope="module")
def four_formats(tmp_path_factory) -> list:
    """--data args of the four-format mixture (shared by the ZeRO-2 and DDP launches: one store, prepared once)."""
    return ["--data", write_four_formats(tmp_path_factory.mktemp("four")), "--overflow", "split"]


@pytest.fixture(scope="module")
def uninterrupted_run(tmp_path_factory, four_formats):
    """ZeRO-2, 2 ranks, 8 steps, every checkpoint kept, the sequences each rank read recorded, on the four-format
    mixture: (dir, records, log, data args)."""
    out = tmp_path_factory.mktemp("ref") / "run"
    _, log = launch("zero2.yaml", out, "--max-steps", "8", "--save-every", "2", "--keep-last", "4", *four_formats,
                    fault=f"record@{out.parent}")
    return out, read_records(out / "metrics.jsonl"), log, four_formats


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_run):
    return uninterrupted_run[1]


@pytest.mark.engine
def test_zero2_trains_saves_and_reloads(uninterrupted_run):
    """ZeRO-2 on 2 ranks trains each format (chat, prompt/completion, pre-tokenized, text: one mixture)."""
    out, _, log, data = uninterrupted_run
    assert_trains_four_formats(log, data[1], out.parent)
    assert_trained_saved_reloads(out, log, "DEEPSPEED", steps=8, keep=4, every=2, data={"data": data[1], "overflow": "split"})


@pytest.mark.engine
def test_kill_during_save_keeps_previous_checkpoint(tmp_path):
    """LoRA under ZeRO-2 (2 ranks): the save a stop request starts (SIGUSR1 to rank 0 after step 2: every rank stops
    after step 3 and saves it, a step --save-every 2 never saves) is SIGKILLed on rank 1 after it wrote its shard: the
    previous (adapter-only) checkpoint stays usable, --resume latest continues from it on the killed run's trajectory,
    and the run passes every adapter check (assert_adapter_run). This launch pair was full fine-tuning (8 steps, compared
    with the uninterrupted ZeRO-2 run); it became LoRA so that LoRA under ZeRO-2 runs in the suite with no launch added:
    the stage / commit path of a save is the same for both, and full fine-tuning's ZeRO-2 resumes (2 -> 1 -> 2, against
    the uninterrupted run) are test_zero2_fallback_2_to_1_sigusr1_then_1_to_2's."""
    from hfscale.train.state import damage

    out = tmp_path / "run"
    rc, _ = launch("zero2.yaml", out, "--adapter", "lora", *ADAPTER, fault="usr1@step:2:0,kill@save:3:1", check=False)
    assert rc != 0  # rank 1 died after writing its shard
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names[1:] == ["step_00000002"]  # and the interrupted save, under a stage name:
    assert names[0].startswith(STAGE_PREFIX) and names[0].endswith(".step_00000003")
    killed = read_records(out / "metrics.jsonl")
    assert max(killed) == 3  # the stop came at the step boundary agreed on
    assert damage(out / "checkpoints" / "step_00000002") is None  # every file as its manifest says
    _, log = launch("zero2.yaml", out, "--adapter", "lora", *ADAPTER, "--resume", "latest")
    assert f"removed the interrupted save {names[0]}" in log and "at step 2" in log
    assert "LoRA r8 (alpha 16): 135,168 trained" in log and "DistributedType.DEEPSPEED world 2" in log
    # the adapter, its Adam moments and the RNG restored over the base rebuilt from the source: step 3 redone bit for bit
    # (1e-6, as the full fine-tuning resumes: kernel-order noise only)
    assert abs(read_records(out / "metrics.jsonl")[3]["loss"] - killed[3]["loss"]) < 1e-6
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]
    assert_adapter_run(out, log, "lora")


@pytest.mark.engine
def test_fsdp2_trains_survives_kill_9_and_resumes_on_2_and_on_1_rank(tmp_path):
    """FSDP2 (accelerate_configs/fsdp2.yaml: SHARDED_STATE_DICT, every:2 from the recipe) in three launches: a run whose
    rank 1 is SIGKILLed after step 8 (both ranks' step 8 logged, its checkpoint never written: steps 1-8 are the
    uninterrupted trajectory, torch.distributed.checkpoint shards of both ranks at steps 4 and 6), then, side by side,
    its `--resume latest` on 2 ranks (bit-identical to the killed run's steps 7 and 8; a consolidated save that reloads
    to the live eval loss) and the same step-6 checkpoint resumed on 1 rank (DCP reshards 2 -> 1)."""
    import shutil

    args = ["--max-steps", "8", "--save-every", "2", "--keep-last", "2"]
    out = tmp_path / "run"
    rc, log = launch("fsdp2.yaml", out, *args, fault="kill@step:8:1", check=False)
    assert rc != 0
    assert "DistributedType.FSDP world 2: 2 micro × 2 accum × 2 ranks × 64 = 512 tokens/step" in log
    assert "checkpointed layers [0, 2]" in log
    reference = read_records(out / "metrics.jsonl")
    assert sorted(reference) == list(range(1, 9)) and reference[8]["loss"] < reference[1]["loss"] - 0.3
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if not p.name.startswith(STAGE_PREFIX)) == \
        ["step_00000004", "step_00000006"]
    step6 = out / "checkpoints" / "step_00000006"
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):  # DCP: one shard file per rank
        assert sorted(f.name for f in (step6 / part).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    one = tmp_path / "one"
    (one / "checkpoints").mkdir(parents=True)
    shutil.copytree(step6, one / "checkpoints" / step6.name)

    from conftest import kill_tree
    from hfscale.train.state import saved_numel

    offset = (out / "metrics.jsonl").stat().st_size
    two_ranks = start_launch("fsdp2.yaml", out, *args, "--resume", "latest")
    one_rank = start_launch("fsdp2.yaml", one, *args, "--resume", "latest", procs=1)
    try:
        _, log = finish_launch(two_ranks)
        assert "at step 6" in log
        resumed = read_records(out / "metrics.jsonl", offset=offset)  # what the resume logged, not the killed run's lines
        assert sorted(resumed) == [7, 8]
        # restored Adam step and moments: measured bit-identical (|delta| = 0.0); 1e-6 leaves room for kernel-order noise
        assert max(abs(resumed[s]["loss"] - reference[s]["loss"]) for s in (7, 8)) < 1e-6
        assert saved_numel(out / "model")[0] == 3_001_920  # gathered from both ranks' shards
        final = read_records(out / "metrics.jsonl", "eval")[8]
        # live (bf16 compute under FSDP2's MixedPrecisionPolicy, sharded) vs reloaded fp32: measured 4.8e-5
        assert abs(eval_loss_of_saved(out / "model") - final["loss"]) < 1e-3

        _, log = finish_launch(one_rank)
    finally:
        kill_tree(one_rank[0])  # a failed check above leaves no launch running
    assert "DistributedType.FSDP world 1: 2 micro × 4 accum × 1 ranks" in log and "at step 6" in log
    resumed = read_records(one / "metrics.jsonl")
    assert sorted(resumed) == [7, 8]
    # the same sequences per step, summed in another order (measured 1.1e-4 when it resumed from step 4 and redid 5-8)
    assert max(abs(resumed[s]["loss"] - reference[s]["loss"]) for s in resumed) < 2e-3


def test_hub_dataset_name_offline_is_one_clear_error(monkeypatch):
    from hfscale.data.corpus import load_text
    from hfscale.util.errors import HfscaleError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HfscaleError, match="looks like a hub dataset but HF_HUB_OFFLINE is set"):
        load_text("wikitext/wikitext-2")


def test_malformed_data_file_one_line(tmp_path):
    bad = tmp_path / "train.jsonl"
    bad.write_text('{"text": broken\n')
    r = run_recipe("--config", TINY_YAML, "--output-dir", tmp_path / "run", *FAST, "--data", bad)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"{bad}:1: not valid JSON" in r.stderr  # the file and line (hfscale.data.sources)
    assert not (tmp_path / "run").exists()


def test_doctor_runs_first_and_stops_a_bad_launch(tmp_path):
    """The launch's DeepSpeed JSON (as accelerate exports it to the ranks) is checked before any work."""
    cfg = json.loads((ROOT / "ds_configs" / "zero3.json").read_text())
    cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = False  # the tiny-checkpoint failure
    bad = tmp_path / "zero3_nogather.json"
    bad.write_text(json.dumps(cfg))
    r = run_recipe("--config", TINY_YAML, "--output-dir", tmp_path / "run", *FAST,
                   env={"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(bad)})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "hfscale doctor" in r.stderr and "stage3_gather_16bit_weights_on_model_save" in r.stderr
    assert not (tmp_path / "run").exists()


# --- elastic resume, preemption, damaged checkpoints, a full disk (tests/scripts/faulty_recipe.py record@) ------

def read_indices(directory: Path) -> dict[int, list]:
    """step -> sorted sequence indices every rank read at that step (a step recorded twice fails the test)."""
    got: dict[int, dict] = {}
    for line in (directory / "indices.jsonl").read_text().splitlines():
        r = json.loads(line)
        got.setdefault(r["step"], {}).setdefault(r["world"], []).extend(r["idx"])
    for step, by_world in got.items():
        assert len(by_world) == 1, f"step {step} was read at rank counts {sorted(by_world)}: read twice"
    return {step: sorted(next(iter(w.values()))) for step, w in got.items()}


def test_read_records_from_an_offset_sees_only_what_a_resume_appended(tmp_path):
    """A resume appends to its killed run's metrics.jsonl: read from the offset, only its own lines count (a resume that
    logged nothing reads as nothing, not as the killed run's steps); a line cut by the kill is skipped, and the
    resume's MetricsLog starts its first record on a line of its own (else it was glued to the cut one and lost)."""
    m = tmp_path / "metrics.jsonl"
    m.write_text("".join(json.dumps({"kind": "train", "step": s, "loss": 9.0 - s}) + "\n" for s in (1, 2, 3)) + '{"kind": "tr')
    offset = m.stat().st_size
    assert sorted(read_records(m)) == [1, 2, 3] and read_records(m, offset=offset) == {}
    from hfscale.train.metrics import MetricsLog

    log = MetricsLog(m)  # the resume's writer: its first record starts a line of its own after the cut one
    log.write({"kind": "train", "step": 3, "loss": 5.5})
    log.write({"kind": "eval", "step": 3})
    assert read_records(m, offset=offset) == {3: {"kind": "train", "step": 3, "loss": 5.5}}
    assert read_records(m)[3]["loss"] == 5.5 and sorted(read_records(m, "eval", offset)) == [3]


def flip_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))


# Resumed on another rank count, each step reads the same sequences in the same micro batches of 2 (rank r's
# micro step a reads slice (a*world + r)*micro: world 2 and world 1 cut the 8 sequences into the same pairs), so
# what differs is only where gradients are summed: over micro steps on one rank vs across two ranks (bf16 grads,
# fp32 master weights under DeepSpeed). Measured max |loss delta| over the resumed steps (2-core AVX512-BF16 host,
# bf16): ZeRO-2 2->1->2 0.00024, DDP 2->1 0.0 (fp32 weights, gradients all-reduced in fp32). 5e-3 is 20x that, and
# 17x below what a subtly wrong resume moves the loss by: the same weights and moments with the cosine schedule of
# another --max-steps gave 0.088 two steps later; restarting the optimizer or skipping data moves it by > 0.3.
RESHAPE_TOL = 5e-3


def assert_follows(resumed: dict, reference: dict, steps, tol: float = RESHAPE_TOL):
    deltas = {s: abs(resumed[s]["loss"] - reference[s]["loss"]) for s in steps}
    print("resumed vs uninterrupted |loss delta| per step:", {s: round(d, 5) for s, d in deltas.items()})
    assert max(deltas.values()) < tol, deltas
    assert {resumed[s]["tokens_seen"] for s in steps} == {reference[s]["tokens_seen"] for s in steps}
    assert all(resumed[s]["tokens_seen"] == s * 512 for s in steps)  # the global batch kept: 512 tokens/step


def _launch_precision() -> str:
    """What the shipped bf16 configs run as under the tiny recipe's precision auto: fp32 where bf16 is emulated."""
    from hfscale.util.hosts import bf16_support, resolve_precision

    return resolve_precision("auto", "bf16", bf16_support("cpu")).precision


@pytest.mark.engine
def test_zero2_fallback_2_to_1_sigusr1_then_1_to_2(tmp_path, uninterrupted_run):
    """From the uninterrupted ZeRO-2 run's step 2 and 4 checkpoints, step 4 bit-flipped: 1 rank falls back to step 2
    (universal: saved by 2 ranks), SIGUSR1 stops it at a step boundary with a checkpoint and status 75; 2 ranks
    resume that (universal again: saved by 1 rank) to step 8, on the uninterrupted trajectory and data."""
    ref_out, ref, _, four_formats = uninterrupted_run
    out, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    for name in ("step_00000002", "step_00000004"):
        shutil.copytree(ref_out / "checkpoints" / name, ck / name)
    # bf16_zero_pp_... under bf16, zero_pp_... in fp32 (where the host emulates bf16: precision auto)
    optim = next((ck / "step_00000004" / "pytorch_model").glob("*zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    flip_byte(optim)
    args = ["--max-steps", "8", "--save-every", "2", "--keep-last", "2", "--resume", "latest", *four_formats]
    rc, log = launch("zero2.yaml", out, *args, procs=1, fault=f"record@{tmp_path}", signal_after=4, check=False)
    assert rc == 128 + 10, log[-3000:]  # the launcher: SIGUSR1, after waiting for the ranks
    assert (tmp_path / "exit_rank0.txt").read_text() == "75"  # the rank: preempted, checkpoint saved
    assert (f"checkpoint step_00000004 is damaged (pytorch_model/{optim.name}: its "
            "content differs from the manifest's hash") in log and "resuming from step_00000002" in log
    assert f"resuming step 2 saved by 2 ranks on 1 rank: universal checkpoint {ck}/step_00000002.universal (converted" in log
    stopped = int(re.search(r"SIGUSR1: stopped after step (\d+), checkpoint", log).group(1))
    assert 4 <= stopped < 8
    names = sorted(p.name for p in ck.iterdir())
    assert not any(n.startswith(STAGE_PREFIX) for n in names) and f"step_{stopped:08d}" in names
    assert "step_00000002" not in names and "step_00000002.universal" not in names  # pruned with its checkpoint

    _, log = launch("zero2.yaml", out, *args, fault=f"record@{tmp_path}")
    assert f"resuming step {stopped} saved by 1 ranks on 2 ranks: universal checkpoint" in log
    assert "2 micro × 2 accum × 2 ranks × 64 = 512 tokens/step" in log
    resumed = read_records(out / "metrics.jsonl")
    assert sorted(resumed) == list(range(3, 9))
    assert_follows(resumed, ref, range(3, 9))
    # every step 3..8 read exactly the sequences the uninterrupted run read at that step: none twice, none skipped
    mine, theirs = read_indices(tmp_path), read_indices(ref_out.parent)
    assert sorted(mine) == list(range(3, 9)) and all(mine[s] == theirs[s] for s in mine)
    assert_export_matches_zero_to_fp32(ck / "step_00000008", tmp_path / "export")  # ZeRO-2, 2 ranks
    assert [json.loads(ln)["world"] for ln in (tmp_path / "indices.jsonl").read_text().splitlines()][0] == 1


@pytest.mark.engine
def test_zero3_2_to_1_to_2_ranks(tmp_path):
    """ZeRO-3 (parameters sharded too): 2 ranks save step 2; 1 rank resumes it with CPU offload (optimizer and
    parameters: accelerate_configs/zero3_offload.yaml, DeepSpeed's CPU Adam) until SIGUSR1 stops it with a
    checkpoint; 2 ranks resume that without offload to 6; against an uninterrupted 2-rank run of 6 steps (the same
    --max-steps everywhere: the cosine schedule depends on it). The universal conversion is made once and then reused."""
    from hfscale.train.reshape import convert

    ref = tmp_path / "ref"
    _, log = launch("zero3.yaml", ref, "--max-steps", "6", "--save-every", "2", "--keep-last", "3", fault=f"record@{tmp_path}")
    assert_trained_saved_reloads(ref, log, "DEEPSPEED", steps=6, keep=3, every=2)
    (tmp_path / "indices.jsonl").rename(tmp_path / "ref_indices.jsonl")
    out, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    shutil.copytree(ref / "checkpoints" / "step_00000002", ck / "step_00000002")
    before = {p.name: p.stat().st_mtime_ns for p in (ck / "step_00000002").rglob("*")}
    args = ["--max-steps", "6", "--save-every", "2", "--keep-last", "2", "--resume", "latest"]
    rc, log = launch("zero3_offload.yaml", out, *args, procs=1, fault=f"record@{tmp_path}", signal_after=3, check=False)
    assert rc == 128 + 10 and (tmp_path / "exit_rank0.txt").read_text() == "75", log[-3000:]
    assert "resuming step 2 saved by 2 ranks on 1 rank: universal checkpoint" in log
    assert "2 micro × 4 accum × 1 ranks × 64 = 512 tokens/step" in log
    assert {p.name: p.stat().st_mtime_ns for p in (ck / "step_00000002").rglob("*")} == before  # only read
    stopped = int(re.search(r"SIGUSR1: stopped after step (\d+), checkpoint", log).group(1))
    assert 3 <= stopped < 6
    assert json.loads((ck / f"step_{stopped:08d}" / "hfscale_state.json").read_text())["offload_optimizer"] == "cpu"
    _, log = launch("zero3.yaml", out, *args, fault=f"record@{tmp_path}")
    assert f"resuming step {stopped} saved by 1 ranks on 2 ranks: universal checkpoint" in log
    assert_follows(read_records(out / "metrics.jsonl"), read_records(ref / "metrics.jsonl"), range(3, 7))
    mine = read_indices(tmp_path)
    (tmp_path / "indices.jsonl").unlink()
    (tmp_path / "ref_indices.jsonl").rename(tmp_path / "indices.jsonl")
    theirs = read_indices(tmp_path)
    assert sorted(mine) == list(range(3, 7)) and all(mine[s] == theirs[s] for s in mine)
    target, reused = convert(ck / f"step_{stopped:08d}")
    assert reused and target == ck / f"step_{stopped:08d}.universal"
    # hfscale checkpoint info / export on the 2-rank and the 1-rank ZeRO-3 checkpoints
    from hfscale.export.ckpt_export import info

    i = info(ck / f"step_{stopped:08d}")
    assert (i.engine, i.zero, i.ranks, i.step, i.tokens_seen, i.precision, i.intact, i.universal) == \
        ("deepspeed", 3, 1, stopped, stopped * 512, _launch_precision(), "yes", True)
    assert_export_matches_zero_to_fp32(ref / "checkpoints" / "step_00000002", tmp_path / "export2")
    assert_export_matches_zero_to_fp32(ck / f"step_{stopped:08d}", tmp_path / "export1")


@pytest.mark.engine
def test_ddp_trains_four_formats_saves_and_reloads(tmp_path, four_formats):
    """Under DDP (MULTI_CPU, 2 ranks) the recipe trains each format of the four-format mixture (chat among them), saves
    and reloads. Its 1-rank resume launch went to the ZeRO-3 QLoRA test: DDP 2 -> 1 (the state whole on every rank,
    the same rows) is now the DDP DoRA kill -9 test's resume (on the default data); the same rows after a change of
    rank count on this mixture: ZeRO-2 (test_zero2_fallback_2_to_1_sigusr1_then_1_to_2); ZeRO-3's 2 -> 1 -> 2
    (test_zero3_2_to_1_to_2_ranks) reads the default data."""
    ref = tmp_path / "ref"
    _, log = launch("ddp.yaml", ref, "--max-steps", "6", "--save-every", "2", "--keep-last", "2", *four_formats,
                    fault=f"record@{tmp_path}")
    # each source rendered / masked by its own format, bfd-packed rows (issue 36)
    assert re.search(r"train: \d+ examples, [\d,]+ tokens, [\d,]+ trained \(\d+\.\d%\), truncated 0 / dropped \d+ / "
                     r"split \d+", log)
    assert_trains_four_formats(log, four_formats[1], tmp_path)
    assert_trained_saved_reloads(ref, log, "MULTI_CPU", steps=6, keep=2, every=2,  # step 2's checkpoint removed
                                 data={"data": four_formats[1], "overflow": "split"})


@pytest.fixture
def small_mount(tmp_path):
    """A real 56 MiB file system (tmpfs): room for one DDP checkpoint of the tiny model (~36 MB), not two."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=56m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a small file system here ({r.stderr.strip() or 'mount failed'}); needs root or CAP_SYS_ADMIN")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.engine
def test_bad_input_under_a_launch_is_one_line_and_writes_nothing(tmp_path):
    """Refused before training on 2 ranks: the line reaches the log. Rank 1 used to return first, torchrun then
    SIGTERMed rank 0 before it printed, and the launch ended with no message (hfscale.train.loop.setup_failed)."""
    out = tmp_path / "run"
    rc, log = launch("ddp.yaml", out, "--model", str(tmp_path / "no_such_model"), check=False)
    lines = [ln for ln in log.splitlines() if ln.startswith("train_clm: error:")]
    assert rc != 0 and len(lines) == 1 and "no_such_model" in lines[0], log[-3000:]
    # the launcher's own ChildFailedError report follows; no frame of the recipe or of hfscale is in the log
    assert not re.search(r'File ".*(hfscale|recipes)/', log) and not out.exists(), log[-3000:]


@pytest.mark.engine
def test_save_on_a_full_disk_fails_cleanly_on_every_rank(tmp_path, small_mount):
    out = small_mount / "run"
    rc, log = launch("ddp.yaml", out, "--max-steps", "3", "--save-every", "1", "--keep-last", "2",
                     fault=f"record@{tmp_path}", check=False, log_dir=tmp_path)
    assert rc != 0
    # every rank records its own status (the launcher reports only the first failure). Rank 1 once never did: it
    # deadlocked freeing DDP's process group (hfscale.scale.runtime.hold_process_groups) and torchrun SIGKILLed it
    status = [(tmp_path / f"exit_rank{r}.txt").read_text() if (tmp_path / f"exit_rank{r}.txt").exists() else None
              for r in (0, 1)]
    assert status == ["74", "74"], (status, log[-3000:])
    lines = [ln for ln in log.splitlines() if ln.startswith("train_clm: error:")]
    assert len(lines) == 1 and "saving checkpoint step_00000002 failed on rank 0" in lines[0], log[-3000:]
    assert "free space there or choose another --output-dir" in lines[0] and "step_00000001 is kept" in lines[0]
    # warned before training: 2 kept + 1 being written, ~34 MiB each (12 bytes x 3.0M params), > 56 MiB
    assert re.search(r"warning: \S+ has 5\d MiB free; keep_last 2 checkpoints of ~34 MiB plus the one being written "
                     r"need 103 MiB", log), log[-3000:]
    from hfscale.train.state import damage

    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000001"]  # no stage left
    assert damage(out / "checkpoints" / "step_00000001") is None
    assert max(read_records(out / "metrics.jsonl")) == 2


def assert_export_matches_zero_to_fp32(ckpt: Path, out: Path) -> None:
    """`hfscale checkpoint export` of a DeepSpeed checkpoint: the same fp32 tensors as DeepSpeed's zero_to_fp32
    (byte for byte), and the directory reloads in transformers to the same logits."""
    import contextlib
    import io

    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hfscale.cli import main

    assert main(["checkpoint", "export", str(ckpt), "--out", str(out), "--shard-size", "5MB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3  # 12 MB of fp32 in 5 MB shards
    mine = {k: v for f in sorted(out.glob("model-*.safetensors")) for k, v in load_file(f).items()}
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        theirs = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag="pytorch_model")
    assert set(theirs) - set(mine) == {"lm_head.weight"}  # tied to embed_tokens: stored once, as transformers does
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    model = load_owned(out)  # aligned like ref's weights: the same kernels on every host (testing.aligned)
    ref = AutoModelForCausalLM.from_config(model.config).eval()
    ref.load_state_dict(theirs)
    ids = torch.randint(4, 4096, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


# --- adapters (hfscale.scale.adapters): LoRA / DoRA / QLoRA runs of the recipe ---------------------------------------
# rank 8 on every decoder linear of the random-init tiny Gemma 3, lr 1e-2 (an adapter on a random base learns slowly
# at the full-model lr 3e-3; 3e-2 diverged at step 4 under DeepSpeed's bf16 module: measured 7.85 -> 8.05 / 8.32)
ADAPTER = ["--lora-rank", "8", "--lr", "1e-2", "--max-steps", "4", "--save-every", "2", "--keep-last", "2"]


def fresh_adapter_model(kind: str, nf4=None, embedding=False):
    """The recipe's model as it starts (seed 0): the base with the adapter on it; for QLoRA (`nf4`: the run's (compute,
    storage) dtypes, hfscale.scale.adapters.qlora_dtypes) the NF4 base quantized as the run quantized it: from
    weights in the compute dtype, packed in the storage dtype (another pair gives other NF4 codes and scales)."""
    from hfscale.models import build_model
    from hfscale.scale.adapters import AdapterSpec, apply_adapter, load_quantized_base

    base = load_quantized_base("tiny-gemma3", *nf4, device_map="cpu") if nf4 else build_model("tiny-gemma3", seed=0)
    return apply_adapter(base, AdapterSpec(kind, rank=8, embedding=embedding))


def checkpoint_model_state(ckpt: Path) -> dict:
    """{name: shape} of the model tensors a checkpoint holds: DDP's model.safetensors, FSDP2's DCP metadata, ZeRO-1/2's
    module (mp_rank_00_model_states.pt), or ZeRO-3's module entries of every rank (partitioned: empty placeholders),
    whose frozen parameter fragments must be absent (an adapter run's checkpoint never holds the base)."""
    import torch
    from safetensors import safe_open

    if (ckpt / "model.safetensors").is_file():
        with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    if (ckpt / "pytorch_model_fsdp_0").is_dir():  # FSDP2: torch.distributed.checkpoint's metadata names every tensor
        from torch.distributed.checkpoint import FileSystemReader

        meta = FileSystemReader(str(ckpt / "pytorch_model_fsdp_0")).read_metadata().state_dict_metadata
        return {k.removeprefix("model."): tuple(m.size) for k, m in meta.items() if hasattr(m, "size")}
    files = sorted((ckpt / "pytorch_model").glob("*_model_states.pt"))
    states = [torch.load(f, map_location="cpu", weights_only=False) for f in files]
    assert all(not s.get("frozen_param_fragments") and not s.get("frozen_param_shapes") for s in states)
    return {k: tuple(v.shape) for s in states for k, v in s["module"].items() if torch.is_tensor(v)}


def base_digest_of(kind: str, nf4=None, dtype=None, embedding=False) -> str:
    """hfscale.train.adapter_ckpt.base_digest of the base the run must have trained on, built here from the source:
    the seeded tiny Gemma 3 (cast to `dtype`: DeepSpeed's 16-bit module), or for QLoRA quantized with the run's dtypes."""
    from hfscale.train.adapter_ckpt import base_digest

    fresh = fresh_adapter_model(kind, nf4, embedding)
    return base_digest(fresh.to(dtype) if dtype is not None and not nf4 else fresh)


def assert_adapter_run(out: Path, log: str, kind: str, nf4=None, embedding=False):
    """What an adapter run of the recipe must show: the loss falls; the frozen base in both checkpoints equals the
    base the run started from, bit for bit (the adapters alone moved; QLoRA, `nf4` = the run's (compute, storage)
    dtypes: the packed NF4 weights and their quantization state, in their own dtype); OUTPUT_DIR/adapter holds every adapter tensor
    of every decoder linear with its full shape and reloads with peft to the live final eval loss; OUTPUT_DIR/model
    (merged into the unquantized base) computes what base + adapter compute. `embedding`: the run's --lora-embedding
    (the embedding's pair, tied to the lm_head's, in the checkpoints, the file and the merge)."""
    import torch
    from peft import PeftModel
    from safetensors import safe_open

    from hfscale.models import build_model

    train = read_records(out / "metrics.jsonl")
    assert sorted(train) == [1, 2, 3, 4] and train[4]["loss"] < train[1]["loss"] - 0.3  # measured 8.33 -> 7.42
    final = read_records(out / "metrics.jsonl", "eval")[4]["loss"]
    assert final < eval_loss_of(build_model("tiny-gemma3", seed=0)) - 0.02  # measured 8.33 -> 8.28 (ZeRO-3 LoRA)

    # the checkpoints hold the adapter alone (every trained tensor, nothing of the base: neither its weights nor an NF4
    # base's quantization state), and name the base they need: its source and the digest of the live frozen base's
    # bytes, equal to the digest of the base built here from the source (QLoRA: re-quantized with the run's dtypes)
    fresh = fresh_adapter_model(kind, nf4, embedding)
    trained = {n: tuple(p.shape) for n, p in fresh.named_parameters() if p.requires_grad}
    digest = base_digest_of(kind, nf4, torch.bfloat16 if "DEEPSPEED" in log and _launch_precision() == "bf16" else None,
                            embedding)
    for step in (2, 4):
        ckpt = out / "checkpoints" / f"step_{step:08d}"
        held = checkpoint_model_state(ckpt)
        assert set(held) == set(trained), sorted(set(held) ^ set(trained))[:3]
        assert all(held[k] in (trained[k], (0,)) for k in held)  # whole, or ZeRO-3's empty placeholder
        base = json.loads((ckpt / "hfscale_state.json").read_text())["base"]
        assert base == {"source": "tiny-gemma3", "seed": 0, "digest": digest}, (base, digest)

    expected = {}  # every adapter tensor of every decoder linear, with its full shape
    for name, m in fresh.named_modules():
        if hasattr(m, "lora_A") and "default" in m.lora_A:
            expected[f"{name}.lora_A.weight"] = (8, m.in_features)  # peft's file names drop the adapter's name
            expected[f"{name}.lora_B.weight"] = (m.out_features, 8)
            if kind == "dora":
                expected[f"{name}.lora_magnitude_vector"] = (m.out_features,)
    assert len(expected) == 4 * 7 * (3 if kind == "dora" else 2) + (2 if embedding else 0)  # + the lm_head's LoRA
    if embedding:  # the pair, and peft's names for the tied lm_head's (the same, transposed)
        emb_w = fresh.get_input_embeddings().weight
        expected.update({"base_model.model.model.embed_tokens.lora_embedding_A": (8, emb_w.shape[0]),
                         "base_model.model.model.embed_tokens.lora_embedding_B": (emb_w.shape[1], 8),
                         "base_model.model.lm_head.lora_A.weight": (8, emb_w.shape[1]),
                         "base_model.model.lm_head.lora_B.weight": (emb_w.shape[0], 8)})
    with safe_open(str(out / "adapter" / "adapter_model.safetensors"), framework="pt") as f:
        assert {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()} == expected

    # reloaded on the base it trained on (QLoRA: the NF4 one): the live eval (bf16 under DeepSpeed, autocast under
    # DDP) against fp32 here; the full-model runs measured |delta| <= 5e-5, a wrong or partial adapter moves it > 0.05
    live_base = fresh_adapter_model("none", nf4) if nf4 else build_model("tiny-gemma3", seed=0)
    reloaded = PeftModel.from_pretrained(live_base, out / "adapter")
    assert abs(eval_loss_of(reloaded) - final) < 2e-3

    # merged: the unquantized base's weights + B A x alpha / r once; base + adapter computes x W^T + (x A^T) B^T x
    # alpha / r: the same fp32 sums in another order, |delta| ~ 1e-6 on logits of ~ 1
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(out / "model").eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert merged.lm_head.weight is merged.model.embed_tokens.weight  # still tied
    on_base = PeftModel.from_pretrained(build_model("tiny-gemma3", seed=0), out / "adapter").eval()
    ids = torch.randint(3, 4096, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b, plain = merged(input_ids=ids).logits, on_base(input_ids=ids).logits, build_model("tiny-gemma3")(input_ids=ids).logits
    assert (b - plain).abs().max() > 1e-2 and torch.allclose(a, b, atol=1e-4, rtol=1e-4)
    # the merged base is the source: every tensor outside the adapted linears bit for bit, the adapted ones moved
    merged, source = merged.state_dict(), build_model("tiny-gemma3", seed=0).state_dict()
    linears = [k for k in merged if k.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                              "up_proj", "down_proj")]
    assert len(linears) == 4 * 7
    linears += ["model.embed_tokens.weight", "lm_head.weight"] if embedding else []  # one tied matrix, merged once
    assert all(not torch.equal(merged[k], source[k]) for k in linears)  # the adapter is in it
    assert all(torch.equal(merged[k], source[k]) for k in merged if k not in linears)  # and nothing else moved


def kill_9_then_resume(config: str, kind: str, tmp_path: Path, first_line: str, *args, procs: int = 2,
                       tol: float = 1e-6, killed_log: list | None = None):
    """An adapter run of the recipe (2 ranks; `args` added to its command line) whose rank 1 is SIGKILLed after step 4
    (both ranks' step 4 logged, its checkpoint never written: only step 2 is complete, and no adapter or model was
    saved), then `--resume latest` on `procs` ranks: steps 3 and 4 are redone on the killed run's trajectory (within
    `tol`) from the same rows, none read twice or skipped. Returns (OUTPUT_DIR, the resumed launch's log); the killed
    launch's log is appended to `killed_log` when one is given."""
    out, killed_rows, resumed_rows = tmp_path / "run", tmp_path / "killed", tmp_path / "resumed"
    killed_rows.mkdir()
    resumed_rows.mkdir()
    rc, log = launch(config, out, "--adapter", kind, *ADAPTER, *args, fault=f"kill@step:4:1,record@{killed_rows}",
                     check=False)
    assert rc != 0 and first_line in log, log[-3000:]
    if killed_log is not None:
        killed_log.append(log)
    killed = read_records(out / "metrics.jsonl")
    assert sorted(killed) == [1, 2, 3, 4]
    assert [p.name for p in (out / "checkpoints").iterdir() if not p.name.startswith(STAGE_PREFIX)] == ["step_00000002"]
    assert not (out / "adapter").exists() and not (out / "model").exists()
    offset = (out / "metrics.jsonl").stat().st_size
    _, log = launch(config, out, "--adapter", kind, *ADAPTER, *args, "--resume", "latest", procs=procs,
                    fault=f"record@{resumed_rows}")
    resumed = read_records(out / "metrics.jsonl", offset=offset)  # what the resume logged, not the killed run's lines
    assert sorted(resumed) == [3, 4]
    assert_follows(resumed, killed, (3, 4), tol=tol)
    mine, theirs = read_indices(resumed_rows), read_indices(killed_rows)
    assert sorted(mine) == [3, 4] and all(mine[s] == theirs[s] for s in mine)  # the same rows, none twice or skipped
    return out, log


@pytest.mark.engine
def test_ddp_qlora_survives_kill_9_and_merges_into_the_unquantized_base(tmp_path):
    """QLoRA under DDP (2 ranks): NF4 base (bitsandbytes on this CPU, uint8 storage), adapters trained; rank 1
    SIGKILLed after step 4 (its checkpoint never written), then `--resume latest` on 2 ranks from step 2 (the NF4 base
    re-quantized from the source, checked by digest) redoes steps 3 and 4 on the killed run's trajectory and rows; the
    base bit for bit as it started, the adapter saved and merged into the fp32 base; that merged model goes through
    `hfscale quantize --format gguf` (Q8_0) and runs in llama.cpp."""
    # the same world, the same sums on the same re-quantized base: measured |delta| = 0.0 (steps 3, 4)
    out, log = kill_9_then_resume("ddp.yaml", "qlora", tmp_path, "QLoRA r8 (alpha 16): 135,168 trained")
    assert "DistributedType.MULTI_CPU world 2" in log and "at step 2" in log
    assert "checkpointed layers [0, 2]" in log  # non-reentrant checkpointing on a frozen base: no input grads needed
    assert_adapter_run(out, log, "qlora", nf4=qlora_dtypes(_launch_precision(), None, False))  # fp32 / uint8

    # the merged model reaches the edge unchanged: the CLI's GGUF path (hfscale quantize --format gguf --qtype Q8_0 is
    # this call: export_gguf, llama.cpp's check deciding; reload=False skips transformers' optional second GGUF reader)
    from hfscale.export import export_gguf

    gguf = tmp_path / "merged-Q8_0.gguf"
    rec = export_gguf(str(out / "model"), gguf, "Q8_0", progress=False, reload=False)
    v = rec["verification"]
    assert rec["source"]["model"] == str(out / "model") and gguf.stat().st_size == rec["bytes"]
    assert v["tokenizer"]["identical"] == v["tokenizer"]["texts"]  # the recipe's tokenizer went along with the model
    # llama.cpp vs transformers on the merged model: measured top-1 1.000 over 690 positions, max |dlogit| 0.021 (Q8_0),
    # and the merged model's smallest top-1 margin there is 1.84 logits (the untrained base's median is 0.05: it gets 0.946)
    assert v["vs_transformers"]["top1_agreement"] >= 0.98, v["vs_transformers"]


@pytest.mark.engine
def test_zero3_qlora_survives_kill_9_on_the_nf4_base_bit_for_bit_and_saves_none_of_it(tmp_path):
    """QLoRA under ZeRO-3 (2 ranks): the NF4 base packed in the run's dtype (bf16, or fp32 where precision auto is
    fp32: hfscale.scale.adapters.nf4_storage) and partitioned by DeepSpeed; rank 1 SIGKILLed after step 4 (its
    checkpoint never written), then `--resume latest` on 1 rank from step 2 (the base re-quantized from the source,
    checked by digest, the adapter's partitions and their Adam state loaded over it through DeepSpeed's universal
    checkpoint) redoes steps 3 and 4 on the killed run's trajectory and rows. The checkpoints hold the adapter alone (no frozen fragments, no quantization state), and the
    live base's digest in both equals that of a base quantized here with the run's dtypes (packed weights and
    quantization state, bit for bit); the adapter saved whole by the resumed rank, reloaded on that base to the live
    eval, merged into the fp32 base (an adapter gathered from 2 partitioned ranks: the ZeRO-3 LoRA and DoRA launches). QLoRA was refused here while the check compared the NF4 weights with torch.equal
    (their bf16 bit patterns include NaNs: unequal even to a copy) and with a base quantized from fp32 into uint8
    storage (other NF4 codes): all 28 weights 'moved'."""
    import torch

    # 1 rank: DeepSpeed's universal checkpoint of the adapter's partitions (the ZeRO-3 reshape tolerance)
    out, log = kill_9_then_resume("zero3.yaml", "qlora", tmp_path, "QLoRA r8 (alpha 16): 135,168 trained", procs=1,
                                  tol=RESHAPE_TOL)
    assert "resuming step 2 saved by 2 ranks on 1 rank: universal checkpoint" in log
    nf4 = qlora_dtypes(_launch_precision(), 3, False)
    assert nf4[1] == nf4[0] == {"bf16": torch.bfloat16, "fp32": torch.float32}[_launch_precision()]
    # the base re-quantized here with the run's dtypes, whose digest (names, dtypes, shapes, packed bytes, quantization
    # state) assert_adapter_run finds in both checkpoints' markers: what the run trained on, though no checkpoint holds it
    fresh = fresh_adapter_model("qlora", nf4)
    q = fresh.get_parameter("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight")
    assert q.dtype == nf4[1] and q.numel() * q.element_size() == 192 * 192 // 2  # 4 bits a weight, in the storage dtype
    assert len([p for p in fresh.parameters() if getattr(p, "quant_state", None) is not None]) == 28
    assert_adapter_run(out, log, "qlora", nf4=nf4)


def assert_adapter_only_states(ckpt: Path, trained: int, tensors: int) -> dict:
    """An adapter run's checkpoint holds the trained (adapter) tensors and Adam's state for them alone, never the base:
    DDP's model.safetensors (the adapter, fp32) and optimizer.bin (fp32 exp_avg / exp_avg_sq per trained tensor),
    ZeRO-3's per-rank optim_states (the fp32 master partition and its two moments) and model_states (no frozen
    fragments; the module's entries are the adapter's empty placeholders). Returns the bytes by part."""
    import torch
    from safetensors import safe_open

    if (ckpt / "optimizer.bin").is_file():  # DDP: accelerate's torch.save of optimizer.state_dict()
        state = torch.load(ckpt / "optimizer.bin", map_location="cpu", weights_only=False)["state"]
        assert len(state) == tensors
        moments = [t for st in state.values() for k, t in st.items() if k in ("exp_avg", "exp_avg_sq")]
        assert sum(t.numel() for t in moments) == 2 * trained and {t.dtype for t in moments} == {torch.float32}
        opt = sum(t.numel() * t.element_size() for st in state.values() for t in st.values() if torch.is_tensor(t))
        files = [ckpt / "optimizer.bin"]
        with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
            shapes = {k: (f.get_slice(k).get_shape(), f.get_slice(k).get_dtype()) for k in f.keys()}
        assert len(shapes) == tensors and {dt for _, dt in shapes.values()} == {"F32"}
        assert sum(torch.Size(sh).numel() for sh, _ in shapes.values()) == trained  # the adapter, nothing else
        model_files = [ckpt / "model.safetensors"]
        # exp_avg + exp_avg_sq: 8 B per trained element, + each tensor's step (a scalar); the weights are the model's
        assert 0 <= opt - 8 * trained <= 8 * tensors, opt
    else:  # ZeRO-3: each rank's partition of every trained tensor (the adapter's are all of even size: no padding)
        files = sorted((ckpt / "pytorch_model").glob("*zero_pp_rank_*_mp_rank_00_optim_states.pt"))
        parts = [torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"] for f in files]
        for key in ("exp_avg", "exp_avg_sq"):
            assert sum(p["optimizer_state_dict"]["state"][0][key].numel() for p in parts) == trained
        assert sum(t.numel() for p in parts for t in p["fp32_flat_groups"]) == trained
        assert {t.dtype for p in parts for t in p["fp32_flat_groups"]} == {torch.float32}
        opt = sum(t.numel() * t.element_size() for p in parts for t in [*p["fp32_flat_groups"],
                  *p["optimizer_state_dict"]["state"][0].values()] if torch.is_tensor(t))
        model_files = sorted((ckpt / "pytorch_model").glob("zero_pp_rank_*_mp_rank_00_model_states.pt"))
        models = [torch.load(f, map_location="cpu", weights_only=False) for f in model_files]
        assert sum(t.numel() for m in models for t in m["module"].values()) == 0  # partitioned: nothing in the module
        assert all(not m.get("frozen_param_fragments") for m in models)  # exclude_frozen_parameters: no base
        # fp32 master + exp_avg + exp_avg_sq: 12 B per trained element, + each rank's step (a scalar)
        assert 0 <= opt - 12 * trained <= 8 * len(files), opt
    # the rest of each file is pickle and config (measured 68 KB under DDP); Adam sized for the base would add >= 24 MB
    overhead = sum(f.stat().st_size for f in files) - opt
    assert 0 <= overhead < 128 * 1024, overhead
    # the whole checkpoint: the adapter, its optimizer, RNG states, marker; it held 12 MB of fp32 (DDP) or 6 MB of bf16
    # (ZeRO-3) base before it became adapter-only; 16 B per trained element + 256 KB covers what it now holds
    total = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    assert total < 16 * trained + 256 * 1024, total
    return {"optimizer": opt, "optimizer_files": sum(f.stat().st_size for f in files),
            "model_files": sum(f.stat().st_size for f in model_files), "checkpoint": total}


@pytest.mark.engine
def test_zero3_dora_survives_kill_9_and_resumes_on_1_rank(tmp_path):
    """DoRA under ZeRO-3 (2 ranks, the base loaded partitioned by zero.Init): rank 1 SIGKILLed after step 4 (its
    checkpoint never written); the step-2 checkpoint the 2 ranks saved holds the adapter's partitions alone, then
    `--resume latest` on 1 rank (DeepSpeed's universal checkpoint, frozen parameters included) redoes steps 3 and 4 on
    the killed run's trajectory and rows and ends with every adapter check (the adapter, DoRA's magnitude vectors
    with it, saved by the 1 resumed rank; a 2-rank gather of partitions before the save: the ZeRO-3 LoRA launch,
    not trl #4416's 40-byte file). This resume crashed in peft's DoRA forward before
    hfscale.scale.adapters.gather_dora_inputs_ (IndexError on lora_A's 0-element partition in the recompute of a
    checkpointed layer)."""
    from hfscale.export.ckpt_export import export, info
    from hfscale.util.errors import HfscaleError

    killed = []
    out, log = kill_9_then_resume("zero3.yaml", "dora", tmp_path, "DoRA r8 (alpha 16): 144,384 trained", procs=1,
                                  tol=RESHAPE_TOL, killed_log=killed)
    assert "DistributedType.DEEPSPEED world 2" in killed[0]
    assert "resuming step 2 saved by 2 ranks on 1 rank: universal checkpoint" in log
    assert_adapter_run(out, log, "dora")
    # 144,384 trained = 28 linears x (8 x in + out x 8 + out); Adam for them alone: 12 B each, over both ranks
    step2 = out / "checkpoints" / "step_00000002"  # saved by the 2 ranks of the killed run, kept (keep-last 2)
    print("ZeRO-3 DoRA checkpoint bytes (2 ranks):", assert_adapter_only_states(step2, 144_384, 1))
    i = info(step2)
    assert i.adapter == "DoRA r8 (alpha 16)" and "adapter DoRA r8 (alpha 16) on a frozen base" in i.lines()[1]
    assert i.lines()[2].startswith("adapter only: the base is not in it; it needs tiny-gemma3 seed 0 (frozen base digest ")
    with pytest.raises(HfscaleError, match="adapter-only checkpoint .*not the base, which export needs"):
        export(step2, tmp_path / "export")
    assert not (tmp_path / "export").exists()
    print("ZeRO-3 DoRA checkpoint bytes (1 rank):", assert_adapter_only_states(out / "checkpoints" / "step_00000004", 144_384, 1))


@pytest.mark.engine
def test_ddp_dora_survives_kill_9_and_resumes_on_1_rank_on_the_uninterrupted_trajectory(tmp_path):
    """DoRA under DDP (2 ranks): rank 1 SIGKILLed after step 4 (both ranks' step 4 logged, its checkpoint never
    written), then `--resume latest` on 1 rank from step 2 (DDP 2 -> 1: the state is whole on every rank, loaded as it
    is; accumulation re-derived) redoes steps 3 and 4 on the killed run's trajectory and rows (restored adapter
    weights, Adam moments of the adapter alone, RNG, data position), and the resumed run passes every adapter check.
    Resumed on 2 ranks it redid them bit for bit (|delta| = 0.0); same-rank resumes after a kill: ZeRO-2 LoRA (kill
    during a save, above, 1e-6), QLoRA under DDP, LoRA under DDP, ZeRO-3 and FSDP2 (each 0.0)."""
    # 1 rank sums the same micro batches in another order: measured |delta| = 0.0 (steps 3, 4); 1e-4, 50x tighter than
    # RESHAPE_TOL (the bf16 ZeRO reshapes), leaves room for that order only
    out, log = kill_9_then_resume("ddp.yaml", "dora", tmp_path, "DoRA r8 (alpha 16): 144,384 trained", procs=1, tol=1e-4)
    assert "at step 2 (saved by 2 ranks, now 1: DDP state is whole on every rank)" in log
    assert "2 micro × 4 accum × 1 ranks × 64 = 512 tokens/step" in log
    assert_adapter_run(out, log, "dora")
    print("DDP DoRA checkpoint bytes:", assert_adapter_only_states(out / "checkpoints" / "step_00000004", 144_384, 84))


@pytest.mark.engine
def test_fsdp2_lora_survives_kill_9_resumes_and_saves_the_adapter_whole(tmp_path):
    """LoRA under FSDP2 (2 ranks, DTensor shards): rank 1 SIGKILLed after step 4 (its checkpoint never written), then
    `--resume latest` on 2 ranks from the adapter-only step-2 checkpoint (torch.distributed.checkpoint shards of the
    adapter and its Adam state; the base rebuilt from the source and checked by digest) redoes steps 3 and 4 on the
    killed run's trajectory and rows; the adapter is gathered from the shards before it is saved (every adapter
    check)."""
    # the same world: the same shards, the same sums; measured |delta| = 0.0 (steps 3, 4)
    out, log = kill_9_then_resume("fsdp2.yaml", "lora", tmp_path, "LoRA r8 (alpha 16): 135,168 trained")
    assert "DistributedType.FSDP world 2" in log and "at step 2" in log
    assert_adapter_run(out, log, "lora")


@pytest.mark.engine
def test_zero2_lora_embedding_survives_kill_9_and_resumes_on_1_rank(tmp_path):
    """LoRA with --lora-embedding under ZeRO-2 (2 ranks): the embedding's pair, shared with the tied lm_head (one
    Parameter each, flattened once by DeepSpeed), trains; rank 1 SIGKILLed after step 4, `--resume latest` on 1 rank
    (universal checkpoint) redoes steps 3 and 4 on the killed run's trajectory and rows; the adapter file holds the pair
    (and peft's lm_head names for it), the merge moved the one tied matrix once and kept it tied (every adapter check)."""
    # 1 rank: DeepSpeed's universal checkpoint (bf16 reshape); by hand: step 3 0.0, step 4 2.9e-4
    out, log = kill_9_then_resume("zero2.yaml", "lora", tmp_path, "LoRA r8 (alpha 16, embedding): 169,472 trained",
                                  "--lora-embedding", "true", procs=1, tol=RESHAPE_TOL)
    assert "resuming step 2 saved by 2 ranks on 1 rank: universal checkpoint" in log
    assert_adapter_run(out, log, "lora", embedding=True)


@pytest.mark.engine
@pytest.mark.parametrize("config, distributed, checkpointing, layers", [
    ("ddp.yaml", "MULTI_CPU", "full", "checkpointed layers [0, 1, 2, 3]"),
    ("zero3.yaml", "DEEPSPEED", "off", None)])
def test_lora_survives_kill_9_and_trains_the_adapter_alone(config, distributed, checkpointing, layers, tmp_path):
    """Plain LoRA on the base in the run's own dtype under DDP (every layer checkpointed: non-reentrant, no input
    gradients needed on the frozen base) and ZeRO-3 (zero.Init partitions the base; no checkpointing): rank 1
    SIGKILLed after step 4 (its checkpoint never written), `--resume latest` on 2 ranks redoes steps 3 and 4 on the
    killed run's trajectory and rows; the adapter gathered from both ranks before it is saved (not trl #4416's 40-byte
    file): every adapter check."""
    # the same world: the same shards, the same sums; measured |delta| = 0.0 (steps 3, 4) under both engines
    killed = []
    out, log = kill_9_then_resume(config, "lora", tmp_path, "LoRA r8 (alpha 16): 135,168 trained",
                                  "--checkpointing", checkpointing, killed_log=killed)
    for text in (*killed, log):
        assert f"DistributedType.{distributed} world 2" in text
        assert (layers in text) if layers else "checkpointed layers" not in text
    assert "at step 2" in log
    assert_adapter_run(out, log, "lora")
