"""SLURM multi-node launch: hostlists, the dry run, and a real 2-node run through the same code path on one host."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hfscale.util.errors import HfscaleError
from hfscale.proofs.engine import free_port
from hfscale.scale.slurm import dry_run, expand_hostlist

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("spec, hosts", [
    ("gpu01", ["gpu01"]),
    ("gpu[01-03]", ["gpu01", "gpu02", "gpu03"]),
    ("gpu[08-10,12],login1", ["gpu08", "gpu09", "gpu10", "gpu12", "login1"]),
    ("a[1-2]-ib,b3", ["a1-ib", "a2-ib", "b3"]),
])
def test_expand_hostlist(spec, hosts):
    assert expand_hostlist(spec) == hosts


@pytest.mark.parametrize("spec", ["gpu[3-1]", "gpu[a-b]", "", "gpu[01-", "gpu01-]", "gpu[1-2][3-4]"])
def test_bad_hostlists(spec):
    with pytest.raises(HfscaleError):
        expand_hostlist(spec)


def test_dry_run_prints_every_node_with_its_rank():
    lines = dry_run("accelerate_configs/multinode_zero3.yaml", ["train.py", "--lr", "1e-4"], "gpu[01-04]", 8)
    assert len(lines) == 4
    for rank, line in enumerate(lines):
        assert line.startswith(f"[gpu0{rank + 1}] accelerate launch --config_file accelerate_configs/multinode_zero3.yaml")
        assert f"--machine_rank {rank} " in line and "--num_machines 4 --num_processes 32" in line
        assert "--main_process_ip gpu01" in line and line.endswith("train.py --lr 1e-4")


def test_cli_errors_are_one_line(cli):
    env_free = cli("slurm", "--config", "x.yaml", "--gpus-per-node", "8", "--dry-run", "--", "t.py")
    assert env_free.returncode == 2 and "--nodelist" in env_free.stderr
    r = cli("slurm", "--config", "x.yaml", "--nodelist", "gpu[1-2]", "--dry-run", "--", "t.py")
    assert r.returncode == 2 and "--gpus-per-node" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.engine
def test_two_nodes_through_the_slurm_path_on_one_host(tmp_path):
    """Two 'nodes' (both localhost) each run `hfscale slurm` as srun would, with SLURM's variables."""
    port = str(free_port())
    bindir = str(Path(sys.executable).parent)
    procs = []
    for node in (0, 1):
        env = {**os.environ, "PATH": bindir + os.pathsep + os.environ["PATH"], "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
               "SLURM_JOB_NODELIST": "localhost,localhost", "SLURM_NODEID": str(node), "SLURM_GPUS_ON_NODE": "1"}
        cmd = [str(Path(bindir) / "hfscale"), "slurm", "--config", str(ROOT / "accelerate_configs" / "multinode_zero3.yaml"),
               "--port", port, "--", "-m", "hfscale.proofs.engine", "--out", str(tmp_path)]
        # output to files, not pipes: a full pipe would block one node while the other waits for it
        log = open(tmp_path / f"node{node}.log", "w")
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        for p in procs:
            p.wait(timeout=600)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    outs = [(tmp_path / f"node{n}.log").read_text(errors="replace") for n in (0, 1)]
    assert all(p.returncode == 0 for p in procs), outs[0][-2000:] + outs[1][-2000:]
    assert "--machine_rank 0" in outs[0] and "--machine_rank 1" in outs[1]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in reports:
        assert r["torch_world_size"] == r["accelerate_num_processes"] == r["deepspeed_world_size"] == 2
        assert r["zero_stage"] == 3 and r["params_partitioned_evenly"] == r["params_total"]
    assert not set(reports[0]["sample_indices"]) & set(reports[1]["sample_indices"])


# --- the environment is read when `hfscale slurm` runs, never when parsers are built ----------------

MALFORMED = {"SLURM_NNODES": "abc", "SLURM_JOB_NODELIST": "gpu[01-", "SLURM_NODEID": "x", "SLURM_GPUS_ON_NODE": "abc"}


def _run(env: dict, *args, cwd=None):
    exe = str(Path(sys.executable).parent / "hfscale")
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return subprocess.run([exe, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**base, "HF_HUB_OFFLINE": "1", **env})


def _one_line(r, code=2):
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    return lines[0]


@pytest.mark.parametrize("args", [["--help"], ["slurm", "--help"], ["config", "zero2", "--print"]])
def test_malformed_slurm_variables_do_not_break_other_commands(args, tmp_path):
    r = _run(MALFORMED, *args, cwd=tmp_path)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("env, flags, needle", [
    ({"SLURM_JOB_NODELIST": "gpu[01-"}, ["--gpus-per-node", "2", "--dry-run"], "SLURM_JOB_NODELIST"),
    ({"SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_GPUS_ON_NODE": "abc"}, ["--dry-run"], "SLURM_GPUS_ON_NODE='abc'"),
    ({"SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_NNODES": "abc"}, ["--gpus-per-node", "2", "--dry-run"], "SLURM_NNODES='abc'"),
    ({"SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_NNODES": "3"}, ["--gpus-per-node", "2", "--dry-run"], "SLURM_NNODES=3"),
    ({"SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_NODEID": "x"}, ["--gpus-per-node", "2"], "SLURM_NODEID='x'"),
])
def test_a_malformed_slurm_variable_is_one_line_naming_it(env, flags, needle, tmp_path):
    line = _one_line(_run(env, "slurm", "--config", "c.yaml", *flags, "--", "train.py", cwd=tmp_path))
    assert needle in line, line
    assert list(tmp_path.iterdir()) == []


def test_flags_win_over_malformed_slurm_variables(tmp_path):
    r = _run(MALFORMED, "slurm", "--config", "c.yaml", "--nodelist", "gpu[01-02]", "--gpus-per-node", "4",
             "--dry-run", "--", "train.py", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) == 2 and "--num_processes 8" in r.stdout


@pytest.mark.parametrize("status, requeued", [(0, False), (75, True), (138, True), (143, True), (74, False), (2, False)])
def test_sbatch_requeues_a_preempted_run_only(tmp_path, status, requeued):
    """multinode.sbatch's own logic, run by bash: the job step's status decides `scontrol requeue`, and the status is
    passed on. SLURM is not on this host, so `srun` and `scontrol` are two-line stand-ins on PATH that record their
    arguments; everything else is the shipped script."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("srun", f'echo "$@" > {tmp_path}/srun.args\nexit {status}'),
                       ("scontrol", f'echo "$@" > {tmp_path}/scontrol.args')):
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    r = subprocess.run(["bash", str(ROOT / "recipes" / "slurm" / "multinode.sbatch"), "cfg.yaml", "train.py", "--resume",
                        "latest"], capture_output=True, text=True,
                       env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "42"})
    assert r.returncode == status
    assert (tmp_path / "srun.args").read_text().split() == [
        "--kill-on-bad-exit=1", "hfscale", "slurm", "--config", "cfg.yaml", "--", "train.py", "--resume", "latest"]
    assert (tmp_path / "scontrol.args").exists() == requeued
    if requeued:
        assert (tmp_path / "scontrol.args").read_text().split() == ["requeue", "42"]
    text = (ROOT / "recipes" / "slurm" / "multinode.sbatch").read_text()
    assert "#SBATCH --requeue" in text and "#SBATCH --signal=USR1@300" in text and "SIGUSR1" in text
