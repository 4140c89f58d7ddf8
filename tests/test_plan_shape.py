"""hfscale.plan.shape: the planner's view of a config, cached so a repeated `plan` imports neither
transformers nor torch, and gives the same answer as resolving the config with transformers."""

import json
import os
import subprocess
import sys

import pytest

from hfscale.models import dimension_configs, known_names, load_config
from hfscale.plan.shape import ModelShape, model_shape, shape_of


@pytest.mark.parametrize("name", known_names())
def test_shape_round_trips_exactly(name):
    shape = shape_of(load_config(name))
    assert shape.dims is not None and shape.layers == shape.dims.layers
    assert ModelShape.from_dict(json.loads(json.dumps(shape.to_dict()))) == shape


def test_unsupported_architecture_keeps_the_reason(tmp_path, monkeypatch):
    from hfscale.testing.zoo import ARCHITECTURES

    monkeypatch.setenv("HFSCALE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "m").mkdir()
    ARCHITECTURES["qwen3"]().save_pretrained(tmp_path / "m")
    cold, warm = model_shape(str(tmp_path / "m")), model_shape(str(tmp_path / "m"))
    assert cold == warm and cold.dims is None and "qwen3" in cold.dims_error
    assert cold.heads.tp_plan and cold.layers == ARCHITECTURES["qwen3"]().num_hidden_layers


PLAN = ["plan", "--seq-len", "4096", "--micro-batch", "1", "--gpus-per-node", "8", "--json", "--fast"]
SCRIPT = """
import contextlib, io, json, sys
from hfscale.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "out": out.getvalue(), "torch": "torch" in sys.modules, "transformers": "transformers" in sys.modules}))
"""


def _plan(env, *args):
    r = subprocess.run([sys.executable, "-c", SCRIPT, *PLAN, *args], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_warm_plan_imports_no_torch_and_answers_the_same(tmp_path):
    env = {**os.environ, "HFSCALE_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    config = tmp_path / "config.json"
    config.write_text(dimension_configs()["gemma-4-26b-a4b"].read_text())
    cold, warm = _plan(env, "--model", "gemma-3-27b"), _plan(env, "--model", "gemma-3-27b")
    assert cold["torch"] and cold["transformers"]  # the first plan resolves the config with transformers
    assert not warm["torch"] and not warm["transformers"]
    assert warm["rc"] == cold["rc"] == 0 and warm["out"] == cold["out"]
    assert json.loads(warm["out"])["pick"]["strategy"]
    # a user's config file: cached by its bytes, so an edit is a new entry, not a stale answer
    first = json.loads(_plan(env, "--model", str(config))["out"])
    data = json.loads(config.read_text())
    data["num_hidden_layers"] = 2 * data["num_hidden_layers"]
    data["layer_types"] = 2 * data["layer_types"]
    config.write_text(json.dumps(data))
    edited = _plan(env, "--model", str(config))
    assert edited["torch"] and json.loads(edited["out"])["params"] > first["params"]


def test_warm_default_plan_reads_cached_steps_without_torch(tmp_path):
    """The default plan traces every candidate; a second run reads each step from the cache (no config, no torch)."""
    env = {**os.environ, "HFSCALE_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    args = ["plan", "--model", "gemma-3-270m", "--seq-len", "1024", "--micro-batch", "1", "--gpus-per-node", "2",
            "--gpu-mem", "80GB", "--json"]

    def run():
        r = subprocess.run([sys.executable, "-c", SCRIPT, *args], env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout.strip().splitlines()[-1])

    cold, warm = run(), run()
    assert cold["torch"] and not warm["torch"] and not warm["transformers"]
    assert warm["out"] == cold["out"]
    out = json.loads(warm["out"])
    assert out["prediction"]["source"] == "trace" and out["prediction"]["trace"]["kernels"] == "cuda"
    # every row that could be the pick is traced (the cheapest fits here); costlier ones say why they were not
    cost = out["pick"]["cost"]
    assert all(c["peak_source"] == "trace" for c in out["candidates"] if c["cost"] <= cost)
    assert all("costlier than the pick" in c["prediction"]["peak_not_traced"] for c in out["candidates"] if c["cost"] > cost)


def test_a_model_without_attention_heads_keeps_why():
    from transformers import MambaConfig

    shape = shape_of(MambaConfig(num_hidden_layers=2))
    assert shape.heads is None and "mamba" in shape.heads_error and shape.layers == 2
    assert ModelShape.from_dict(json.loads(json.dumps(shape.to_dict()))) == shape
