"""Issue 30: `pip install hfscale` is a light core; every verb that needs an extra says which, in one line.

One fresh venv (no system site-packages, so nothing of the project's own venv leaks in) gets the CPU torch
first, as `make install` does, then the wheel `python -m build` makes of this tree, with only the core
dependencies. Then: torch is the same install as before (the wheel did not replace it), no extra is
importable, `config` / `doctor` / `plan` / `tiny` / the recipe under one process run, and the verbs that
need an extra exit 2 with the one line that names it, writing nothing. Built once per run (~100 s here:
torch from the local wheel ~50 s, the core stack ~45 s, on 2 shared cores), marked slow.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hfscale.util.extras import EXTRAS, line

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CORE_STACK = ["transformers", "accelerate", "datasets", "peft", "safetensors", "tokenizers", "pyyaml", "tqdm"]


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return {**env, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _run(cmd, cwd, timeout=900):
    """Run in `cwd`, never this checkout (`python -c` would import its hfscale from the working directory)."""
    return subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=_env())


def _ok(r):
    assert r.returncode == 0, (r.args, r.stdout[-2000:], r.stderr[-3000:])
    return r


def _torch_stamp(py, cwd):
    code = "import os, torch; d = os.path.dirname(torch.__file__); print(torch.__version__, d, os.stat(d).st_ino, os.stat(torch.__file__).st_mtime_ns)"
    return _ok(_run([py, "-c", code], cwd)).stdout.strip()


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    import torch

    d = tmp_path_factory.mktemp("core_install")
    venv = d / "venv"
    _ok(_run([sys.executable, "-m", "venv", venv], d))
    py = venv / "bin" / "python"
    pip = [py, "-m", "pip", "install", "-q"]
    # torch first and alone, the version this suite runs (Makefile: TORCH_SPEC / TORCH_PIP_ARGS)
    torch_spec = os.environ.get("TORCH_SPEC", f"torch=={torch.__version__.split('+')[0]}")
    _ok(_run([*pip, *os.environ.get("TORCH_PIP_ARGS", "").split(), torch_spec], d))
    before = _torch_stamp(py, d)
    # the wheel, built from a copy of this tree (the build writes build/ and *.egg-info beside its sources)
    src = d / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__",
                                                             ".pytest_cache", "demo_out", "runs", "proof_out"))
    _ok(_run([*pip, "build"], d))
    _ok(_run([py, "-m", "build", "--wheel", "--outdir", d / "dist", src], d))
    wheels = list((d / "dist").glob("hfscale-*.whl"))
    assert len(wheels) == 1, wheels
    r = _ok(_run([*pip, "-c", ROOT / "requirements.lock", wheels[0]], d))
    return {"venv": venv, "py": py, "hfscale": venv / "bin" / "hfscale", "torch_before": before,
            "install_log": r.stdout + r.stderr, "work": d}


def test_wheel_installs_core_only_beside_torch(core, tmp_path):
    py = core["py"]
    assert _torch_stamp(py, tmp_path) == core["torch_before"], "installing the wheel replaced torch"
    where = _ok(_run([py, "-c", "import hfscale; print(hfscale.__file__)"], tmp_path)).stdout.strip()
    assert str(core["venv"]) in where, where  # the installed wheel, not this checkout
    mods = sorted({m for ms in EXTRAS.values() for m in ms})
    code = f"import importlib.util as u; print(' '.join(m for m in {mods!r} if u.find_spec(m)))"
    assert _ok(_run([py, "-c", code], tmp_path)).stdout.strip() == "", "an extra came with the core install"
    code = f"import importlib.util as u; print(' '.join(m for m in {[*CORE_STACK[:-2], 'yaml']!r} if not u.find_spec(m)))"
    assert _ok(_run([py, "-c", code], tmp_path)).stdout.strip() == ""
    _ok(_run([py, "-m", "pip", "check"], tmp_path))


def _run_together(cmds, cwd, timeout=900):
    """Independent commands as _run runs each, started at once (their imports overlap on the 2 cores)."""
    from conftest import kill_tree

    procs = [subprocess.Popen([str(c) for c in cmd], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_env(), start_new_session=True) for cmd in cmds]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
        return [subprocess.CompletedProcess(p.args, p.returncode, *out) for p, out in zip(procs, outs)]
    finally:
        for p in procs:
            kill_tree(p)


def test_core_verbs_run(core, tmp_path):
    exe = core["hfscale"]
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_micro_batch_size_per_gpu": "8", "gradient_accumulation_stepz": 1}')
    # import hfscale in a Trainer script: the DDP pieces need no extra
    code = ("import hfscale; from transformers import TrainingArguments; "
            "a = TrainingArguments('o', **hfscale.training_arguments_kwargs(hfscale.preset('ddp'))); "
            "acc = hfscale.make_accelerator(); print(acc.num_processes, a.max_grad_norm)")
    # first the five that read nothing another writes, at once; then the two that read what config and tiny wrote
    config, plan, typo, tiny, script = _run_together([
        [exe, "config", "zero2", "--num-processes", "2", "--out-accelerate", "cfg", "--out-deepspeed", "cfg"],
        [exe, "plan", "--model", "gemma-3-270m", "--seq-len", "1024", "--micro-batch", "1", "--gpus-per-node", "8",
         "--gpu-mem", "80GB"],
        [exe, "doctor", "--deepspeed", bad],
        [exe, "tiny", "--out", "tiny_model"],
        [core["py"], "-c", code]], tmp_path)
    _ok(config)
    assert (tmp_path / "cfg" / "zero2.yaml").is_file() and (tmp_path / "cfg" / "zero2.json").is_file()
    assert "pick:" in _ok(plan).stdout
    # doctor reads the DeepSpeed JSON without DeepSpeed; the ZeRO-key typo check says what it needs
    assert typo.returncode == 1 and "gradient_accumulation_steps" in typo.stdout, typo.stdout
    _ok(tiny)
    assert _ok(script).stdout.split()[-2:] == ["1", "1.0"]
    # the recipe, one process (what a DDP rank runs), a handful of tokens
    r, doctor = _run_together([
        [core["py"], ROOT / "recipes" / "train_clm.py", "--config", ROOT / "recipes" / "tiny" / "train.yaml",
         "--model", "tiny_model", "--max-steps", "1", "--seq-len", "32", "--micro-batch", "2",
         "--global-batch-tokens", "64", "--eval-every", "0", "--save-every", "0", "--eval-blocks", "2",
         "--output-dir", "run", "--progress", "false", "--precision", "fp32"],
        [exe, "doctor", "--accelerate", "cfg/zero2.yaml", "--model", "tiny-gemma3"]], tmp_path)
    assert "step 1/1" in _ok(r).stdout and (tmp_path / "run" / "model" / "model.safetensors").is_file()
    assert "0 error(s)" in _ok(doctor).stdout and line("checking them against DeepSpeed's schema", "deepspeed") in doctor.stdout


@pytest.mark.parametrize("args, expected", [
    (["quantize", "tiny-gemma3", "--format", "gguf", "--out", "m.gguf"], line("hfscale quantize --format gguf", "edge")),
    (["quantize", "tiny-gemma3", "--format", "pte", "--out", "m.pte"], line("hfscale quantize --format pte", "edge")),
    (["quantize", "tiny-gemma3", "--scheme", "8da4w", "--out", "q"], line("hfscale quantize --scheme 8da4w", "quant")),
    (["quantize", "tiny-gemma3", "--scheme", "nf4", "--out", "q"], line("hfscale quantize --scheme nf4", "quant")),
    (["prove", "--config", "{root}/accelerate_configs/zero2.yaml"],
     line("hfscale prove --config {root}/accelerate_configs/zero2.yaml (DeepSpeed)", "deepspeed")),
    (["profile", "--config", "{root}/accelerate_configs/zero3.yaml", "--out", "prof"],
     line("hfscale profile --config {root}/accelerate_configs/zero3.yaml (DeepSpeed)", "deepspeed")),
    (["plan", "--model", "gemma-3-270m", "--seq-len", "1024", "--micro-batch", "1", "--gpus-per-node", "8",
      "--gpu-mem", "80GB", "--plot", "p.png"], line("hfscale plan --plot", "plot")),
    (["demo", "--out", "d"], line("hfscale demo", "deepspeed")),
])
def test_verbs_needing_an_extra_say_which(core, tmp_path, args, expected):
    args = [a.format(root=ROOT) for a in args]
    r = _run([core["hfscale"], *args], tmp_path)
    assert r.returncode == 2, (r.stdout[-1000:], r.stderr[-2000:])
    assert r.stderr.strip() == expected.format(root=ROOT), r.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written
