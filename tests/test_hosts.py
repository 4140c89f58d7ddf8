"""Native-bf16 detection (hfscale.util.hosts), the precision a run chooses from it, doctor's warning, and
the training recipe's pre-flight reading precision / micro batch / accumulation from the real launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hfscale.util.hosts import Bf16Support, bf16_support, cpu_bf16, resolve_precision

ROOT = Path(__file__).resolve().parents[1]
AVX2 = cpu_bf16("AVX2", {"avx", "avx2", "fma"})  # an AMD EPYC host measured on 2026-12-04 (AVX2 only)
SPR = cpu_bf16("AVX512", {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})  # a Sapphire Rapids Xeon


def test_cpu_detection_from_capability_and_flags():
    assert AVX2 == Bf16Support(False, "cpu", "AVX2")
    assert SPR.native and SPR.detail == "AVX512 + amx_bf16 avx512_bf16"
    assert not cpu_bf16("AVX512", {"avx512f"}).native  # AVX-512 alone does not compute bf16
    assert cpu_bf16("DEFAULT", {"fp", "asimd", "bf16"}).native  # aarch64 with the BF16 extension


def test_this_host_matches_its_cpuinfo_flags():
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith(("flags", "Features")):
            flags = set(line.split(":", 1)[1].split())
            break
    if os.environ.get("HFSCALE_NATIVE_BF16") in ("0", "1"):
        pytest.skip("detection forced by HFSCALE_NATIVE_BF16")
    assert bf16_support("cpu").native == bool({"avx512_bf16", "amx_bf16", "bf16"} & flags)


@pytest.mark.parametrize("forced,native", [("0", False), ("1", True)])
def test_environment_override(forced, native):
    code = "from hfscale.util.hosts import bf16_support; s = bf16_support('cpu'); print(s.native, s.detail)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "HFSCALE_NATIVE_BF16": forced}).stdout.split()
    assert out[0] == str(native) and f"HFSCALE_NATIVE_BF16={forced}" in " ".join(out)


@pytest.mark.parametrize("requested,launch,host,expected,says", [
    ("auto", "bf16", AVX2, "fp32", "bf16 is emulated on this CPU (AVX2): using fp32"),
    ("auto", "bf16", SPR, "bf16", None),
    ("auto", "fp16", AVX2, "fp16", None),  # auto only ever replaces emulated bf16
    ("auto", "fp32", AVX2, "fp32", None),
    ("launch", "bf16", AVX2, "bf16", None),  # the launch config obeyed as written
    ("bf16", "fp32", AVX2, "bf16", "as asked"),  # an explicit choice is always obeyed
    ("fp32", "bf16", SPR, "fp32", "as asked"),
])
def test_resolve_precision(requested, launch, host, expected, says):
    c = resolve_precision(requested, launch, host, what="the tiny model")
    assert c.precision == expected and c.overridden == (expected != launch)
    assert (c.note is None) if says is None else (says in c.note)


def test_resolve_precision_refuses_unknown():
    from hfscale.util.errors import ConfigError

    with pytest.raises(ConfigError, match="use one of auto, launch, bf16, fp16, fp32"):
        resolve_precision("bfloat16", "bf16", AVX2)


# --- doctor: a warning, not an error, with the measured slowdown ----------------------------------

def test_doctor_warns_bf16_on_emulating_cpu():
    from hfscale.doctor import check

    ds = ROOT / "ds_configs" / "zero2.json"
    found = check(deepspeed=ds, host_bf16=AVX2, cpu_launch=True)
    warn = [f for f in found if f.code == "bf16-emulated-cpu"]
    assert len(warn) == 1 and warn[0].severity == "warning" and "10.6x" in warn[0].what
    assert warn[0].where == f"{ds}:bf16.enabled" and "fp32" in warn[0].fix
    assert not [f for f in check(deepspeed=ds, host_bf16=SPR, cpu_launch=True) if f.code == "bf16-emulated-cpu"]
    assert not [f for f in check(deepspeed=ds, host_bf16=AVX2, cpu_launch=False) if f.code == "bf16-emulated-cpu"]


def test_doctor_cli_exit_0_with_the_warning(cli):
    r = cli("doctor", "--deepspeed", ROOT / "ds_configs" / "zero2.json", cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr  # a warning never fails the check


# --- the recipe's pre-flight reads the real launch ---------------------------------------------------

def _ds_config(tmp_path, precision, **top):
    d = tmp_path / precision
    r = subprocess.run([str(Path(sys.executable).parent / "hfscale"), "config", "zero2", "--precision", precision,
                        "--out-accelerate", d, "--out-deepspeed", d], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    path = d / "zero2.json"
    if top:
        path.write_text(json.dumps({**json.loads(path.read_text()), **top}))
    return path


def _preflight(monkeypatch, tmp_path, ds_file, **over):
    from hfscale.train.config import TrainConfig
    from hfscale.train.loop import preflight

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(ds_file))
    cfg = TrainConfig(**{"seq_len": 64, "global_batch_tokens": 512, "micro_batch": 2, "output_dir": str(tmp_path / "run"),
                         **over})
    return preflight(cfg, force=False, source="my_recipe.yaml")


def _llama_dir(tmp_path):
    """A tiny Llama config dir with the built-in tokenizer (the pre-flight checks the data with the model's own):
    fp16 is refused for Gemma (its activations overflow), not for Llama."""
    from transformers import LlamaConfig

    from hfscale.models import load_tokenizer

    d = tmp_path / "llama"
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=4096, max_position_embeddings=256).save_pretrained(d)
    load_tokenizer("tiny-gemma3").save_pretrained(d)
    return d


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_recipe_accepts_agreeing_launch_of_each_precision(monkeypatch, tmp_path, precision):
    ds = _ds_config(tmp_path, precision)
    model = str(_llama_dir(tmp_path)) if precision == "fp16" else "tiny-gemma3"
    pre = _preflight(monkeypatch, tmp_path, ds, model=model)  # default precision "launch": the JSON decides
    assert pre.launch.precision == precision and pre.precision.precision == precision and not pre.precision.overridden
    assert (pre.plan.micro_batch, pre.plan.accum, pre.launch.world) == (2, 2, 2)
    assert not (tmp_path / "run").exists()  # nothing written by the pre-flight


def test_recipe_auto_precision_on_an_emulating_host(monkeypatch, tmp_path):
    ds = _ds_config(tmp_path, "bf16")
    monkeypatch.setattr("hfscale.util.hosts.bf16_support", lambda device=None: AVX2)
    pre = _preflight(monkeypatch, tmp_path, ds, precision="auto")
    assert pre.precision.precision == "fp32" and pre.precision.overridden
    assert pre.precision.note.startswith("bf16 is emulated on this CPU (AVX2): using fp32 for tiny-gemma3")


def test_recipe_conflict_names_only_the_users_files(monkeypatch, tmp_path):
    from hfscale.util.errors import HfscaleError

    ds = _ds_config(tmp_path, "fp32", train_micro_batch_size_per_gpu=8)  # the recipe runs micro 2
    with pytest.raises(HfscaleError) as e:
        _preflight(monkeypatch, tmp_path, ds)
    msg = str(e.value)
    assert f"{ds}:train_micro_batch_size_per_gpu" in msg and "micro batch 8" in msg and "my_recipe.yaml's micro_batch=2" in msg
    assert "recipe_args" not in msg and "/tmp" not in msg.replace(str(tmp_path), "")
