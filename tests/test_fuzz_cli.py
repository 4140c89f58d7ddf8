"""Issue 16 item 1: every `hfscale` verb fuzzed in-process (hypothesis), with one set of properties.

A case is an argv, an environment and a sandbox (inputs under in/, a regular file, an existing
file and directory, a symlink to in/). `run_case` calls `hfscale.cli.main(argv)` in the sandbox
(umask 022, stdout/stderr captured, SystemExit caught) and returns the violated properties:

- the exit code is one the verb documents (1 only for doctor errors, plan nothing-fits, prove failure);
- no exception escapes main (a user would see a traceback) and no "Traceback" on stderr;
- exit != 0: nothing new exists beside the sandbox and every pre-existing entry is byte-identical;
- always: the inputs under in/ are byte-identical and no staging entry is left;
- exit 0: every new or changed file is valid in its format (strict JSON without NaN/Infinity, YAML,
  accelerate's own loader for accelerate YAML, PNG, safetensors) and has the umask's mode (0644 / 0755).

Expensive work never runs by construction: `prove` cases never name an existing config with a valid
process count, `demo` is argument-level only, `slurm` without --dry-run reaches a patched exec, and
quantize / GGUF / .pte cases that would do real work are a minority on the 3M-param tiny model.
launch / exec / run_demo are patched to raise as a guard; reaching one is a harness violation.

`benchmarks/fuzz_cli.py` runs the same strategies for thousands of cases.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from conftest import snapshot

ROOT = Path(__file__).resolve().parents[1]
STAGE = ".hfscale-stage."
EXIT = {"config": {0, 2}, "plan": {0, 1, 2}, "profile": {0, 2}, "doctor": {0, 1, 2}, "quantize": {0, 2}, "eval": {0, 2},
        "tiny": {0, 2}, "slurm": {0, 2}, "prove": {0, 2}, "demo": {0, 2}, "cli": {0, 2}, "checkpoint": {0, 2}}


@dataclass(frozen=True)
class Case:
    verb: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    files: tuple[tuple[str, bytes], ...] = ()  # extra inputs under the sandbox (relative path, bytes)
    model: bool = False                         # copy the tiny model to in/model


class WouldLaunch(Exception):
    """Raised by the patched launch / exec / demo: a case reached real work it must never reach."""


# --- strategies: numbers, paths, specs, environment --------------------------------------------------

WEIRD_NUMS = ["0", "-1", "-0", "nan", "NaN", "inf", "-inf", "1e9", "1e400", "99999999999999999999", "abc", "",
              "80GB", "1.5", " 2", "0x10", "١", "2 ", "+3", "1_000"]
# mostly valid, so that cases get past argparse and reach the code behind it
nums = st.one_of(st.integers(1, 8).map(str), st.integers(0, 64).map(str), st.sampled_from(WEIRD_NUMS))
small_pos = st.one_of(st.integers(1, 4).map(str), st.integers(1, 4).map(str), st.sampled_from(WEIRD_NUMS))
floats = st.one_of(st.sampled_from(WEIRD_NUMS + ["1e308", "-1e308", "1e-320", "0.5", "1.0"]),
                   st.floats(allow_nan=True, allow_infinity=True).map(repr))
SIZES = ["80GB", "0GB", "-1GB", "nanGB", "infGB", "1e400GB", "80", "80 GiB", "80gb", "1TB", "0.5GB", "abc",
         "", "1e30GB", "8GiB", "80 GB", "GB", "1.5e3MB"]
sizes = st.sampled_from(SIZES)

# output paths, relative to the sandbox (the cwd of the command); INPUT is replaced by the verb's input
OUT_PATHS = ["out", "a/b/out", "afile/out", "afile", "existing_dir", "existing.json", ".", "", "..",
             "existing_dir/keep.txt", "lnk", "lnk/x", "in", "ü/ñ", "out/", "./out", "a" * 300]
INPUT_PATHS = ["INPUT", "INPUT/sub", "lnk/INPUTNAME", "lnk/INPUTNAME/sub"]


def out_path(inp: str | None = None):
    choices = OUT_PATHS + ([p.replace("INPUTNAME", Path(inp).name).replace("INPUT", inp) for p in INPUT_PATHS]
                           if inp else [])
    return st.sampled_from(choices)


SPEC_KEYS = ["name", "engine", "zero", "stage", "offload_optimizer", "offload_params", "nvme_path", "precision",
             "gradient_accumulation_steps", "gradient_clipping", "gradient_checkpointing", "launch",
             "num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port", "bogus", "ü",
             "per_device_train_batch_size", "learning_rate", "bf16", "fp16", "deepspeed", "zero_optimization",
             "train_micro_batch_size_per_gpu", "train_batch_size", "gradient_checkpointing_kwargs", "max_steps"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2, 8), st.sampled_from([1e308, -0.0, 3e-4, 10**30]),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
                    st.sampled_from(["deepspeed", "ddp", "fsdp2", "bf16", "fp16", "auto", "cpu", "nvme", "none",
                                     "8", "3e-4", "every:2", "full", "off", "true"]))
trees = st.recursive(scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.sampled_from(SPEC_KEYS), c, max_size=5),
                     max_leaves=14)


def _deep(depth: int, kind: str) -> bytes:
    if kind == "flow-list":
        return ("[" * depth + "]" * depth).encode()
    if kind == "flow-map":
        return ("{a: " * depth + "1" + "}" * depth).encode()
    return "".join(f"{' ' * i}k{i}:\n" for i in range(depth)).encode() + b" " * depth + b"x: 1\n"


def _dump(doc, fmt: str) -> bytes:
    if fmt == "json":
        return json.dumps(doc).encode()  # NaN / Infinity as Python writes them
    return yaml.safe_dump(doc, allow_unicode=True).encode()


def spec_files(fmt: str = "yaml", base: dict | None = None):
    """Bytes of a spec / config file: a mutated valid base, a random tree, deep nesting, garbage, huge."""
    mutated = (st.just(base or {}).flatmap(lambda b: st.dictionaries(st.sampled_from(SPEC_KEYS + list(b)), trees, max_size=4)
                                            .map(lambda m: _dump({**b, **m}, fmt))))
    return st.one_of(
        mutated, mutated,
        trees.map(lambda t: _dump(t, fmt)),
        st.tuples(st.integers(50, 5000), st.sampled_from(["flow-list", "flow-map", "block"])).map(lambda a: _deep(*a)),
        st.binary(max_size=40),
        st.sampled_from([b"", b"\xff\xfe\x00", b"---\n...\n", b"a: [1, 2", b"{", b"null", b"- 1\n- 2\n", b"&a [*a]",
                         "name: ü\u202e\x00".encode(), b"\t\tname: x"]),
        st.integers(1_000, 60_000).map(lambda n: _dump({f"key_{i}": i for i in range(n)}, fmt)),
    )


BAD_ENV = {
    "SLURM_JOB_NODELIST": ["gpu[01-", "a,,b", "", "x[3-1]", "ü[1-2]", "n[1-2]]", "gpu[01-02]", "[]"],
    "SLURM_GPUS_ON_NODE": ["abc", "-1", "nan", "8(x2)", "", "4"],
    "SLURM_NODEID": ["abc", "-1", "1e3", "0"],
    "SLURM_NNODES": ["abc", "0", "99", "2"],
    "SLURM_PROCID": ["x", "-3"],
    "WORLD_SIZE": ["abc", "-1", "0", "1e9", ""],
    "RANK": ["abc", "-1", "999"],
    "LOCAL_RANK": ["x", "-1"],
    "MASTER_PORT": ["x", "99999999"],
    "ACCELERATE_MIXED_PRECISION": ["bogus", "fp8", ""],
    "ACCELERATE_USE_DEEPSPEED": ["maybe", "true", "TRUE"],
    "ACCELERATE_DEEPSPEED_CONFIG_FILE": ["/nope.json", ""],
    "ACCELERATE_USE_CPU": ["yes", "1"],
    "ACCELERATE_CONFIG_FILE": ["/nope.yaml"],
    "HFSCALE_NATIVE_BF16": ["2", "x"],
}
envs = st.dictionaries(st.sampled_from(sorted(BAD_ENV)), st.just(None), max_size=4).flatmap(
    lambda d: st.tuples(*[st.tuples(st.just(k), st.sampled_from(BAD_ENV[k])) for k in sorted(d)]))


@st.composite
def flags(draw, table: dict):
    """Draw a subset of {flag: strategy}; a strategy of None is a store_true flag."""
    argv = []
    for flag in draw(st.lists(st.sampled_from(sorted(table)), unique=True, max_size=min(len(table), 5))):
        argv += [flag] if table[flag] is None else [flag, draw(table[flag])]
    return argv


def _acc_base() -> dict:
    return yaml.safe_load((ROOT / "accelerate_configs" / "zero3.yaml").read_text())


def _ds_base() -> dict:
    return json.loads((ROOT / "ds_configs" / "zero3.json").read_text())


# --- cases per verb -----------------------------------------------------------------------------------

PRESETS = ["zero1", "zero2", "zero3", "ddp", "fsdp2", "multinode_zero3", "zero3_nvme", "bogus"]


@st.composite
def config_cases(draw):
    files = []
    spec = None
    if draw(st.booleans()):
        spec = draw(st.sampled_from(["in/spec.yaml", "in/spec.json", "missing.yaml", "existing_dir", "lnk/spec.yaml", "afile"]))
        if spec.endswith(("spec.yaml", "spec.json")):
            fmt = "json" if spec.endswith("json") else "yaml"
            files.append((f"in/spec.{fmt}", draw(spec_files(fmt, {"name": "s", "engine": "deepspeed"}))))
    argv = ["config"] + draw(st.lists(st.sampled_from(PRESETS), max_size=1)) + (["--spec", spec] if spec else [])
    inp = spec if spec and spec.startswith("in/") else None
    argv += draw(flags({
        "--name": st.sampled_from(["x", "", "../up", "a/b", "ü", ".", "-", "a" * 300, "x.yaml", "..."]),
        "--engine": st.sampled_from(["deepspeed", "ddp", "fsdp2", "bogus"]), "--zero": nums,
        "--offload-optimizer": st.sampled_from(["none", "cpu", "nvme", "gpu"]),
        "--offload-params": st.sampled_from(["none", "cpu", "nvme"]),
        "--nvme-path": st.sampled_from(["/nonexistent", "afile", "existing_dir", "", "in"]),
        "--precision": st.sampled_from(["bf16", "fp16", "fp32", "fp8"]), "--grad-accum": nums, "--clip": floats,
        "--checkpointing": st.sampled_from(["off", "full", "every:0", "every:-1", "every:x", "every:2", "bogus", ""]),
        "--num-processes": nums, "--num-machines": nums, "--machine-rank": nums,
        "--main-process-ip": st.sampled_from(["10.0.0.1", "", "not an ip", "::1"]), "--main-process-port": nums,
        "--rdzv-backend": st.sampled_from(["static", "c10d", "etcd"]),
        "--out-accelerate": out_path(inp), "--out-deepspeed": out_path(inp),
        "--force": None, "--print": None, "--all": None}))
    return Case("config", tuple(argv), draw(envs), tuple(files))


PLAN_MODELS = ["tiny-gemma3", "tiny-gemma3", "gemma-3-27b", "gemma-4-26b-a4b", "gemma-4-e2b", "in/config.json",
               "in/config.json", "in/model", "missing_dir", "afile", "org/no-such-model", ""]


@st.composite
def plan_cases(draw):
    model = draw(st.sampled_from(PLAN_MODELS))
    files = []
    if model == "in/config.json":
        base = json.loads((ROOT / "hfscale" / "models" / "data" / "models" / "gemma-3-1b.json").read_text())
        files.append(("in/config.json", draw(spec_files("json", base))))
    inp = model if model.startswith("in/") else None
    argv = ["plan", "--model", model]
    for flag, vals in (("--seq-len", st.sampled_from(["128", "4096", "1", "8"])), ("--micro-batch", st.sampled_from(["1", "2", "4"]))):
        argv += [flag, draw(st.one_of(vals, vals, vals, small_pos))] if draw(st.integers(0, 19)) else []
    hw = draw(st.booleans())
    argv += ["--gpus-per-node", draw(small_pos)] if hw else []
    # the default traces the step (seconds per full-size model and candidate shape): the tiny models run it here,
    # with --trace / --kernels drawn too; full-size models and mutated configs take the analytic path (--fast)
    if model in ("tiny-gemma3", "in/model"):
        argv += draw(st.sampled_from([[], [], ["--trace"], ["--kernels", "cuda"], ["--kernels", "cpu", "--fast"]]))
    else:
        argv += ["--fast"]
    argv += draw(flags({
        "--checkpointing": st.sampled_from(["off", "full", "every:0", "every:2", "every:x", "auto", "bogus"]),
        "--zero": nums, "--offload": st.sampled_from(["none", "cpu", "nvme"]), "--dp": nums,
        "--precision": st.sampled_from(["bf16", "fp32", "fp16"]), "--optimizer": st.sampled_from(["adamw", "sgd", "bogus"]),
        "--attention": st.sampled_from(["sdpa", "eager"]), "--lora-rank": nums, "--base-bits": st.sampled_from(["16", "4", "8"]),
        "--inference": None, "--quant": st.sampled_from(["bf16", "int8", "int4", "bogus"]), "--batch": nums, "--context": nums,
        "--nodes": nums, "--gpu-mem": sizes, "--cpu-mem": sizes, "--global-batch-tokens": nums, "--json": None,
        "--force": None}))
    # plotting costs ~0.2 s: drawn rarely
    if draw(st.integers(0, 9)) == 0:
        argv += ["--plot", draw(out_path(inp)) + draw(st.sampled_from([".png", "", ".txt"]))]
    if draw(st.integers(0, 4)) == 0:
        argv += ["--write", draw(out_path(inp))]
    return Case("plan", tuple(argv), draw(envs), tuple(files), model=model == "in/model")


@st.composite
def doctor_cases(draw):
    files = []
    argv = ["doctor"]
    if draw(st.booleans()):
        acc = draw(st.sampled_from(["in/acc.yaml", "in/acc.yaml", "missing.yaml", "existing_dir", "lnk/acc.yaml"]))
        if acc != "missing.yaml" and acc != "existing_dir":
            base = _acc_base()
            base["deepspeed_config_file"] = draw(st.sampled_from(["in/ds.json", "missing.json", "in/acc.yaml", "existing_dir", "in"]))
            files.append(("in/acc.yaml", draw(spec_files("yaml", base))))
        argv += ["--accelerate", acc]
    if draw(st.booleans()):
        argv += ["--deepspeed", draw(st.sampled_from(["in/ds.json", "missing.json", "existing_dir"]))]
    if any(a == "in/ds.json" for a in argv) or any(f == "in/acc.yaml" for f, _ in files):
        files.append(("in/ds.json", draw(spec_files("json", _ds_base()))))
    if draw(st.booleans()):
        files.append(("in/args.yaml", draw(spec_files("yaml", {"per_device_train_batch_size": 4, "bf16": True}))))
        argv += ["--args", draw(st.sampled_from(["in/args.yaml", "missing.yaml"]))]
    model = draw(st.sampled_from([None, None, "tiny-gemma3", "gemma-3-4b", "in/model", "missing_dir", "afile", "org/none"]))
    argv += ["--model", model] if model else []
    argv += draw(flags({"--num-processes": nums, "--num-machines": nums, "--gpus-per-machine": nums, "--json": None,
                        "--max-findings": nums}))
    return Case("doctor", tuple(argv), draw(envs), tuple(files), model=model == "in/model")


# weighted toward refusals: a successful int8wo PTQ of the tiny model costs ~2 s
QUANT_OUT = ["in/model", "in/model/sub", "lnk/model", "lnk/model/sub", "in", "afile/q", "afile", ".", "", "existing_dir",
             "existing.json", "a/b/q", "q"]


@st.composite
def quantize_cases(draw):
    model = draw(st.sampled_from(["in/model", "in/model", "in/model", "missing_dir", "afile", "existing_dir", "in/m.gguf",
                                  "org/no-such", "lnk/model"]))
    fmt = draw(st.sampled_from(["transformers", "transformers", "transformers", "gguf", "pte", "onnx"]))
    argv = ["quantize", model, "--format", fmt] if draw(st.integers(0, 9)) else ["quantize"]
    scheme = draw(st.sampled_from(["int8wo", "int8wo", "int4wo", "8da4w", "int4wo-cuda", "gptq-int4wo", "nf4", "float8",
                                   "llm.int8", "bogus", None]))
    argv += ["--scheme", scheme] if scheme else []
    out = draw(st.sampled_from(QUANT_OUT + [o + ".gguf" for o in ("a/b/m", "afile/m", "in/model/m")]))
    argv += ["--out", out] if draw(st.integers(0, 9)) else []
    argv += draw(flags({"--group-size": nums, "--mapping": st.sampled_from(["symmetric", "asymmetric", "bogus"]),
                        "--include-embeddings": None,
                        "--calibration": st.sampled_from(["missing.txt", "existing_dir", "in/model/config.json"]),
                        "--calibration-blocks": nums, "--seq-len": nums,
                        "--qtype": st.sampled_from(["Q4_0", "Q8_0", "F16", "fp32", "8da4w", "Q2_K", "bogus"]),
                        "--embed-qtype": st.sampled_from(["Q8_0", "F16", "bogus"]), "--max-seq-len": nums,
                        "--no-verify": None, "--force": None, "--list": None}))
    if fmt in ("gguf", "pte") and "--list" not in argv:
        # an export that would really run (llama.cpp / ExecuTorch) costs tens of seconds: always one refusal in it
        argv += draw(st.sampled_from([["--qtype", "bogus"], ["--scheme", "int8wo"], ["--qtype", "Q2_K"]]))
    return Case("quantize", tuple(argv), draw(envs), (("in/m.gguf", b"GGUF\x03"),), model=True)


@st.composite
def eval_cases(draw):
    models = draw(st.lists(st.sampled_from(["in/model", "missing_dir", "afile", "existing_dir", "in/m.gguf", "in/m.pte",
                                            "org/no-such", "lnk/model", "in/model/config.json"]), min_size=0, max_size=3))
    argv = ["eval", *models]
    data = draw(st.sampled_from(["builtin", "in/d.txt", "in/d.jsonl", "missing.txt", "existing_dir", "in/m.gguf"]))
    argv += ["--data", data]
    argv += draw(flags({"--validation": st.sampled_from(["in/d.txt", "missing.txt", "in/d.jsonl"]),
                        "--seq-len": st.sampled_from(["0", "-1", "1", "2", "16", "abc", "nan", "99999999"]),
                        "--blocks": st.sampled_from(["0", "-1", "1", "2", "abc", "1e9"]),
                        "--batch-size": st.sampled_from(["0", "-1", "1", "4", "x"]), "--json": None}))
    if "--seq-len" not in argv:  # the default 128 x 64 blocks is seconds per model: keep cases cheap
        argv += ["--seq-len", "16", "--blocks", "2"] if "--blocks" not in argv else ["--seq-len", "16"]
    text = draw(st.sampled_from([b"", b"hello world\n" * 50, b"\xff\xfe", "ü\u202e\n".encode() * 20]))
    jl = draw(st.sampled_from([b"", b'{"text": "hi there"}\n' * 40, b"{not json\n", b'{"no_text": 1}\n', b"[1,2]\n"]))
    files = (("in/m.gguf", b"GGUF\x03"), ("in/m.pte", b"\x00" * 8), ("in/d.txt", text), ("in/d.jsonl", jl))
    return Case("eval", tuple(argv), draw(envs), files, model=True)


@st.composite
def tiny_cases(draw):
    argv = ["tiny"]
    if draw(st.integers(0, 9)):
        argv += ["--out", draw(out_path())]
    argv += draw(flags({"--seed": nums, "--force": None}))
    return Case("tiny", tuple(argv), draw(envs))


NODELISTS = ["gpu[01-04]", "gpu[01-", "a,b", "", "x[3-1]", "n[1-1000]", "ü", "a[1-2]b[3-4]", "a[01-02],b", ",", "[1-2]",
             "n[1-2,x]", "n[007-009]"]


@st.composite
def slurm_cases(draw):
    argv = ["slurm"]
    if draw(st.integers(0, 9)):
        argv += ["--config", draw(st.sampled_from(["in/acc.yaml", "missing.yaml", "existing_dir", "", "a b"]))]
    argv += draw(flags({"--nodelist": st.sampled_from(NODELISTS), "--gpus-per-node": nums, "--node-rank": nums,
                        "--port": nums, "--dry-run": None}))
    argv += draw(st.sampled_from([[], ["--", "train.py"], ["--", "train.py", "--lr", "1e-4", "--", "x"], ["train.py"]]))
    return Case("slurm", tuple(argv), draw(envs), (("in/acc.yaml", (ROOT / "accelerate_configs" / "multinode_zero3.yaml").read_bytes()),))


BAD_NPROC = ["0", "-1", "-2", "3", "abc", "nan", "", "1.5"]


@st.composite
def prove_cases(draw):
    config = draw(st.sampled_from(["in/acc.yaml", "missing.yaml", "existing_dir", "", "afile/x.yaml"]))
    argv = ["prove", "--config", config] if draw(st.integers(0, 9)) else ["prove"]
    exists = config == "in/acc.yaml" and "--config" in argv
    # by construction no case launches: an existing config always comes with a process count that is refused
    nproc = draw(st.sampled_from(BAD_NPROC)) if exists else draw(nums)
    machines = draw(st.sampled_from(["1", "2", "0", "-1", "x"]))
    if exists and nproc in ("3",) and machines == "1":
        machines = "2"
    argv += ["--num-processes", nproc, "--num-machines", machines]
    argv += draw(flags({"--model": st.sampled_from(["tiny-gemma3", "in/acc.yaml", "missing"]), "--steps": nums,
                        "--out": out_path("in/acc.yaml"), "--precision": st.sampled_from(["launch", "auto", "bf16", "fp8"]),
                        "--json": None, "--reference": None}))
    return Case("prove", tuple(argv), draw(envs), (("in/acc.yaml", (ROOT / "accelerate_configs" / "zero2.yaml").read_bytes()),))


@st.composite
def profile_cases(draw):
    """`hfscale profile`: real work only with --steps 1 at 1 x 8 on the tiny model (~5 s); --config never names a
    valid accelerate file, so no case reaches a launch."""
    argv = ["profile"]
    argv += draw(flags({"--model": st.sampled_from(["tiny-gemma3", "in/acc.yaml", "missing", "in"]),
                        "--config": st.sampled_from(["missing.yaml", "in", "afile", "existing.json"]),
                        "--steps": st.sampled_from(["1", "0", "-1", "x", "nan", "1e9"]),
                        "--micro-batch": st.sampled_from(["1", "0", "-2", "abc"]),
                        "--seq-len": st.sampled_from(["8", "0", "-8", "1.5"]),
                        "--checkpointing": st.sampled_from(["off", "full", "every:0", "every:x", "bogus"]),
                        "--precision": st.sampled_from(["fp32", "auto", "fp8"]), "--num-processes": nums,
                        "--force": None, "--json": None, "--no-predict": None}))
    if "--steps" not in argv:  # the default (3 steps at 2 x 128) is too slow for a fuzz case
        argv += ["--steps", draw(st.sampled_from(["0", "x", "-3"]))]
    if "--seq-len" not in argv:
        argv += ["--seq-len", "8"]
    if "--micro-batch" not in argv:
        argv += ["--micro-batch", "1"]
    argv += ["--out", draw(out_path("in/acc.yaml"))]
    return Case("profile", tuple(argv), draw(envs), (("in/acc.yaml", (ROOT / "accelerate_configs" / "zero2.yaml").read_bytes()),))


@st.composite
def demo_cases(draw):
    argv = draw(st.sampled_from([["demo", "--help"], ["demo", "--bogus"], ["demo", "--out"], ["demo", "x"],
                                 ["demo", "--out", "o", "extra"], ["demo", "-h", "--verbose"]]))
    return Case("demo", tuple(argv), draw(envs))


def _marker(**extra) -> bytes:
    return json.dumps({"model": "tiny-gemma3", "step": 2, "tokens_per_step": 512, **extra}).encode()


# checkpoint directories under in/ck (hfscale checkpoint info/export): a file shorter than its manifest says, a
# safetensors header pointing past the end, a rank file that is not a zip, a marker that is not JSON, no marker
CKPTS = {
    "short": (("in/ck/hfscale_state.json", _marker(files={"model.safetensors": [4096, "0" * 16]})),
              ("in/ck/model.safetensors", b"\x08" + b"\x00" * 15)),
    "truncated": (("in/ck/hfscale_state.json", _marker()),
                  ("in/ck/model.safetensors", (64).to_bytes(8, "little") + b'{"w":{"dtype":"F32","shape":[4096],'
                                                                              b'"data_offsets":[0,16384]}}      ')),
    "rank_not_zip": (("in/ck/hfscale_state.json", _marker(engine="deepspeed", ranks=2)),
                     ("in/ck/pytorch_model/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", b"PK\x03\x04 not a zip"),
                     ("in/ck/pytorch_model/mp_rank_00_model_states.pt", b"")),
    "bad_marker": (("in/ck/hfscale_state.json", b"{step: 2"), ("in/ck/model.safetensors", b"")),
    "no_marker": (("in/ck/model.safetensors", b""),),
}


@st.composite
def checkpoint_cases(draw):
    files = CKPTS[draw(st.sampled_from(sorted(CKPTS)))]
    target = draw(st.sampled_from(["in/ck", "in/ck", "in/ck", "missing_dir", "afile", "existing_dir", "in", "lnk/ck", ""]))
    if draw(st.booleans()):
        argv = ["checkpoint", "info", target]
    else:
        argv = ["checkpoint", "export", target, "--out", draw(out_path())]
        argv += draw(flags({"--shard-size": st.sampled_from(SIZES), "--force": None}))
    return Case("checkpoint", tuple(argv), draw(envs), files)


VERBS = ["config", "prove", "doctor", "plan", "profile", "quantize", "eval", "slurm", "tiny", "demo", "checkpoint"]


@st.composite
def cli_cases(draw):
    """Argument-level cases of any verb: --help with a broken environment, unknown flags, missing values."""
    verb = draw(st.sampled_from(VERBS + ["experts", "prune", "bench", "bogus", ""]))  # experts, prune, bench: argument level only
    tail = draw(st.sampled_from([["--help"], ["-h"], ["--bogus"], ["--"], ["--verbose", "--help"], ["--help", "--verbose"],
                                 ["--out"], ["--config"], ["--model"], ["\x00"], ["ü"]]))
    argv = draw(st.sampled_from([[verb, *tail], [*tail, verb], tail, []]))
    return Case("cli", tuple(a for a in argv if a != "" or verb == ""), draw(envs))


CASES = {"config": config_cases(), "plan": plan_cases(), "doctor": doctor_cases(), "quantize": quantize_cases(),
         "eval": eval_cases(), "tiny": tiny_cases(), "slurm": slurm_cases(), "prove": prove_cases(),
         "demo": demo_cases(), "profile": profile_cases(), "cli": cli_cases(), "checkpoint": checkpoint_cases()}


# --- running a case and checking the properties --------------------------------------------------------


def _strict_json(text: str):
    def refuse(c):
        raise ValueError(f"non-finite number {c} in JSON")

    return json.loads(text, parse_constant=refuse)


def check_format(p: Path) -> str | None:
    """None when the file is valid in the format its name says, else why not."""
    try:
        if p.suffix == ".json":
            _strict_json(p.read_text())
        elif p.suffix in (".yaml", ".yml"):
            doc = yaml.safe_load(p.read_text())
            if isinstance(doc, dict) and "compute_environment" in doc:
                from accelerate.commands.config.config_args import load_config_from_file

                load_config_from_file(str(p))
        elif p.suffix == ".png":
            assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
        elif p.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(p), "pt") as f:
                list(f.keys())
    except Exception as e:  # noqa: BLE001 - any failure to load is the finding
        return f"{type(e).__name__}: {str(e)[:200]}"
    return None


def _sandbox(base: Path, case: Case, model_src: Path | None) -> Path:
    sb = base / "sb"
    (sb / "in").mkdir(parents=True)
    (sb / "afile").write_text("a regular file\n")
    (sb / "existing.json").write_text("{}\n")
    (sb / "existing_dir").mkdir()
    (sb / "existing_dir" / "keep.txt").write_text("keep\n")
    (sb / "lnk").symlink_to("in")
    if case.model and model_src is not None:
        shutil.copytree(model_src, sb / "in" / "model")
    for rel, data in case.files:
        (sb / rel).parent.mkdir(parents=True, exist_ok=True)
        (sb / rel).write_bytes(data)
    return sb


class Exec(Exception):
    """Raised by the patched os.execvp: `hfscale slurm` handed the process to accelerate (its success)."""


def _patches():
    def refuse(*a, **k):
        raise WouldLaunch("a fuzz case reached a real launch / demo")

    def exec_(*a, **k):
        raise Exec()

    return [mock.patch("os.execvp", exec_), mock.patch("hfscale.proofs.engine.launch", refuse),
            mock.patch("hfscale.proofs.demo.run_demo", refuse)]


def run_case(case: Case, model_src: Path | None, want_rc: bool = False):
    """Run one case in a fresh sandbox; the list of violated properties (empty when all hold), and the
    exit code with want_rc (None when an exception escaped)."""
    from hfscale.cli import main

    violations = []
    with tempfile.TemporaryDirectory(prefix="hfscale-fuzz-") as tmp:
        base = Path(tmp)
        sb = _sandbox(base, case, model_src)
        before = snapshot(base)
        out, err = io.StringIO(), io.StringIO()
        cwd, umask = os.getcwd(), os.umask(0o022)
        env = {**dict(case.env), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        try:
            os.chdir(sb)
            with contextlib.ExitStack() as stack:
                for p in _patches():
                    stack.enter_context(p)
                stack.enter_context(mock.patch.dict(os.environ, env))
                stack.enter_context(contextlib.redirect_stdout(out))
                stack.enter_context(contextlib.redirect_stderr(err))
                try:
                    rc = main(list(case.argv))
                except SystemExit as e:  # argparse: --help (0) or a usage error (2)
                    rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                except Exec:
                    rc = 0  # validated everything and would exec `accelerate launch` (only slurm execs)
                except WouldLaunch as e:
                    rc = None
                    violations.append(f"harness: {e}")
                except BaseException as e:  # noqa: BLE001 - a user would see this as a traceback
                    rc = None
                    violations.append(f"traceback: {type(e).__name__}: {str(e)[:300]}")
        finally:
            os.chdir(cwd)
            os.umask(umask)
        stderr = err.getvalue()
        if rc is not None and rc not in EXIT[case.verb]:
            violations.append(f"exit {rc} not in {sorted(EXIT[case.verb])}: {stderr.strip()[-300:]}")
        if rc == 1 and case.verb == "plan" and "--gpus-per-node" not in case.argv:
            violations.append("plan exit 1 (nothing fits) without hardware given")
        if "Traceback" in stderr:
            violations.append(f"Traceback on stderr: {stderr[-300:]}")
        after = snapshot(base)
        for rel in sorted(set(before) | set(after)):
            b, a = before.get(rel), after.get(rel)
            name = Path(rel).name
            if name.startswith(STAGE):
                violations.append(f"staging entry left: {rel}")
            elif rel.startswith("sb/in/") and b is not None and a != b:
                violations.append(f"input {rel} {'removed' if a is None else 'changed'}")
            elif b is None and any(before.get(str(q)) == "dir" for q in Path(rel).parents if str(q).startswith("sb/in/")):
                violations.append(f"{rel} written inside the input directory {Path(rel).parts[2]}")
            elif a != b and rc != 0:
                violations.append(f"exit {rc} but {rel} {'new' if b is None else 'removed' if a is None else 'changed'}")
            elif a != b and b is not None and "--force" not in case.argv:
                violations.append(f"{rel} {'removed' if a is None else 'changed'} without --force")
            elif a is not None and a != b and rc == 0:
                p = base / rel
                if p.is_symlink():
                    continue
                mode = stat.S_IMODE(p.lstat().st_mode)
                if p.is_dir() and mode != 0o755 or p.is_file() and mode not in (0o644, 0o755):
                    violations.append(f"{rel} mode {mode:o} under umask 022")
                if p.is_file() and (why := check_format(p)):
                    violations.append(f"{rel} invalid: {why}")
    return (violations, rc) if want_rc else violations


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """`hfscale tiny` once per session: the model every quantize / eval case copies into its sandbox."""
    from hfscale.cli import main

    d = tmp_path_factory.mktemp("fuzz_tiny") / "model"
    with contextlib.redirect_stderr(io.StringIO()):
        assert main(["tiny", "--out", str(d)]) == 0
    return d


def _check(case: Case, model: Path | None):
    violations = run_case(case, model)
    assert not violations, f"{case}\n" + "\n".join(violations)


# bounded for `make test`: the whole file ~1-2 min on 2 cores; derandomized so CI sees the same cases
BOUNDED = {"config": 150, "plan": 150, "doctor": 80, "quantize": 30, "eval": 30, "tiny": 30, "slurm": 150,
           "prove": 100, "demo": 12, "profile": 40, "cli": 60, "checkpoint": 60}


def _settings(verb):
    return settings(max_examples=BOUNDED[verb], deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


@_settings("config")
@given(case=CASES["config"])
# was RecursionError: a spec nested 5,000 levels deep
@example(case=Case("config", ("config", "--spec", "in/spec.yaml"), files=(("in/spec.yaml", _deep(5000, "flow-list")),)))
@example(case=Case("config", ("config", "--spec", "in/spec.json"), files=(("in/spec.json", _deep(5000, "flow-list")),)))
# was an accelerate YAML its own loader refuses (a top-level gradient_accumulation_steps)
@example(case=Case("config", ("config", "--engine", "fsdp2", "--grad-accum", "24", "--out-accelerate", "out")))
def test_fuzz_config(case):
    _check(case, None)


def _odd_config(**kw) -> bytes:
    """The tiny Gemma 3's config with fields changed: odd configs the default plan (a trace) must answer or refuse
    in one line."""
    base = {"model_type": "gemma3_text", "vocab_size": 4096, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
            "sliding_window": 32, "layer_types": ["sliding_attention", "full_attention"]}
    return json.dumps({**base, **kw}).encode()


MIXTRAL = json.dumps({"model_type": "mixtral", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                      "num_local_experts": 4, "num_experts_per_tok": 2}).encode()


def _plan_odd(files, *extra):
    return Case("plan", ("plan", "--model", "in/config.json", "--seq-len", "64", "--micro-batch", "2", *extra),
                files=(("in/config.json", files),))


@_settings("plan")
@given(case=CASES["plan"])
# the default (traced) plan on odd configs: zero heads, a huge vocabulary, untied / tied embeddings, MoE in fp32
# and in bf16, with and without hardware
@example(case=_plan_odd(_odd_config(num_attention_heads=0)))
@example(case=_plan_odd(_odd_config(vocab_size=4_000_000), "--gpus-per-node", "2"))
@example(case=_plan_odd(_odd_config(tie_word_embeddings=False)))
@example(case=_plan_odd(_odd_config(tie_word_embeddings=True), "--gpus-per-node", "2", "--gpu-mem", "1GB"))
@example(case=_plan_odd(MIXTRAL, "--precision", "fp32"))
@example(case=_plan_odd(MIXTRAL, "--gpus-per-node", "2"))
# was StrictDataclassFieldValidationError: a config.json field of the wrong type
@example(case=Case("plan", ("plan", "--model", "in/config.json", "--seq-len", "2", "--micro-batch", "2"),
                   files=(("in/config.json", b'{"model_type": "gemma3_text", "num_hidden_layers": "x"}'),)))
def test_fuzz_plan(case, tiny_model):
    _check(case, tiny_model)


@_settings("doctor")
@given(case=CASES["doctor"])
def test_fuzz_doctor(case, tiny_model):
    _check(case, tiny_model)


@_settings("quantize")
@given(case=CASES["quantize"])
def test_fuzz_quantize(case, tiny_model):
    _check(case, tiny_model)


@_settings("eval")
@given(case=CASES["eval"])
# was IndexError: an empty .jsonl made datasets raise an exception with an empty message
@example(case=Case("eval", ("eval", "in/model", "--data", "in/d.jsonl", "--seq-len", "16", "--blocks", "2"),
                   files=(("in/d.jsonl", b""),), model=True))
def test_fuzz_eval(case, tiny_model):
    _check(case, tiny_model)


@_settings("tiny")
@given(case=CASES["tiny"])
# was ValueError "Overflow when unpacking long long" from torch.manual_seed
@example(case=Case("tiny", ("tiny", "--out", "ü/ñ", "--seed", "99999999999999999999", "--force")))
def test_fuzz_tiny(case, tiny_model):
    _check(case, tiny_model)


@_settings("slurm")
@given(case=CASES["slurm"])
def test_fuzz_slurm(case):
    _check(case, None)


@_settings("checkpoint")
@given(case=CASES["checkpoint"])
def test_fuzz_checkpoint(case):
    _check(case, None)


@_settings("prove")
@given(case=CASES["prove"])
def test_fuzz_prove(case):
    _check(case, None)


@_settings("profile")
@given(case=CASES["profile"])
def test_fuzz_profile(case):
    _check(case, None)


@_settings("demo")
@given(case=CASES["demo"])
def test_fuzz_demo(case):
    _check(case, None)


@_settings("cli")
@given(case=CASES["cli"])
def test_fuzz_cli_arguments(case):
    _check(case, None)
