"""Sequence / tensor / context parallel sizes (issue 18): the spec's validation, the model checks (heads,
KV heads per layer kind, TP plan, sliding windows) and `hfscale config --sp/--tp/--cp` refusals."""

import pytest
import yaml

from hfscale.errors import ConfigError
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
    from hfscale.plan.zoo import ARCHITECTURES

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
    (["zero3", "--sp", "2", "--model", "gemma-4-31b"], "AmbiguousGlobalPerLayerAttributeError"),
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
