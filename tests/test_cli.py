"""The CLI as users meet it: exit codes, one-line errors, nothing written on failure, --force."""

import json

import pytest
import yaml


def _one_line_error(r):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    return lines[0]


@pytest.mark.parametrize(
    "args, fix",
    [
        (["config", "zero2", "--offload-params", "cpu"], "use --zero 3"),
        (["config", "zero3", "--precision", "bf16,fp16"], "invalid choice"),
        (["config", "zero3", "--num-processes", "0"], "positive integer"),
        (["config", "zero3", "--num-processes", "-4"], "positive integer"),
        (["config", "zero3", "--grad-accum", "0"], "positive integer"),
        (["config", "zero3", "--offload-optimizer", "nvme"], "--nvme-path"),
        (["config", "zero3", "--offload-optimizer", "nvme", "--nvme-path", "{file}/sub"], "not a writable directory"),
        (["config", "multinode_zero3", "--num-processes", "3"], "multiple of 2"),
        (["config", "zero3", "--machine-rank", "1"], "--machine-rank"),
        (["config", "--spec", "{spec}"], "did you mean 'offload_params'"),
        (["config", "--spec", "{missing}"], "not found"),
        (["config"], "name a preset"),
        (["config", "zero9"], "invalid choice"),
        (["prove", "--config", "{missing}"], "hfscale config"),
        (["prove", "--config", "{lost_ds}", "--out", "{out}"], "names deepspeed_config_file gone/zero2.json"),
    ],
)
def test_bad_input_one_line_exit_2_nothing_written(args, fix, tmp_path, cli):
    (tmp_path / "f").write_text("x")
    (tmp_path / "spec.yaml").write_text("name: s\nzero:\n  stage: 3\n  offload_param: cpu\n")
    (tmp_path / "lost_ds.yaml").write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: "
                                           "gone/zero2.json\nnum_processes: 2\n")
    out = tmp_path / "out"
    subs = {"file": tmp_path / "f", "spec": tmp_path / "spec.yaml", "missing": tmp_path / "nope.yaml",
            "lost_ds": tmp_path / "lost_ds.yaml", "out": out}
    args = [a.format(**subs) for a in args]
    extra = ["--out-accelerate", out, "--out-deepspeed", out] if args[0] == "config" else []
    line = _one_line_error(cli(*args, *extra, cwd=tmp_path))
    assert fix in line
    assert not out.exists(), "nothing may be written on bad input"


def test_existing_output_needs_force_and_stays_intact(tmp_path, cli):
    out = tmp_path / "cfg"
    assert cli("config", "zero3", "--out-accelerate", out, "--out-deepspeed", out).returncode == 0
    before = {p.name: p.read_text() for p in out.iterdir()}
    assert set(before) == {"zero3.yaml", "zero3.json"}
    # a different config under the same name is refused: both files untouched
    line = _one_line_error(cli("config", "zero3", "--zero", "2", "--out-accelerate", out, "--out-deepspeed", out))
    assert "--force" in line
    assert {p.name: p.read_text() for p in out.iterdir()} == before
    r = cli("config", "zero3", "--zero", "2", "--force", "--out-accelerate", out, "--out-deepspeed", out)
    assert r.returncode == 0
    assert json.loads((out / "zero3.json").read_text())["zero_optimization"]["stage"] == 2
    assert not [p for p in out.iterdir() if p.name.startswith(".")], "no temp files left behind"


def test_config_flags_reach_the_files(tmp_path, cli):
    out = tmp_path / "c"
    r = cli("config", "zero3", "--name", "z3", "--num-processes", "32", "--num-machines", "4", "--main-process-ip",
            "10.1.0.7", "--grad-accum", "4", "--clip", "0.5", "--offload-optimizer", "cpu",
            "--out-accelerate", out, "--out-deepspeed", out)
    assert r.returncode == 0, r.stderr
    y = yaml.safe_load((out / "z3.yaml").read_text())
    d = json.loads((out / "z3.json").read_text())
    assert (y["num_processes"], y["num_machines"], y["main_process_ip"]) == (32, 4, "10.1.0.7")
    assert y["deepspeed_config"]["deepspeed_config_file"] == str(out / "z3.json")
    assert (d["gradient_accumulation_steps"], d["gradient_clipping"]) == (4, 0.5)
    assert d["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_print_writes_nothing(tmp_path, cli):
    r = cli("config", "zero2", "--print", cwd=tmp_path)
    assert r.returncode == 0 and '"stage": 2' in r.stdout
    assert not list(tmp_path.iterdir())


def test_help_has_examples(cli):
    r = cli("config", "--help")
    assert r.returncode == 0 and "examples:" in r.stdout and "hfscale config zero3" in r.stdout
    assert "examples:" in cli("--help").stdout


def test_quiet_by_default_verbose_shows_third_party_notices(cli, root):
    """hfscale/util/quiet.py's known noise is gone from stderr by default and back with --verbose; the command's
    own output is the same either way."""
    quiet = cli("doctor", "--deepspeed", root / "ds_configs" / "zero2.json", cwd=root)
    loud = cli("doctor", "--deepspeed", root / "ds_configs" / "zero2.json", "--verbose", cwd=root)
    assert quiet.returncode == loud.returncode == 0 and quiet.stdout == loud.stdout
    for noise in ("Setting accelerator to CPU", "Failed to load", "register_constant"):
        assert noise not in quiet.stderr
    assert "Setting accelerator to CPU" in loud.stderr  # DeepSpeed says it on every CPU-only host
