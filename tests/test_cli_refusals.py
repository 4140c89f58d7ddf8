"""Issue 16, items 4-5: invalid output is refused instead of written with exit 0, flags that contradict
each other (or would be ignored) are refused instead of dropped, and a model argument that is not a
model is named for what it is. Every case: the documented exit code, one line on stderr, no traceback,
nothing written."""

import json
import re
import shutil

import pytest

# third-party import noise on stderr (torchao's optional CUDA kernels, torch's pytree deprecation,
# DeepSpeed's accelerator line): not hfscale's error line (issue 16's "quiet by default" item)
NOISE = ("Failed to load", "W1", "W0", "[20", "Loading weights", "Writing model")


def _one_line(r, code=2):
    assert r.returncode == code, (r.returncode, r.stdout[-500:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip() and not ln.lstrip().startswith(NOISE)]
    assert len(lines) == 1, r.stderr
    return lines[0]


def _files(d):
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


PLAN = ["plan", "--model", "tiny-gemma3", "--seq-len", "128", "--micro-batch", "1"]


REFUSALS = [
    # non-finite numbers never reach a DeepSpeed JSON (json.dumps would write NaN / Infinity)
    (["config", "zero2", "--clip", "nan"], "finite"),
    (["config", "zero2", "--clip", "inf"], "finite"),
    (["config", "--spec", "{spec_nan}"], "finite"),
    # an engine and a ZeRO stage that contradict it
    (["config", "--engine", "ddp", "--zero", "3"], "--zero 3 is a DeepSpeed ZeRO stage but the engine is ddp"),
    (["config", "fsdp2", "--zero", "2"], "the engine is fsdp2"),
    (["config", "zero3", "--engine", "ddp"], "would drop its ZeRO settings"),
    # a data-parallel size of 0 is refused, not turned into 1
    (PLAN + ["--dp", "0"], "--dp"),
    (PLAN + ["--gpus-per-node", "8", "--dp", "0"], "--dp"),
    (PLAN + ["--gpus-per-node", "8", "--nodes", "0"], "--nodes"),
    # hardware or serving flags that would be ignored
    (PLAN + ["--gpu-mem", "80GB"], "--gpu-mem is only used with --gpus-per-node"),
    (PLAN + ["--nodes", "2", "--plot", "{out}/p.png"], "--nodes is only used with --gpus-per-node"),
    (PLAN + ["--global-batch-tokens", "4096"], "--global-batch-tokens is only used with --gpus-per-node"),
    (PLAN + ["--quant", "int4"], "--quant is only used with --inference"),
    (PLAN + ["--inference", "--batch", "0"], "--batch"),
    # sizes that are numbers but not finite
    (PLAN + ["--gpus-per-node", "8", "--gpu-mem", "nanGB"], "cannot read size 'nanGB'"),
    (PLAN + ["--gpus-per-node", "8", "--gpu-mem", "infGB"], "cannot read size 'infGB'"),
]


def run_each_in_its_own_dir(tmp_path_factory, cases, prepare, argv):
    """Every case's real CLI run, each in a fresh directory of its own that prepare(dir) lays out, several at once
    (their imports overlap on the suite's 2 cores; none reads what another writes): a list of (dir, files in it
    before the run, CompletedProcess), in the cases' order."""
    from conftest import run_cli_concurrently

    dirs = [tmp_path_factory.mktemp("case") for _ in cases]
    before = []
    for d in dirs:
        prepare(d)
        before.append(_files(d))
    runs = run_cli_concurrently(*[{"args": argv(args, d), "cwd": d} for (args, _), d in zip(cases, dirs)])
    return list(zip(dirs, before, runs, strict=True))


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    def argv(args, d):
        args = [a.format(spec_nan=d / "spec.yaml", out=d / "out") for a in args]
        return [*args, *(["--out-accelerate", d / "out", "--out-deepspeed", d / "out"] if args[0] == "config" else [])]

    return run_each_in_its_own_dir(tmp_path_factory, REFUSALS,
                                   lambda d: (d / "spec.yaml").write_text("name: s\ngradient_clipping: .nan\n"), argv)


@pytest.mark.parametrize("args, needle", REFUSALS)
def test_refused_in_one_line_and_nothing_written(args, needle, refusals):
    d, before, r = refusals[REFUSALS.index((args, needle))]
    line = _one_line(r)
    assert needle in line, line
    assert before == _files(d) == ["spec.yaml"]


def test_what_was_refused_still_works_when_consistent(tmp_path):
    from conftest import run_cli_concurrently

    plan, r = run_cli_concurrently((*PLAN, "--gpus-per-node", "2", "--nodes", "1", "--gpu-mem", "1GB", "--json"),
                                   ("config", "ddp", "--engine", "deepspeed", "--print"))  # two real runs at once
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["strategy"].endswith("mb1")
    assert r.returncode == 0 and '"stage": 2' in r.stdout  # ddp has no ZeRO settings to drop


# --- misleading messages ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from conftest import run_cli

    d = tmp_path_factory.mktemp("tiny") / "m"
    assert run_cli("tiny", "--out", d).returncode == 0
    return d


MISNAMED = [
    (["quantize", "runs/tiny/model", "--scheme", "int8wo", "--out", "q"], "not found: no such directory runs/tiny/model"),
    (["quantize", "./nope", "--scheme", "int8wo", "--out", "q"], "not found: no such directory ./nope"),
    (["eval", "runs/nope"], "not found: no such directory runs/nope"),
    (["plan", "--model", "/no/such/dir", "--seq-len", "8", "--micro-batch", "1"], "not found: no such directory /no/such/dir"),
    (["eval", "m.gguf"], "m.gguf is a GGUF file (llama.cpp): hfscale eval scores transformers directories"),
    (["quantize", "m.gguf", "--scheme", "int8wo", "--out", "q"], "m.gguf is a file, not a model"),
    (["quantize", "empty_dir", "--scheme", "int8wo", "--out", "q"], "no config.json in it"),
]


@pytest.fixture(scope="module")
def misnamed(tmp_path_factory):
    def prepare(d):
        (d / "m.gguf").write_bytes(b"GGUF")
        (d / "empty_dir").mkdir()

    return run_each_in_its_own_dir(tmp_path_factory, MISNAMED, prepare, lambda args, d: args)


@pytest.mark.parametrize("args, needle", MISNAMED)
def test_a_model_argument_is_named_for_what_it_is(args, needle, misnamed):
    d, before, r = misnamed[MISNAMED.index((args, needle))]
    line = _one_line(r)
    assert needle in line and "Repo id" not in line and "invalid JSON" not in line, line
    assert before == ["empty_dir", "m.gguf"] and _files(d) == before


def test_weight_only_ptq_needs_no_tokenizer(tiny_dir, tmp_path):
    src = tmp_path / "no_tokenizer"
    src.mkdir()
    for f in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(tiny_dir / f, src / f)
    from conftest import run_cli_concurrently

    out, out2 = tmp_path / "q", tmp_path / "q2"
    # three independent real runs at once (each reads only src or tiny_dir and writes its own --out)
    r, r2, gptq = run_cli_concurrently(
        ("quantize", src, "--scheme", "int8wo", "--out", out),
        ("quantize", tiny_dir, "--scheme", "int8wo", "--out", out2),
        ("quantize", src, "--scheme", "gptq-int4wo", "--calibration", "builtin", "--out", tmp_path / "g"))
    assert r.returncode == 0, r.stderr
    assert "tensors bit-identical to the in-memory model" in r.stdout, r.stdout
    # weight-only: no activation rounding to flip, so only float32's last bits can move (see test_quantize_cmd)
    assert float(re.search(r"vs the in-memory model ([0-9.e+-]+)", r.stdout).group(1)) < 1e-5, r.stdout
    assert not any(p.name.startswith("tokenizer") for p in out.iterdir())  # none to copy
    # with a tokenizer beside the weights it is copied
    assert r2.returncode == 0, r2.stderr
    assert (out2 / "tokenizer.json").is_file()
    # calibration data is tokenized: then the missing files are named, and nothing is written
    line = _one_line(gptq)
    assert "no_tokenizer has no tokenizer (none of tokenizer.json, tokenizer.model, tokenizer_config.json)" in line
    assert not (tmp_path / "g").exists()
