"""ScaleSpec validation and its pure mappings to DeepSpeed / accelerate."""

import json

import pytest

from hfscale.util.errors import ConfigError
from hfscale.scale.accelerate import render_yaml, to_accelerate
from hfscale.scale.deepspeed import to_deepspeed
from hfscale.scale.load import load_spec, spec_from_dict, spec_to_dict
from hfscale.scale.presets import PRESETS
from hfscale.scale.checkpointing import parse_checkpointing
from hfscale.scale.spec import Aio, Launch, ScaleSpec, Zero, check_nvme_path


@pytest.mark.parametrize(
    "make, fix",
    [
        (lambda: Zero(stage=2, offload_params="cpu"), "use --zero 3"),
        (lambda: Zero(stage=0, offload_optimizer="cpu"), "use --zero 2"),
        (lambda: Zero(stage=3, offload_optimizer="nvme"), "--nvme-path"),
        (lambda: Zero(stage=3, nvme_path="/x"), "add --offload-optimizer nvme"),
        (lambda: Zero(stage=4), "0, 1, 2 or 3"),
        (lambda: Zero(stage=True), "0, 1, 2 or 3"),
        (lambda: Aio(queue_depth=0), "positive integer"),
        (lambda: Launch(num_processes=0), "positive integer"),
        (lambda: Launch(num_processes=-2), "positive integer"),
        (lambda: Launch(num_processes=3, num_machines=2, main_process_ip="h"), "multiple of 2"),
        (lambda: Launch(num_machines=2, num_processes=2), "--main-process-ip"),
        (lambda: Launch(machine_rank=1), "0..0"),
        (lambda: Launch(main_process_port=70000), "1..65535"),
        (lambda: ScaleSpec("x", precision="bf16+fp16"), "bf16 and fp16 are exclusive"),
        (lambda: ScaleSpec("x", gradient_accumulation_steps=0), "positive integer or 'auto'"),
        (lambda: ScaleSpec("x", gradient_accumulation_steps="8"), "positive integer or 'auto'"),
        (lambda: ScaleSpec("x", gradient_clipping=-1.0), ">= 0"),
        (lambda: ScaleSpec("x", gradient_checkpointing="every:0"), "every:K"),
        (lambda: ScaleSpec("x", engine="ddp", zero=Zero(stage=3, offload_params="cpu")), "fsdp2 or deepspeed"),
        (lambda: ScaleSpec("x", engine="fsdp2", zero=Zero(stage=2, offload_optimizer="cpu")), "--engine deepspeed"),
        (lambda: ScaleSpec("bad name/"), "letters, digits"),
    ],
)
def test_impossible_specs_raise_with_the_fix(make, fix):
    with pytest.raises(ConfigError) as e:
        make()
    assert fix in str(e.value)
    assert "\n" not in str(e.value)


def test_checkpointing_parse():
    assert parse_checkpointing("off") == ("off", 1)
    assert parse_checkpointing("full") == ("full", 1)
    assert parse_checkpointing("every:3") == ("every", 3)


def test_precision_is_exclusive_in_deepspeed_json():
    for p, (bf16, fp16) in {"bf16": (True, False), "fp16": (False, True), "fp32": (False, False)}.items():
        ds = to_deepspeed(ScaleSpec("x", precision=p))
        assert (ds["bf16"]["enabled"], ds["fp16"]["enabled"]) == (bf16, fp16)


def test_deepspeed_mapping_of_zero3_nvme():
    spec = ScaleSpec("x", zero=Zero(stage=3, offload_optimizer="nvme", offload_params="cpu", nvme_path="/nv",
                                    aio=Aio(block_size=262144, queue_depth=16)), gradient_accumulation_steps=4)
    ds = to_deepspeed(spec)
    z = ds["zero_optimization"]
    assert z["stage"] == 3
    assert z["offload_optimizer"] == {"device": "nvme", "pin_memory": True, "nvme_path": "/nv", "buffer_count": 4}
    assert z["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert z["stage3_gather_16bit_weights_on_model_save"] is True
    assert ds["aio"]["block_size"] == 262144 and ds["aio"]["queue_depth"] == 16
    assert ds["gradient_accumulation_steps"] == 4
    # offload gets DeepSpeed's CPU Adam through a declared optimizer with Trainer/accelerate-fillable autos
    assert ds["optimizer"]["params"]["lr"] == "auto"
    # values plain accelerate would fill with a different default are never "auto"
    assert ds["gradient_clipping"] == 1.0


def test_mappings_are_pure():
    spec = PRESETS["zero3_offload"]
    a, b = to_deepspeed(spec), to_deepspeed(spec)
    a["zero_optimization"]["stage"] = 0
    assert b["zero_optimization"]["stage"] == 3
    assert to_deepspeed(spec) == b


def test_accelerate_yaml_never_duplicates_deepspeed_keys():
    # accelerate raises when these are given in both the YAML and the JSON (accelerate #3152)
    for spec in PRESETS.values():
        cfg = to_accelerate(spec, "ds.json" if spec.uses_deepspeed else None)
        if spec.uses_deepspeed:
            assert set(cfg["deepspeed_config"]) <= {"deepspeed_config_file", "zero3_init_flag", "deepspeed_multinode_launcher"}
            assert "mixed_precision" not in cfg and "gradient_accumulation_steps" not in cfg
            assert cfg["deepspeed_config"]["zero3_init_flag"] == (spec.zero.stage == 3)


@pytest.mark.parametrize("engine", ["ddp", "fsdp2", "deepspeed"])
def test_explicit_accumulation_yaml_loads_in_accelerate(engine, tmp_path):
    # accelerate's loader refuses a top-level gradient_accumulation_steps (found by tests/test_fuzz_cli.py)
    from accelerate.commands.config.config_args import load_config_from_file

    spec = ScaleSpec("ga", engine=engine, gradient_accumulation_steps=4, **({"zero": Zero(stage=2)} if engine == "deepspeed" else {}))
    p = tmp_path / "ga.yaml"
    p.write_text(render_yaml(spec, str(p), "ds.json" if engine == "deepspeed" else None))
    cfg = load_config_from_file(str(p))
    assert cfg.num_processes == spec.launch.num_processes
    assert ("ACCELERATE_GRADIENT_ACCUMULATION_STEPS=4" in p.read_text()) == (engine != "deepspeed")
    if engine == "deepspeed":
        assert to_deepspeed(spec)["gradient_accumulation_steps"] == 4


def test_multinode_fields():
    spec = PRESETS["multinode_zero3"]
    cfg = to_accelerate(spec, "ds.json")
    assert (cfg["num_machines"], cfg["num_processes"], cfg["main_process_ip"], cfg["main_process_port"]) == (2, 16, "10.0.0.1", 29500)
    assert cfg["deepspeed_config"]["deepspeed_multinode_launcher"] == "standard"
    assert cfg["rdzv_backend"] == "static"


def test_spec_file_round_trip_and_unknown_keys(tmp_path):
    for spec in PRESETS.values():
        assert spec_from_dict(json.loads(json.dumps(spec_to_dict(spec)))) == spec
    f = tmp_path / "s.yaml"
    f.write_text("name: z\nzero:\n  stage: 3\n  ofload_params: cpu\n")
    with pytest.raises(ConfigError, match=r"unknown key zero.ofload_params; did you mean 'offload_params'\?"):
        load_spec(f)
    f.write_text("name: z\nzero: 3\n")
    with pytest.raises(ConfigError, match="zero must be a mapping"):
        load_spec(f)


def test_nvme_path_must_be_creatable(tmp_path):
    ro = tmp_path / "file"
    ro.write_text("x")
    spec = ScaleSpec("x", zero=Zero(stage=3, offload_optimizer="nvme", nvme_path=str(ro / "sub")))
    with pytest.raises(ConfigError, match="not a writable directory"):
        check_nvme_path(spec)
    check_nvme_path(ScaleSpec("x", zero=Zero(stage=3, offload_optimizer="nvme", nvme_path=str(tmp_path / "new"))))


def test_public_api_for_existing_code():
    import subprocess
    import sys

    import hfscale

    assert hfscale.to_deepspeed(hfscale.preset("zero3"))["zero_optimization"]["stage"] == 3
    kw = hfscale.training_arguments_kwargs(hfscale.preset("zero2"))
    assert kw["bf16"] is True and kw["deepspeed"]["zero_optimization"]["stage"] == 2
    assert callable(hfscale.make_accelerator) and callable(hfscale.doctor.check)
    # importing the package does not import torch
    out = subprocess.run([sys.executable, "-c", "import sys, hfscale; print('torch' in sys.modules)"], capture_output=True, text=True)
    assert out.stdout.strip() == "False"
