"""Every shipped config is what the CLI generates today, and the real tools' own loaders accept it."""

import json
from pathlib import Path

import pytest
import yaml

from hfscale.scale.presets import PRESETS

ROOT = Path(__file__).resolve().parents[1]
YAMLS = sorted((ROOT / "accelerate_configs").glob("*.yaml"))
JSONS = sorted((ROOT / "ds_configs").glob("*.json"))
REQUIRED = {"ddp", "zero1", "zero2", "zero3", "zero3_offload", "zero3_nvme", "fsdp2", "multinode_zero3", "zero3_sp2",
            "fsdp2_tp2"}


def test_every_required_config_is_shipped():
    assert REQUIRED <= {p.stem for p in YAMLS}
    assert {p.stem for p in YAMLS} == set(PRESETS)
    assert {p.stem for p in JSONS} == {n for n, s in PRESETS.items() if s.uses_deepspeed}


def test_regenerating_shipped_files_gives_no_drift(tmp_path, cli):
    r = cli("config", "--all", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for sub in ("accelerate_configs", "ds_configs"):
        shipped = {p.name: p.read_text() for p in (ROOT / sub).iterdir()}
        fresh = {p.name: p.read_text() for p in (tmp_path / sub).iterdir()}
        assert fresh.keys() == shipped.keys()
        for name in shipped:
            assert fresh[name] == shipped[name], f"{sub}/{name} drifted: run `make configs`"


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.stem)
def test_yaml_loads_in_accelerate_and_shows_launch(path):
    from accelerate.commands.config.config_args import load_config_from_file

    text = path.read_text()
    first = text.splitlines()[:3]
    assert first[0].startswith("# hfscale config")
    assert f"accelerate launch --config_file accelerate_configs/{path.stem}.yaml" in first[1]
    cfg = load_config_from_file(str(path))  # accelerate's own loader: rejects unknown keys
    spec = PRESETS[path.stem]
    assert cfg.num_processes == spec.launch.num_processes
    assert cfg.num_machines == spec.launch.num_machines
    expected = {"deepspeed": "DEEPSPEED", "fsdp2": "FSDP", "ddp": "MULTI_GPU"}[spec.engine]
    assert str(cfg.distributed_type).split(".")[-1] == expected
    if spec.uses_deepspeed:
        assert cfg.deepspeed_config["deepspeed_config_file"] == f"ds_configs/{path.stem}.json"
        assert (ROOT / cfg.deepspeed_config["deepspeed_config_file"]).is_file()
    if spec.engine == "fsdp2":
        assert cfg.fsdp_config["fsdp_version"] == 2
    if spec.parallel.size > 1:
        pc = _parallelism_config_as_launched(cfg)
        assert (pc.sp_size, pc.tp_size, pc.cp_size) == (spec.parallel.sp, spec.parallel.tp, spec.parallel.cp)
        assert pc.total_size == spec.launch.num_processes  # the sizes multiply to the process count
    else:
        assert cfg.parallelism_config == {}


def _parallelism_config_as_launched(cfg):
    """accelerate's own path: the YAML's parallelism_config keys become launcher arguments
    (`launch_command_parser` defaults + the keys), the launcher exports PARALLELISM_CONFIG_* and
    ParallelismConfig() reads them in each rank."""
    from unittest import mock

    from accelerate import ParallelismConfig
    from accelerate.commands.launch import launch_command_parser
    from accelerate.utils.launch import prepare_extend_env_parallelism_config

    args = launch_command_parser().parse_args(["x.py"])
    for key, value in cfg.parallelism_config.items():
        assert hasattr(args, key), f"accelerate's launcher has no argument {key}"
        setattr(args, key, value)
    env = prepare_extend_env_parallelism_config(args, {})
    assert env["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"
    with mock.patch.dict("os.environ", env):
        return ParallelismConfig()


def test_yaml_rejects_unknown_key_in_accelerate(tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    bad = tmp_path / "bad.yaml"
    data = yaml.safe_load((ROOT / "accelerate_configs" / "zero3.yaml").read_text())
    data["num_procesess"] = 2
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match="num_procesess"):
        load_config_from_file(str(bad))


@pytest.mark.parametrize("path", JSONS, ids=lambda p: p.stem)
def test_json_is_resolved_by_trainer_and_parsed_by_deepspeed(path, tmp_path):
    """HF Trainer fills the "auto" values; DeepSpeed's own config parser then accepts the result."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from transformers import TrainingArguments

    from hfscale.models import build_model
    from hfscale.scale.runtime import training_arguments_kwargs

    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    spec = PRESETS[path.stem]
    model = build_model("tiny-gemma3")  # before TrainingArguments: a ZeRO-3 config turns on zero.Init globally
    kw = training_arguments_kwargs(spec)
    kw["deepspeed"] = str(path)  # the shipped file, not the in-memory dict
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, learning_rate=3e-4,
                             report_to=[], **kw)
    try:
        hf = args.hf_deepspeed_config
        hf.trainer_config_finalize(args, model, 100)
        resolved = hf.config
    finally:
        unset_hf_deepspeed_config()
    assert "auto" not in json.dumps(resolved), "Trainer left an 'auto' unresolved"
    assert resolved["train_micro_batch_size_per_gpu"] == 4
    assert resolved["zero_optimization"]["reduce_bucket_size"] == 192 * 192  # h² for the tiny model
    ds = DeepSpeedConfig(json.loads(json.dumps(resolved)))
    assert ds.zero_optimization_stage == spec.zero.stage
    assert ds.bfloat16_config.enabled == (spec.precision == "bf16")
    assert ds.gradient_clipping == spec.gradient_clipping
    if spec.zero.stage == 3:
        assert ds.zero_config.gather_16bit_weights_on_model_save is True
    if spec.zero.offload_optimizer != "none":
        assert ds.zero_config.offload_optimizer.device == spec.zero.offload_optimizer
        assert resolved["optimizer"]["params"]["lr"] == 3e-4
    if spec.zero.uses_nvme:
        assert str(ds.zero_config.offload_optimizer.nvme_path) == spec.zero.nvme_path
        # every aio key we write is one DeepSpeed reads (a misspelt key would be silently ignored)
        written = json.loads(path.read_text())["aio"]
        assert {k: ds.aio_config[k] for k in written} == written


def test_deepspeed_rejects_a_typo_in_the_zero_block():
    from deepspeed.runtime.config import DeepSpeedConfig

    c = json.loads((ROOT / "ds_configs" / "zero3.json").read_text())
    c.update(train_batch_size=8, train_micro_batch_size_per_gpu=8, gradient_accumulation_steps=1)
    c["zero_optimization"] = {k: (1000 if v == "auto" else v) for k, v in c["zero_optimization"].items()}
    c["zero_optimization"]["stage3_gather_16bit_weights_on_modelsave"] = True
    with pytest.raises(Exception, match="stage3_gather_16bit_weights_on_modelsave"):
        DeepSpeedConfig(c)
