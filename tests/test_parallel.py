"""Sequence / tensor / context parallel sizes (issue 18): the spec's validation, the model checks (heads,
KV heads per layer kind, TP plan, sliding windows) and `hfscale config --sp/--tp/--cp` refusals."""

import pytest
import yaml

from hfscale.util.errors import ConfigError
from hfscale.scale.accelerate import parallelism_block
from hfscale.scale.parallel import heads, model_problems
from hfscale.scale.spec import Launch, Parallel, ScaleSpec, Zero

N8 = Launch(num_processes=8)


@pytest.mark.parametrize("kw, needle", [
    (dict(parallel=Parallel(sp=3), launch=N8), "--num-processes 6"),
    (dict(parallel=Parallel(sp=2), zero=Zero(stage=1), launch=N8), "--zero 3"),
    (dict(parallel=Parallel(sp=2), engine="fsdp2", launch=N8), "--engine deepspeed"),
    (dict(parallel=Parallel(cp=2), launch=N8), "--engine fsdp2"),
    (dict(parallel=Parallel(tp=2), launch=N8), "--engine fsdp2"),
    (dict(parallel=Parallel(tp=2), engine="ddp", launch=N8), "--num-processes 2"),
    (dict(parallel=Parallel(tp=2), engine="fsdp2", launch=Launch(num_processes=2)), "--engine ddp"),
])
def test_spec_refuses_with_the_fix(kw, needle):
    with pytest.raises(ConfigError, match=needle.replace("-", r"\-")):
        ScaleSpec("x", **kw)


@pytest.mark.parametrize("kw, needle", [
    (dict(sp=2, cp=2), "--cp 1"),
    (dict(sp=2, sp_attention="eager"), "eager / flex_attention"),
    (dict(sp=4, sp_seq_length=1022), "multiple of 4"),
    (dict(tp=0), "positive integer"),
])
def test_parallel_refuses(kw, needle):
    with pytest.raises(ConfigError, match=needle):
        Parallel(**kw)


def test_parallelism_block_fills_data_parallel():
    sp = ScaleSpec("a", zero=Zero(stage=3), launch=N8, parallel=Parallel(sp=2))
    assert sp.data_parallel == 4
    b = parallelism_block(sp)
    assert b["parallelism_config_sp_size"] == 2 and b["parallelism_config_dp_shard_size"] == 4
    assert b["parallelism_config_sp_backend"] == "deepspeed" and b["parallelism_config_sp_attn_implementation"] == "sdpa"
    tp = ScaleSpec("b", engine="fsdp2", launch=N8, parallel=Parallel(tp=4))
    assert parallelism_block(tp) == {"parallelism_config_dp_replicate_size": 1, "parallelism_config_dp_shard_size": 2,
                                     "parallelism_config_tp_size": 4}
    assert parallelism_block(ScaleSpec("c", launch=N8)) == {}


def _codes(parallel, name, **kw):
    from hfscale.models import load_config

    return {p.code for p in model_problems(parallel, load_config(name), **kw)}


def test_gemma4_global_layers_have_fewer_kv_heads():
    from hfscale.models import load_config

    h = heads(load_config("gemma-4-31b"))
    assert h.q == 32 and h.kv == {"sliding_attention": 16, "full_attention": 4}
    assert h.head_dim == {"sliding_attention": 256, "full_attention": 512}
    assert _codes(Parallel(tp=8), "gemma-4-31b") == {"tp-kv-heads"}  # 4 global KV heads: tp <= 4
    assert _codes(Parallel(tp=4), "gemma-4-31b") == set()
    assert "sp-mixed-heads" in _codes(Parallel(sp=2, sp_attention="flash_attention_2"), "gemma-4-31b")


def test_model_checks_bad_and_good():
    from hfscale.testing.zoo import ARCHITECTURES

    assert _codes(Parallel(sp=2), "tiny-gemma3") == {"sp-sliding-window"}  # sdpa loses the window under Ulysses
    assert _codes(Parallel(sp=2), "tiny-gemma3", window_sdpa=True) == set()
    assert _codes(Parallel(sp=2, sp_attention="flash_attention_2"), "gemma-3-27b") == set()
    assert _codes(Parallel(sp=3, sp_attention="flash_attention_2"), "gemma-3-27b") == {"sp-heads", "sp-kv-heads"}
    assert _codes(Parallel(sp=2, sp_attention="flash_attention_2"), "gemma-3-27b", seq_len=1001) == {"sp-seq-len"}
    assert _codes(Parallel(cp=2), "gemma-3-27b") == {"cp-mask"}
    falcon = model_problems(Parallel(tp=2), ARCHITECTURES["falcon"]())
    assert [p.code for p in falcon] == ["tp-no-plan"]
    assert model_problems(Parallel(cp=2), ARCHITECTURES["llama"](), seq_len=4096) == []


NOISE = ("Failed to load", "W1", "W0", "[20")


@pytest.mark.parametrize("args, needle", [
    (["zero3", "--sp", "3"], "--num-processes 6"),
    (["fsdp2", "--tp", "8", "--num-processes", "16", "--model", "gemma-4-31b"], "set tp to one of 1, 2, 4"),
    (["fsdp2", "--cp", "2", "--model", "gemma-3-27b"], "set cp 1"),
])
def test_config_refuses_in_one_line_and_writes_nothing(tmp_path, cli, args, needle):
    r = cli("config", *args, "--name", "x", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip() and not ln.lstrip().startswith(NOISE)]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []


def test_config_writes_sp_that_accelerate_reads(tmp_path, cli):
    from accelerate import ParallelismConfig
    from accelerate.commands.config.config_args import load_config_from_file

    r = cli("config", "zero3", "--name", "z3sp4", "--sp", "4", "--sp-attention", "flash_attention_2",
            "--model", "gemma-3-27b", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    cfg = load_config_from_file(str(tmp_path / "accelerate_configs" / "z3sp4.yaml"))
    pc = ParallelismConfig(**{k.removeprefix("parallelism_config_"): v for k, v in cfg.parallelism_config.items()
                              if k.removeprefix("parallelism_config_") in ParallelismConfig.__dataclass_fields__})
    assert (pc.sp_size, pc.dp_shard_size, pc.total_size) == (4, 2, 8)
    assert yaml.safe_load((tmp_path / "accelerate_configs" / "z3sp4.yaml").read_text())["num_processes"] == 8


# --- doctor: one bad and one good input per N-D check -------------------------------------------------

import copy  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

from hfscale.doctor import check_setup  # noqa: E402
from hfscale.doctor.inputs import Setup  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SP = yaml.safe_load((ROOT / "accelerate_configs" / "zero3_sp2.yaml").read_text())
TP = yaml.safe_load((ROOT / "accelerate_configs" / "fsdp2_tp2.yaml").read_text())
DS3 = json.loads((ROOT / "ds_configs" / "zero3.json").read_text())


def acc(base, **block):
    a = copy.deepcopy(base)
    for k, v in block.items():
        if k == "distributed_type":
            a[k] = v
        elif v is None:
            a["parallelism_config"].pop("parallelism_config_" + k, None)
        else:
            a["parallelism_config"]["parallelism_config_" + k] = v
    return a


def _model(name):
    from hfscale.models import load_config
    from hfscale.testing.zoo import ARCHITECTURES

    return ARCHITECTURES[name]() if name in ARCHITECTURES else load_config(name)


SDPA = acc(SP, sp_attn_implementation="sdpa")


def M(name):
    return dict(model_config=_model(name), model_name=name)


DOCTOR = [
    ("parallel-mesh", Setup(accelerate=SP, num_processes=2), Setup(accelerate=SP, num_processes=8)),
    ("parallel-mesh", Setup(accelerate=acc(SP, dp_shard_size=None)), Setup(accelerate=acc(SP, dp_shard_size=4))),
    ("unknown-key", Setup(accelerate=acc(SP, sp_sise=2)), Setup(accelerate=SP)),
    ("parallel-size", Setup(accelerate=acc(SP, sp_size="2")), Setup(accelerate=SP)),
    ("parallel-sp-cp", Setup(accelerate=acc(SP, cp_size=2, dp_shard_size=2)), Setup(accelerate=acc(SP, cp_size=None))),
    ("sp-engine", Setup(accelerate=acc(SP, distributed_type="FSDP")), Setup(accelerate=SP)),
    ("sp-zero", Setup(accelerate=SP, deepspeed={**DS3, "zero_optimization": {"stage": 1}}), Setup(accelerate=SP, deepspeed=DS3)),
    ("sp-attention", Setup(accelerate=acc(SP, sp_attn_implementation="eager")), Setup(accelerate=SP)),
    ("sp-attention-mismatch", Setup(accelerate=SP, args={"attn_implementation": "sdpa"}),
     Setup(accelerate=SP, args={"attn_implementation": "flash_attention_2"})),
    ("cp-engine", Setup(accelerate=acc(TP, tp_size=None, cp_size=2, distributed_type="DEEPSPEED")),
     Setup(accelerate=acc(TP, tp_size=None, cp_size=2))),
    ("tp-engine", Setup(accelerate=acc(TP, distributed_type="DEEPSPEED")), Setup(accelerate=TP)),
    ("tp-no-plan", Setup(accelerate=TP, **M("falcon")), Setup(accelerate=TP, **M("llama"))),
    ("tp-kv-heads", Setup(accelerate=acc(TP, tp_size=8, dp_shard_size=1), num_processes=8, **M("gemma-4-31b")),
     Setup(accelerate=acc(TP, tp_size=4, dp_shard_size=2), num_processes=8, **M("gemma-4-31b"))),
    ("sp-sliding-window", Setup(accelerate=SDPA, **M("tiny-gemma3")), Setup(accelerate=SDPA, args={"sp_window_sdpa": True}, **M("tiny-gemma3"))),
    ("sp-sliding-window", Setup(accelerate=SDPA, **M("tiny-gemma3")), Setup(accelerate=SP, **M("tiny-gemma3"))),
    ("tp-accumulation", Setup(accelerate=TP, args={"gradient_accumulation_steps": 4}, **M("tiny-gemma3")),
     Setup(accelerate=TP, args={"gradient_accumulation_steps": 1}, **M("tiny-gemma3"))),
    ("sp-mixed-heads", Setup(accelerate=SP, **M("gemma-4-31b")), Setup(accelerate=SP, **M("gemma-3-27b"))),
    ("cp-mask", Setup(accelerate=acc(TP, tp_size=None, cp_size=2), **M("gemma-3-27b")),
     Setup(accelerate=acc(TP, tp_size=None, cp_size=2), **M("llama"))),
]


@pytest.mark.parametrize("code, bad, good", DOCTOR, ids=[c[0] for c in DOCTOR])
def test_doctor_nd_check_fires_on_bad_and_not_on_good(code, bad, good):
    found = [f for f in check_setup(bad) if f.code == code]
    assert found, f"{code} not found"
    assert found[0].fix.startswith(("set ", "did you mean", "launch ", "use ")), found[0].fix
    assert code not in {f.code for f in check_setup(good)}


def test_doctor_mesh_fix_is_the_exact_value():
    f = next(f for f in check_setup(Setup(accelerate=SP, num_processes=4)) if f.code == "parallel-mesh")
    assert f.fix == "set parallelism_config_dp_shard_size: 2"


# --- planner -------------------------------------------------------------------------------------------


def test_plan_memory_with_sp_tp():
    from hfscale.models import load_config
    from hfscale.models.dims import dims_from_config
    from hfscale.plan.memory import Strategy, activation_bytes, predict
    from hfscale.plan.parallel import params_per_tp_rank, predict_parallel

    d = dims_from_config(load_config("gemma-3-27b"))
    base = dict(zero=3, seq_len=65536, checkpointing="full")
    one, sp8 = predict(d, Strategy(dp=32, **base)), predict_parallel(d, Strategy(dp=4, sp=8, **base))
    # SP: ZeRO still shards over all 32 ranks, activations are those of S/8 tokens, plus the all-to-all buffers
    assert sp8["weights"] == one["weights"] and sp8["optimizer"] == one["optimizer"]
    assert sp8["activations"] == activation_bytes(d, 1, 65536 // 8, "bf16", "full")["total"]
    assert sp8["parallel_buffers"]["sp_all_to_all"] > 0 and sp8["total"] < one["total"] / 4
    # TP: the split linears / tp, embeddings and norms replicated
    tp4 = predict_parallel(d, Strategy(dp=8, tp=4, **base))
    assert d.params / 4 < params_per_tp_rank(d, 4) < d.params / 3
    assert tp4["params_per_rank"] == params_per_tp_rank(d, 4)


def test_plan_json_carries_sp_tp_cp_and_write_emits_parallelism(tmp_path, cli):
    import json

    r = cli("plan", "--model", "gemma-3-27b", "--seq-len", "131072", "--micro-batch", "1", "--gpus-per-node", "8",
            "--nodes", "4", "--gpu-mem", "80GB", "--json", "--write", tmp_path / "w", "--fast")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for row in out["candidates"] + [out["pick"]]:
        assert all(isinstance(row[k], int) and row[k] >= 1 for k in ("sp", "tp", "cp", "dp", "micro_batch"))
        assert isinstance(row["zero"], int)
    assert {(r["sp"], r["tp"]) for r in out["candidates"]} >= {(1, 1), (2, 1), (8, 1), (1, 4)}
    assert out["pick"]["sp"] == 8 and out["pick"]["dp"] * out["pick"]["sp"] == 32
    y = yaml.safe_load(next((tmp_path / "w").glob("plan.yaml")).read_text())
    assert y["parallelism_config"]["parallelism_config_sp_size"] == 8
    assert y["parallelism_config"]["parallelism_config_dp_shard_size"] == 4


def test_plan_gemma4_1m_says_by_how_much_nothing_fits(cli):
    """Past what the levers reach (tests/test_long_context.py: 256K fits on 4 x 8 x 80 GB with them): 1M tokens on
    one node of 8 x 80 GB; the smallest candidate (SP8 with every lever) says by how much it is over."""
    r = cli("plan", "--model", "gemma-4-31b", "--seq-len", "1048576", "--micro-batch", "1", "--gpus-per-node", "8",
            "--gpu-mem", "80GB", "--fast")
    assert r.returncode == 1, r.stderr
    assert "nothing fits" in r.stdout and "GB over 80 GB" in r.stdout and "SP8 +cpu +tiled+act-offload" in r.stdout


@pytest.mark.parametrize("args, needle", [
    (["--sp", "3"], "set sp to one of"),
    (["--sp", "2", "--tp", "2"], "do not compose"),
    (["--tp", "16", "--gpus-per-node", "8"], "more than one node"),
])
def test_plan_refuses_bad_sizes(tmp_path, cli, args, needle):
    r = cli("plan", "--model", "gemma-3-27b", "--seq-len", "4096", "--micro-batch", "1", *args, cwd=tmp_path)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("env, needle", [
    ({"PARALLELISM_CONFIG_SP_SIZE": "3", "ACCELERATE_USE_DEEPSPEED": "true"}, "set sp to one of 1, 2, 4"),
    ({"PARALLELISM_CONFIG_SP_SIZE": "2"}, "runs under DeepSpeed only"),
])
def test_recipe_refuses_a_bad_parallel_launch_before_the_model_loads(tmp_path, env, needle):
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "recipes" / "train_clm.py"), "--config", str(root / "recipes" / "tiny" / "train.yaml"),
                        "--output-dir", str(tmp_path / "out")], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "ACCELERATE_USE_PARALLELISM_CONFIG": "true", **env})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("train_clm:")]
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert list(tmp_path.iterdir()) == []
