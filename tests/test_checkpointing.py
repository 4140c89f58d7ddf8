"""Activation checkpointing has one home (hfscale.scale.checkpointing), and every:K survives leaving hfscale:
what `hfscale plan --write` picked and costed is what trains, in the recipe, under HF Trainer and in a
plain accelerate loop, counted layer by layer in real 2-process runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hfscale.scale.checkpointing import checkpointed_layers, every_n_layers, parse_checkpointing, resolve
from hfscale.util.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_one_parser_one_layer_choice():
    assert [parse_checkpointing(m) for m in ("off", "full", "every:3")] == [("off", 1), ("full", 1), ("every", 3)]
    assert [every_n_layers(m) for m in ("off", "full", "every:3")] == [None, 1, 3]
    assert resolve("auto", 26) == "every:5" and resolve("auto", 1) == "full"
    assert checkpointed_layers("every:2", 4) == [0, 2] and checkpointed_layers("auto", 9) == [0, 3, 6]
    with pytest.raises(ConfigError, match="every:K"):
        parse_checkpointing("every:0")


def test_planner_and_memory_count_the_layers_the_model_checkpoints():
    """The planner's candidates use auto's K, aligned to the layer pattern (Gemma 3: 5 sliding + 1 global)."""
    from hfscale.scale.checkpointing import resolve
    from hfscale.plan import Hardware, plan

    # 26 layers: sqrt -> every:5, aligned to the 6-layer pattern -> every:6
    assert resolve("auto", 26) == "every:5" and resolve("auto", 26, period=6) == "every:6"
    rows = plan("gemma-3-1b", 1024, 1, hardware=Hardware(8, 1, 80 * 10**9), global_batch_tokens=8 * 1024, method="fast")
    assert {r.checkpointing for r in rows.candidates} == {"off", "every:6", "full"}


def test_training_arguments_carry_every_n_layers():
    from hfscale.scale.runtime import training_arguments_kwargs
    from hfscale.scale.spec import ScaleSpec

    kw = training_arguments_kwargs(ScaleSpec("x", gradient_checkpointing="every:3"))
    assert kw["gradient_checkpointing"] is True
    assert kw["gradient_checkpointing_kwargs"] == {"use_reentrant": False, "every_n_layers": 3}
    assert "gradient_checkpointing_kwargs" not in training_arguments_kwargs(ScaleSpec("x"))


def test_trainer_with_fsdp2_on_a_cpu_host_is_refused_in_one_line(monkeypatch):
    from hfscale.scale import runtime
    from hfscale.scale.spec import ScaleSpec

    monkeypatch.setattr(runtime, "cpu_only_host", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "2")  # inside a 2-process launch (outside one, a plan is only written)
    with pytest.raises(ConfigError, match="does not apply FSDP2 on a CPU-only host"):
        runtime.training_arguments_kwargs(ScaleSpec("x", engine="fsdp2"))
    monkeypatch.setattr(runtime, "cpu_only_host", lambda: False)  # on GPUs Trainer's accelerate applies it
    assert runtime.training_arguments_kwargs(ScaleSpec("x", engine="fsdp2"))["bf16"] is True
    monkeypatch.setattr(runtime, "cpu_only_host", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert runtime.training_arguments_kwargs(ScaleSpec("x", engine="fsdp2"))["use_cpu"] is True


def test_fsdp2_checkpointing_is_written_for_the_training_code():
    """accelerate's fsdp_activation_checkpointing fails on transformers' decoder layers (measured with Gemma 3): full and
    every:K are applied by the training code, the YAML says how; the 2-process recompute count is in tests/test_engine.py."""
    from hfscale.scale.accelerate import render_yaml, to_accelerate
    from hfscale.scale.spec import ScaleSpec

    for mode, k in (("every:2", 2), ("full", 1)):
        spec = ScaleSpec("x", engine="fsdp2", gradient_checkpointing=mode)
        assert to_accelerate(spec)["fsdp_config"]["fsdp_activation_checkpointing"] is False
        assert f"every_n_layers={k}" in render_yaml(spec, "x.yaml")


def test_launch_that_checkpoints_with_accelerate_is_refused_in_one_line():
    from hfscale.scale.checkpointing import with_launch

    assert with_launch("every:2", False) == "every:2"
    for mode in ("every:2", "full", "off"):
        with pytest.raises(ConfigError, match="fsdp_activation_checkpointing: true"):
            with_launch(mode, True)


# --- end to end: plan --write -> 2 processes, three ways ----------------------------------------

SEQ, TOKENS = 128, 2 * 128 * 2 * 2  # micro 1-2 x accum x 2 ranks x 128


def _gpu_mem_that_picks_every_2(precision):
    """A GPU size at which the cheapest fitting strategy for the tiny model checkpoints every 2nd layer."""
    from hfscale.plan import Hardware, plan

    def ranked(gpu_mem):  # the default plan, as the CLI below runs it (traced, CUDA kernels for GPUs); DeepSpeed and
        # DDP only: the picked config runs under HF Trainer too, which cannot run FSDP2 on a CPU host
        return plan("tiny-gemma3", SEQ, 1, precision=precision, hardware=Hardware(2, 1, gpu_mem), global_batch_tokens=TOKENS,
                    engines=("ddp", "deepspeed"))

    for peak in sorted({r.peak_bytes for r in ranked(10**12).candidates}):
        best = ranked(peak).pick
        if best and best.checkpointing == "every:2" and best.offload == "none":
            return peak, best.to_dict()
    raise AssertionError("no GPU size makes the planner pick every:2")


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory):
    from hfscale.util.hosts import bf16_support, resolve_precision

    precision = resolve_precision("auto", "bf16", bf16_support("cpu")).precision  # fp32 where bf16 is emulated
    gpu_mem, best = _gpu_mem_that_picks_every_2(precision)
    out = tmp_path_factory.mktemp("plan") / "cfg"
    exe = Path(sys.executable).parent / "hfscale"
    r = subprocess.run([str(exe), "plan", "--model", "tiny-gemma3", "--seq-len", str(SEQ), "--micro-batch", "1",
                        "--precision", precision, "--gpus-per-node", "2", "--gpu-mem", f"{gpu_mem}B",
                        "--global-batch-tokens", str(TOKENS), "--engines", "ddp,deepspeed", "--write", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert f"pick: {best['strategy']}" in r.stdout and "every:2" in best["strategy"]
    return out, best


def test_plan_write_states_every_k_in_each_file(plan_dir):
    out, best = plan_dir
    args = yaml.safe_load((out / "training_args.yaml").read_text())
    assert args["gradient_checkpointing"] is True and args["gradient_checkpointing_kwargs"]["every_n_layers"] == 2
    recipe = yaml.safe_load((out / "recipe.yaml").read_text())
    assert recipe["checkpointing"] == "every:2" and recipe["micro_batch"] == best["micro_batch"]
    ds = json.loads(next(out.glob("*.json")).read_text())
    assert ds["zero_optimization"]["stage"] == best["zero"]


@pytest.mark.engine
@pytest.mark.parametrize("way", ["recipe", "trainer", "loop"])
def test_every_k_trains_as_planned(plan_dir, tmp_path, way):
    from hfscale.proofs.engine import free_port

    out, best = plan_dir
    yaml_cfg = next(p for p in out.glob("*.yaml") if p.name not in ("training_args.yaml", "recipe.yaml"))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(yaml_cfg), "--num_processes", "2",
           "--num_machines", "1", "--machine_rank", "0", "--main_process_port", str(free_port()),
           str(ROOT / "tests" / "scripts" / "ckpt_probe.py"), way, str(out), str(tmp_path)]
    log = tmp_path / "launch.log"
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, timeout=900,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}).returncode
    assert rc == 0, log.read_text()[-3000:]
    for rank in (0, 1):
        r = json.loads((tmp_path / f"{way}_rank{rank}.json").read_text())
        assert r["world"] == 2
        n = r["micro_batches"]
        # layers 0 and 2 of 4 run forward twice per micro batch (recomputed in backward), 1 and 3 once
        assert r["calls_per_layer"] == [2 * n, n, 2 * n, n], (way, r)
        # the process group is gone before interpreter shutdown in every way (hfscale.scale.runtime.end_process_group_at_exit)
        assert (tmp_path / f"{way}_exit_rank{rank}.txt").read_text() == "False", way
