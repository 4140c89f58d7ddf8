"""`hfscale doctor`: one bad input and one good input per check; shipped configs pass; fuzzing never crashes it."""

import copy
import json
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hfscale.doctor import check, check_setup
from hfscale.doctor.inputs import Setup
from hfscale.util.errors import HfscaleError

ROOT = Path(__file__).resolve().parents[1]
DS3 = json.loads((ROOT / "ds_configs" / "zero3.json").read_text())
DS2 = json.loads((ROOT / "ds_configs" / "zero2.json").read_text())
ACC3 = yaml.safe_load((ROOT / "accelerate_configs" / "zero3.yaml").read_text())


def codes(setup):
    return {f.code for f in check_setup(setup)}


def ds(base=DS3, **changes):
    d = copy.deepcopy(base)
    for dotted, v in changes.items():
        cur = d
        *parents, last = dotted.split("__")
        for p in parents:
            cur = cur.setdefault(p, {})
        if v is None:
            cur.pop(last, None)
        else:
            cur[last] = v
    return d


class _Gemma:
    model_type = "gemma3_text"


CASES = [
    # (code, bad setup, good setup)
    ("string-number", Setup(deepspeed=ds(gradient_accumulation_steps="8")), Setup(deepspeed=ds(gradient_accumulation_steps=8))),
    ("string-number", Setup(args={"learning_rate": "3e-4"}), Setup(args={"learning_rate": 3.0e-4})),
    ("string-bool", Setup(deepspeed=ds(bf16__enabled="true")), Setup(deepspeed=ds(bf16__enabled=True))),
    ("batch-arithmetic", Setup(deepspeed=ds(train_batch_size=16, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2), num_processes=2),
     Setup(deepspeed=ds(train_batch_size=8, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2), num_processes=2)),
    ("accumulation-conflict", Setup(deepspeed=ds(gradient_accumulation_steps=4), args={"gradient_accumulation_steps": 8}),
     Setup(deepspeed=ds(gradient_accumulation_steps="auto"), args={"gradient_accumulation_steps": 8})),
    ("micro-batch-conflict", Setup(deepspeed=ds(train_micro_batch_size_per_gpu=4), args={"per_device_train_batch_size": 2}),
     Setup(deepspeed=ds(train_micro_batch_size_per_gpu=2), args={"per_device_train_batch_size": 2})),
    ("non-positive", Setup(args={"per_device_train_batch_size": 0}), Setup(args={"per_device_train_batch_size": 1})),
    ("bf16-and-fp16", Setup(deepspeed=ds(fp16__enabled=True)), Setup(deepspeed=ds())),
    ("bf16-and-fp16", Setup(args={"bf16": True, "fp16": True}), Setup(args={"bf16": True, "fp16": False})),
    ("precision-conflict", Setup(deepspeed=ds(), args={"fp16": True}), Setup(deepspeed=ds(), args={"bf16": True})),
    ("precision-conflict", Setup(accelerate={"mixed_precision": "fp16"}, args={"bf16": True}),
     Setup(accelerate={"mixed_precision": "bf16"}, args={"bf16": True})),
    ("precision-in-yaml-and-json", Setup(accelerate={**ACC3, "mixed_precision": "bf16"}, deepspeed=ds()), Setup(accelerate=ACC3, deepspeed=ds())),
    ("fp16-gemma", Setup(args={"fp16": True}, model_config=_Gemma()), Setup(args={"bf16": True}, model_config=_Gemma())),
    ("key-in-yaml-and-json", Setup(accelerate={**ACC3, "deepspeed_config": {**ACC3["deepspeed_config"], "zero_stage": 3}}, deepspeed=ds()),
     Setup(accelerate=ACC3, deepspeed=ds())),
    ("param-offload-below-3", Setup(deepspeed=ds(DS2, zero_optimization__offload_param={"device": "cpu"})),
     Setup(deepspeed=ds(zero_optimization__offload_param={"device": "cpu"}))),
    ("nvme-no-path", Setup(deepspeed=ds(zero_optimization__offload_optimizer={"device": "nvme"}, optimizer={"type": "AdamW"})),
     Setup(deepspeed=ds(zero_optimization__offload_optimizer={"device": "cpu"}, optimizer={"type": "AdamW"}))),
    ("optimizer-not-offloadable", Setup(deepspeed=ds(zero_optimization__offload_optimizer={"device": "cpu"}, optimizer={"type": "SGD"})),
     Setup(deepspeed=ds(zero_optimization__offload_optimizer={"device": "cpu"}, optimizer={"type": "AdamW"}))),
    ("optimizer-not-offloadable", Setup(deepspeed=ds(zero_optimization__offload_optimizer={"device": "cpu"}), args={"optim": "adafactor"}),
     Setup(deepspeed=ds(zero_optimization__offload_optimizer={"device": "cpu"}), args={"optim": "adamw_torch"})),
    ("offload-client-optimizer", Setup(deepspeed=ds(zero_optimization__offload_optimizer={"device": "cpu"})),
     Setup(deepspeed=ds(zero_optimization__offload_optimizer={"device": "cpu"}, optimizer={"type": "AdamW"}))),
    ("zero3-tiny-checkpoint", Setup(deepspeed=ds(zero_optimization__stage3_gather_16bit_weights_on_model_save=None)), Setup(deepspeed=ds())),
    ("zero3-tiny-checkpoint", Setup(deepspeed=ds(zero_optimization__stage3_gather_16bit_weights_on_model_save="auto")), Setup(deepspeed=ds())),
    ("qlora-zero3-storage", Setup(deepspeed=ds(), args={"load_in_4bit": True, "bf16": True}),
     Setup(deepspeed=ds(), args={"load_in_4bit": True, "bf16": True, "bnb_4bit_quant_storage": "bfloat16"})),
    ("qlora-zero3-init", Setup(accelerate={**ACC3, "deepspeed_config": {**ACC3["deepspeed_config"], "zero3_init_flag": False}}, deepspeed=ds(),
                               args={"load_in_4bit": True, "bnb_4bit_quant_storage": "bfloat16", "bf16": True}),
     Setup(accelerate=ACC3, deepspeed=ds(), args={"load_in_4bit": True, "bnb_4bit_quant_storage": "bfloat16", "bf16": True})),
    ("zero3-checkpointing-reentrant", Setup(deepspeed=ds(), args={"gradient_checkpointing": True, "use_peft": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}}),
     Setup(deepspeed=ds(), args={"gradient_checkpointing": True, "use_peft": True, "gradient_checkpointing_kwargs": {"use_reentrant": False}})),
    ("qat-on-quantized-base", Setup(args={"qat": "8da4w", "load_in_4bit": True}), Setup(args={"qat": "8da4w", "bf16": True})),
    ("qat-fp16", Setup(args={"qat": "8da4w", "fp16": True}), Setup(args={"qat": "8da4w", "bf16": True})),
    ("unknown-key", Setup(deepspeed=ds(zero_optimization__stage3_gather_16bit_weights_on_modelsave=True)), Setup(deepspeed=ds())),
    ("unknown-key", Setup(deepspeed=ds(train_micro_batch_size_per_gpus=2)), Setup(deepspeed=ds(train_micro_batch_size_per_gpu=2))),
    ("unknown-key", Setup(accelerate={**ACC3, "num_procesess": 2}), Setup(accelerate=ACC3)),
    ("unknown-key", Setup(args={"per_device_train_batchsize": 2}), Setup(args={"per_device_train_batch_size": 2})),
    ("launch-shape", Setup(accelerate={**ACC3, "num_processes": 3, "num_machines": 2, "main_process_ip": "h"}),
     Setup(accelerate={**ACC3, "num_processes": 4, "num_machines": 2, "main_process_ip": "h"})),
    ("launch-shape", Setup(accelerate=ACC3, num_processes=16, num_machines=2, gpus_per_machine=4),
     Setup(accelerate={**ACC3, "main_process_ip": "10.0.0.1"}, num_processes=8, num_machines=2, gpus_per_machine=4)),
    ("launch-shape", Setup(accelerate={**ACC3, "num_machines": 2, "num_processes": 4}),
     Setup(accelerate={**ACC3, "num_machines": 2, "num_processes": 4, "main_process_ip": "10.0.0.1"})),
    ("launch-shape", Setup(accelerate={**ACC3, "machine_rank": 1}), Setup(accelerate={**ACC3, "machine_rank": 0})),
    ("non-finite-number", Setup(deepspeed=ds(gradient_clipping=float("nan"))), Setup(deepspeed=ds(gradient_clipping=1.0))),
    ("non-finite-number", Setup(args={"learning_rate": float("inf")}), Setup(args={"learning_rate": 3.0e-4})),
    # the AdamW that will run against the one planned (fused unless --adamw): Trainer's optim (adamw_torch names no
    # implementation: foreach on CUDA), a recipe's adamw, DeepSpeed's own (torch_adam: torch's default; offload:
    # its CPU Adam, in place like fused)
    ("adamw-not-planned", Setup(args={"optim": "adamw_torch"}), Setup(args={"optim": "adamw_torch_fused"})),
    ("adamw-not-planned", Setup(args={"bf16": True}, planned_adamw="foreach"),
     Setup(args={"bf16": True, "optim": "adamw_torch"}, planned_adamw="foreach")),
    ("adamw-not-planned", Setup(args={"seq_len": 128, "adamw": "forloop"}), Setup(args={"seq_len": 128})),
    ("adamw-not-planned", Setup(deepspeed=ds(optimizer={"type": "AdamW", "params": {"torch_adam": True}})),
     Setup(deepspeed=ds(zero_optimization__offload_optimizer={"device": "cpu"}, optimizer={"type": "AdamW"}))),
    # TRL's SFTConfig(padding_free=True) / a recipe's padding_free: one row per batch needs a varlen kernel
    ("padding-free-attention", Setup(args={"padding_free": True, "attn_implementation": "sdpa"}),
     Setup(args={"padding_free": True, "attn_implementation": "flash_attention_2"})),
    ("padding-free-attention", Setup(args={"padding_free": True}), Setup(args={"padding_free": True, "attention": "varlen"})),
]


@pytest.mark.parametrize("code, bad, good", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_each_check_fires_on_bad_and_not_on_good(code, bad, good):
    found = check_setup(bad)
    hits = [f for f in found if f.code == code]
    assert hits, f"{code} not found in {found}"
    f = hits[0]
    assert f.fix and f.what and ":" in f.where
    assert code not in codes(good), check_setup(good)


def test_findings_name_the_exact_value():
    f = next(f for f in check_setup(CASES[3][1]) if f.code == "batch-arithmetic")
    assert f.where.endswith(":train_batch_size") and "set train_batch_size: 8" in f.fix
    f = next(f for f in check_setup(Setup(deepspeed=ds(gradient_accumulation_steps="8"))) if f.code == "string-number")
    assert f.fix == "set gradient_accumulation_steps: 8"
    f = next(f for f in check_setup(CASES[26][1]))
    assert "stage3_gather_16bit_weights_on_model_save" in f.fix


def test_nvme_path_checks(tmp_path):
    base = dict(zero_optimization__offload_optimizer={"device": "nvme", "nvme_path": str(tmp_path / "nope")}, optimizer={"type": "AdamW"})
    assert "nvme-path-missing" in codes(Setup(deepspeed=ds(**base)))
    (tmp_path / "file").write_text("x")
    base["zero_optimization__offload_optimizer"]["nvme_path"] = str(tmp_path / "file")
    assert "nvme-path-unwritable" in codes(Setup(deepspeed=ds(**base)))
    base["zero_optimization__offload_optimizer"]["nvme_path"] = str(tmp_path)
    assert not {"nvme-path-missing", "nvme-path-unwritable"} & codes(Setup(deepspeed=ds(**base)))


@pytest.mark.parametrize("yaml_path", sorted((ROOT / "accelerate_configs").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_config_passes_doctor(yaml_path, monkeypatch):
    """Against the tiny model, or for a sequence-parallel size its 4 heads cannot split (the long-context presets,
    made for 27B-class models) against Gemma 3 27B (32 heads, 16 KV heads)."""
    import yaml

    monkeypatch.chdir(ROOT)
    sp = (yaml.safe_load(yaml_path.read_text()).get("parallelism_config") or {}).get("parallelism_config_sp_size", 1)
    model = "tiny-gemma3" if 4 % sp == 0 else "gemma-3-27b"
    errors = [f for f in check(accelerate=yaml_path, model=model) if f.severity == "error"]
    assert errors == []


def test_cli_exit_codes_and_json(tmp_path, cli):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(ds(gradient_accumulation_steps="8", fp16__enabled=True)))
    r = cli("doctor", "--deepspeed", bad, "--json")
    assert r.returncode == 1
    found = json.loads(r.stdout)
    assert {"string-number", "bf16-and-fp16"} <= {f["code"] for f in found}
    assert all(set(f) == {"code", "severity", "where", "what", "fix"} for f in found)
    # a shipped bf16 config is clean where bf16 is native, and only warned about (exit 0) on a CPU that emulates it
    zero3 = ROOT / "accelerate_configs" / "zero3.yaml"
    r = cli("doctor", "--accelerate", zero3, cwd=ROOT, env={"HFSCALE_NATIVE_BF16": "1"})
    assert r.returncode == 0 and "no problems found" in r.stdout
    r = cli("doctor", "--accelerate", zero3, "--json", cwd=ROOT, env={"HFSCALE_NATIVE_BF16": "0"})
    assert r.returncode == 0 and [(f["code"], f["severity"]) for f in json.loads(r.stdout)] == [("bf16-emulated-cpu", "warning")]
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    r = cli("doctor", "--deepspeed", broken)
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = cli("doctor", "--deepspeed", tmp_path / "missing.json")
    assert r.returncode == 2 and "not found" in r.stderr


def test_python_api_reads_files(tmp_path):
    with pytest.raises(HfscaleError):
        check(deepspeed=tmp_path / "nope.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(HfscaleError, match="mapping"):
        check(deepspeed=tmp_path / "list.json")


# --- fuzzing: random mutations of valid configs never crash doctor -------------------------------

leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True), st.text(max_size=12),
                 st.sampled_from(["auto", "8", "true", "3e-4", "nvme", "cpu", "bf16", "ü…😀"]))
value = st.recursive(leaf, lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(st.text(max_size=8), c, max_size=3)), max_leaves=8)


def _paths(d, prefix=()):
    for k, v in d.items():
        yield prefix + (k,)
        if isinstance(v, dict):
            yield from _paths(v, prefix + (k,))


@st.composite
def mutated(draw, base):
    d = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 5))):
        paths = list(_paths(d))
        op = draw(st.sampled_from(["set", "delete", "add", "nest"]))
        if not paths:
            op = "add"
        if op == "add":
            d[draw(st.text(max_size=10))] = draw(value)
            continue
        path = draw(st.sampled_from(paths))
        parent = d
        for p in path[:-1]:
            parent = parent[p]
        if op == "set":
            parent[path[-1]] = draw(value)
        elif op == "delete":
            parent.pop(path[-1])
        else:
            parent[path[-1]] = {draw(st.text(max_size=5)): parent[path[-1]]}
    return d


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dsd=mutated(DS3), acc=mutated(ACC3), args=mutated({"per_device_train_batch_size": 2, "bf16": True, "gradient_accumulation_steps": 4,
                                                          "gradient_checkpointing": True, "qat": "8da4w", "optim": "adamw_torch"}),
       procs=st.one_of(st.none(), st.integers(-3, 64)))
def test_fuzzed_configs_only_produce_findings(dsd, acc, args, procs):
    findings = check_setup(Setup(deepspeed=dsd, accelerate=acc, args=args, num_processes=procs))
    assert all(f.severity in ("error", "warning") for f in findings)


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=60))
def test_fuzzed_file_bytes_give_findings_or_exit_2(text, tmp_path_factory):
    p = tmp_path_factory.mktemp("fz") / "x.json"
    p.write_text(text)
    try:
        check(deepspeed=p)
    except HfscaleError as e:
        assert "\n" not in str(e)


# --- bounded output and time; what is not a config -------------------------------------------------


def _one_line_exit(r, code):
    assert r.returncode == code, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip() and not ln.startswith(NOISE)]
    assert len(lines) == 1, r.stderr
    return lines[0]


# third-party import noise on stderr (torchao's optional CUDA kernels, torch's pytree deprecation)
NOISE = ("Failed to load", "W1", "W0", "[20")


def _huge_args_yaml(path, n_keys):
    """A mapping with n_keys unknown keys holding quoted numbers (2 findings each) and a long list."""
    lines = ["per_device_train_batch_size: 2"] + [f"learning_rat_{i:06d}: '8'" for i in range(n_keys)]
    lines += ["report_to:"] + [f"  - r{i}" for i in range(n_keys)]
    path.write_text("\n".join(lines) + "\n")


def test_findings_are_capped_with_a_count_of_the_rest(tmp_path, cli):
    # measured with the same generator at 5 MB (142,000 keys + a 142,000-item list): 46.3 s and
    # 284,007 lines of output before the cap; 7-10 s (mostly imports) and 54 lines after
    f = tmp_path / "huge.yaml"
    _huge_args_yaml(f, 3000)
    r = cli("doctor", "--args", f)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    lines = r.stdout.strip().splitlines()
    rows = [ln for ln in lines if ln.startswith("error ")]
    assert len(rows) == 50
    assert "… and 5950 more findings (--max-findings 0 lists all)" in lines
    assert lines[-1] == "6000 error(s), 0 warning(s)"
    # the shown unknown keys still carry their spelling suggestion
    assert "did you mean 'learning_rate'?" in r.stdout
    r = cli("doctor", "--args", f, "--json", "--max-findings", "5")
    assert r.returncode == 1
    assert len(json.loads(r.stdout)) == 5
    assert _one_line_exit(r, 1) == "… and 5995 more findings (--max-findings 0 lists all)"


def test_spelling_suggestions_are_bounded_per_mapping():
    from hfscale.doctor.checks import SUGGEST_LIMIT

    args = {f"learning_rat{i:04d}": 1 for i in range(SUGGEST_LIMIT + 20)}
    fixes = [f.fix for f in check_setup(Setup(args=args)) if f.code == "unknown-key"]
    assert len(fixes) == SUGGEST_LIMIT + 20  # every unknown key is still reported
    assert fixes[:SUGGEST_LIMIT] == ["did you mean 'learning_rate'?"] * SUGGEST_LIMIT
    assert all("no spelling suggestions past" in f for f in fixes[SUGGEST_LIMIT:])


def test_recipe_args_are_training_arguments_read_without_importing_them():
    """A recipe's rank runs doctor on its own TrainingArguments keys (train.loop.run_doctor); checks.RECIPE_ARGS names
    them so the check needs not import transformers' training_args (peft, bitsandbytes: seconds of every rank's start).
    They must be real fields, or a typo among them would pass unseen."""
    import dataclasses
    import subprocess
    import sys

    from transformers import TrainingArguments

    from hfscale.doctor.checks import RECIPE_ARGS

    assert RECIPE_ARGS <= {f.name for f in dataclasses.fields(TrainingArguments)}
    code = ("import sys; from hfscale.doctor import check; "
            "f = check(args={'per_device_train_batch_size': 2, 'bf16': False, 'gradient_checkpointing': True}); "
            "print([x.code for x in f], 'transformers.training_args' in sys.modules, 'peft' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.split("]")[1].split() == ["False", "False"], r.stdout
    # any other key still reads the real fields: a typo is found, a real field passes
    assert [f.code for f in check_setup(Setup(args={"gradient_checkpointing": True, "learning_rat": 1}))] == ["unknown-key"]
    assert not [f for f in check_setup(Setup(args={"bf16": True, "learning_rate": 1e-3})) if f.code == "unknown-key"]


@pytest.mark.parametrize("text, why", [("", "is empty"), ("# nothing but a comment\n", "is empty"),
                                       ("- 1\n- 2\n", "must hold a mapping"), ("3\n", "must hold a mapping")])
def test_a_yaml_without_a_mapping_is_not_a_config(text, why, tmp_path, cli):
    f = tmp_path / "acc.yaml"
    f.write_text(text)
    line = _one_line_exit(cli("doctor", "--accelerate", f), 2)
    assert why in line and str(f) in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["acc.yaml"]


def test_nan_and_infinity_in_a_json_are_errors(tmp_path, cli):
    f = tmp_path / "ds.json"
    f.write_text(json.dumps({**DS3, "gradient_clipping": float("nan"),
                             "zero_optimization": {**DS3["zero_optimization"], "reduce_bucket_size": float("inf")}}))
    assert "NaN" in f.read_text() and "Infinity" in f.read_text()  # what json.dumps writes, and DeepSpeed reads
    r = cli("doctor", "--deepspeed", f, "--json")
    assert r.returncode == 1
    found = {x["where"] for x in json.loads(r.stdout) if x["code"] == "non-finite-number"}
    assert found == {f"{f}:gradient_clipping", f"{f}:zero_optimization.reduce_bucket_size"}


# --- FSDP2 traps (hfscale/doctor/fsdp.py) ------------------------------------------------------------

FSDP2 = yaml.safe_load((ROOT / "accelerate_configs" / "fsdp2.yaml").read_text())


def fsdp2(**fsdp_config):
    return {**FSDP2, "fsdp_config": {**FSDP2["fsdp_config"], **fsdp_config}}


@pytest.mark.parametrize("code, bad, good", [
    ("fsdp2-precision-twice", Setup(accelerate=FSDP2, args={"torch_dtype": "bfloat16"}),
     Setup(accelerate=FSDP2, args={"torch_dtype": "float32"})),
    ("fsdp2-accelerate-checkpointing", Setup(accelerate=fsdp2(fsdp_activation_checkpointing=True)),
     Setup(accelerate=FSDP2, args={"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"every_n_layers": 2}})),
])
def test_fsdp2_checks_fire_on_bad_and_not_on_good(code, bad, good):
    assert code in codes(bad) and code not in codes(good), check_setup(bad)


def test_fsdp2_wrap_class_names_the_models_layer():
    from hfscale.models import load_config

    cfg = load_config("tiny-gemma3")
    bad = [f for f in check_setup(Setup(accelerate=fsdp2(fsdp_transformer_layer_cls_to_wrap="LlamaDecoderLayer"),
                                        model_config=cfg, model_name="tiny-gemma3")) if f.code == "fsdp2-wrap-class"]
    assert len(bad) == 1 and "LlamaDecoderLayer" in bad[0].what and "Gemma3DecoderLayer" in bad[0].fix
    good = Setup(accelerate=fsdp2(fsdp_transformer_layer_cls_to_wrap="Gemma3DecoderLayer"), model_config=cfg)
    assert "fsdp2-wrap-class" not in codes(good)


def test_fsdp2_traps_of_accelerate_before_1_13(monkeypatch):
    """accelerate #3971 (sharded optimizer resume) and #3844 (LoRA upcast), both fixed in 1.13: flagged by version."""
    from hfscale.doctor import fsdp

    lora = {"use_peft": True, "bf16": True}
    monkeypatch.setattr(fsdp, "accelerate_version", lambda: (1, 12))
    assert {"fsdp2-sharded-optimizer-resume", "fsdp2-lora-upcast"} <= codes(Setup(accelerate=FSDP2, args=lora))
    assert "fsdp2-sharded-optimizer-resume" not in codes(Setup(accelerate=fsdp2(fsdp_state_dict_type="FULL_STATE_DICT")))
    monkeypatch.setattr(fsdp, "accelerate_version", lambda: (1, 16))  # installed here: resume measured bit-identical
    assert not {"fsdp2-sharded-optimizer-resume", "fsdp2-lora-upcast"} & codes(Setup(accelerate=FSDP2, args=lora))


# --- adapter traps (hfscale/doctor/adapters.py) -----------------------------------------------------


def _gemma4_multimodal():
    from transformers import Gemma4Config

    return Gemma4Config(vision_config={})  # a vision tower: Gemma4ClippableLinear under q_proj / k_proj / ...


def _tied_gemma():
    from hfscale.models import load_config

    return load_config("tiny-gemma3")  # tie_word_embeddings: true


LORA_GC = {"use_peft": True, "gradient_checkpointing": True}


@pytest.mark.parametrize("code, bad, good", [
    ("adapter-reentrant-frozen", Setup(args={**LORA_GC, "gradient_checkpointing_kwargs": {"use_reentrant": True}}),
     Setup(args={**LORA_GC, "gradient_checkpointing_kwargs": {"use_reentrant": False}})),
    ("adapter-reentrant-frozen", Setup(args={"adapter": {"kind": "dora"}, "gradient_checkpointing": True,
                                             "gradient_checkpointing_kwargs": {"use_reentrant": True}}),
     Setup(args={"adapter": {"kind": "none"}, "gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}})),
    ("adapter-merge-4bit", Setup(args={"use_peft": True, "load_in_4bit": True, "merge_adapter": True}),
     Setup(args={"use_peft": True, "load_in_4bit": False, "merge_adapter": True})),
    ("adapter-merge-4bit", Setup(args={"adapter": {"kind": "qlora", "merge": True}}), Setup(args={"adapter": {"kind": "qlora"}})),
    ("adapter-tied-modules-to-save", Setup(args={"use_peft": True, "lora_modules_to_save": ["embed_tokens"]}, model_config=_tied_gemma()),
     Setup(args={"use_peft": True, "lora_modules_to_save": ["norm"]}, model_config=_tied_gemma())),
    ("adapter-gemma4-clippable", Setup(args={"use_peft": True, "lora_target_modules": ["q_proj", "v_proj"]}, model_config=_gemma4_multimodal()),
     Setup(args={"use_peft": True}, model_config=_gemma4_multimodal())),
    ("qlora-fsdp2-storage", Setup(accelerate=yaml.safe_load((ROOT / "accelerate_configs" / "fsdp2.yaml").read_text()),
                                  args={"use_peft": True, "load_in_4bit": True}),
     Setup(accelerate=yaml.safe_load((ROOT / "accelerate_configs" / "fsdp2.yaml").read_text()),
           args={"use_peft": True, "load_in_4bit": True, "bnb_4bit_quant_storage": "bfloat16"})),
])
def test_adapter_traps_fire_on_bad_and_not_on_good(code, bad, good):
    assert code in codes(bad) and code not in codes(good), check_setup(bad)


FSDP2_ACC = yaml.safe_load((ROOT / "accelerate_configs" / "fsdp2.yaml").read_text())


def test_doctor_refuses_the_recipes_qlora_where_the_recipe_does():
    # recipes/train_clm.py refuses QLoRA under FSDP2 (scale.adapters.qlora_dtypes raises from the table engine_refusal
    # reads); doctor reads the same table from the files before a launch and says the same line
    from hfscale.scale.adapters import qlora_dtypes
    from hfscale.util.errors import ConfigError

    bad, good = Setup(accelerate=FSDP2_ACC, args={"adapter": "qlora"}), Setup(accelerate=FSDP2_ACC, args={"adapter": "lora"})
    found = [f for f in check_setup(bad) if f.code == "adapter-engine-refused"]
    assert len(found) == 1 and found[0].severity == "error" and "adapter-engine-refused" not in codes(good)
    with pytest.raises(ConfigError) as refused:
        qlora_dtypes("bf16", None, True)
    assert f"{found[0].what}; {found[0].fix}" == str(refused.value) and "ddp.yaml, zero2.yaml or zero3.yaml" in found[0].fix
    # under ZeRO-3 the recipe runs QLoRA and picks its storage itself (qlora_dtypes): neither refused nor a storage fix
    for args in ({"adapter": {"kind": "qlora"}, "bf16": True}, {"adapter": "qlora"}):
        assert not {"adapter-engine-refused", "qlora-zero3-storage"} & codes(Setup(deepspeed=ds(), args=args))
    # a user's own Trainer (TRL keys) under ZeRO-3 with the storage peft asks for is not the recipe: not refused
    assert "adapter-engine-refused" not in codes(Setup(deepspeed=ds(), args={"use_peft": True, "load_in_4bit": True,
                                                                           "bf16": True, "bnb_4bit_quant_storage": "bfloat16"}))


def test_doctor_reads_the_recipes_qlora_engine_from_the_shipped_files(tmp_path):
    recipe = tmp_path / "train.yaml"  # the recipe YAML's adapter section, as `plan --write` writes it
    recipe.write_text(yaml.safe_dump({"model": "tiny-gemma3", "adapter": {"kind": "qlora", "rank": 8}}))
    found = check(accelerate=ROOT / "accelerate_configs" / "fsdp2.yaml", args=recipe)
    assert [f.where for f in found if f.code == "adapter-engine-refused"] == [f"{recipe}:adapter"], found
    for ok in ("zero2.yaml", "zero3.yaml"):
        assert "adapter-engine-refused" not in {f.code for f in check(accelerate=ROOT / "accelerate_configs" / ok, args=recipe)}


def test_recipe_adapter_keys_reach_doctor():
    # what loop.run_doctor adds for the recipe's adapter: the section, the NF4 storage the recipe loads its base with
    # (hfscale.scale.adapters.qlora_dtypes: uint8 under DDP / ZeRO-2, the model's dtype under ZeRO-3; under FSDP2 the
    # recipe refuses QLoRA, so no storage is claimed and doctor's adapter-engine-refused names it) and its
    # non-reentrant checkpointing
    from types import SimpleNamespace

    from hfscale.scale.adapters import AdapterSpec
    from hfscale.train.loop import _doctor_adapter_keys

    zero2 = SimpleNamespace(deepspeed=ds(DS2), fsdp=False)
    keys = _doctor_adapter_keys(AdapterSpec("qlora", rank=8), zero2, "bf16")
    assert keys["adapter"]["kind"] == "qlora" and keys["bnb_4bit_quant_storage"] == "uint8"
    assert keys["gradient_checkpointing_kwargs"] == {"use_reentrant": False}
    base = {"bf16": True, "gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}}
    assert "adapter-reentrant-frozen" in codes(Setup(args={**base, "adapter": keys["adapter"]}))
    assert "adapter-reentrant-frozen" not in codes(Setup(args={**base, **keys}))
    zero3 = SimpleNamespace(deepspeed=ds(), fsdp=False)
    keys3 = _doctor_adapter_keys(AdapterSpec("qlora", rank=8), zero3, "bf16")
    assert keys3["bnb_4bit_quant_storage"] == "bfloat16"  # ZeRO-3 shards one dtype: the packed bytes in the model's
    assert not {"adapter-engine-refused", "qlora-zero3-storage"} & codes(Setup(deepspeed=ds(), args={"bf16": True, **keys3}))
    fsdp2 = SimpleNamespace(deepspeed=None, fsdp=True)
    assert "bnb_4bit_quant_storage" not in _doctor_adapter_keys(AdapterSpec("qlora", rank=8), fsdp2, "bf16")
    assert _doctor_adapter_keys(AdapterSpec("none"), zero3, "bf16") == {} and _doctor_adapter_keys(None, zero3, "bf16") == {}
    assert _doctor_adapter_keys({"kind": "lora"}, SimpleNamespace(deepspeed=None), "fp32")["adapter"]["rank"] == 16
