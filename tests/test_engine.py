"""Each shipped config that can run on CPU, proven on the real engine: `accelerate launch` with 2
processes (DeepSpeed and FSDP2 over gloo), asserting from inside the ranks what each one saw and held.

Loss tolerance vs the 1-process run with the same global batch (8 sequences/step: 2 micro x 2 accum
x 2 ranks against 2 micro x 4 accum x 1 rank): LOSS_TOL = 2e-3 absolute at loss ~8. Both runs see the
same samples in the same micro batches; they differ only in the order gradients are summed, which
moves fp32 master weights by ~1e-7 relative and flips an occasional bf16 weight by one ULP. Observed:
0 (DDP) to 1.7e-4 (ZeRO-2/3) and 4.0e-4 (FSDP2: bf16 parameters and bf16 gradient reduce-scatter,
its MixedPrecisionPolicy, against a mesh of 1) after 4 steps. A setup whose ranks train alone (the CPU trap) averages
two different trajectories and misses the reference by 1e-2..4e-1, which this tolerance catches.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hfscale.util.errors import HfscaleError
from hfscale.util.hosts import bf16_support, resolve_precision
from hfscale.proofs.engine import free_port, launch

pytestmark = pytest.mark.engine
ROOT = Path(__file__).resolve().parents[1]
# these tests are about distribution, not bf16: they run the shipped configs' bf16 where this host
# computes it natively and fp32 where it emulates it (10x slower there); test_trainer_... keeps bf16
PRECISION = "auto"
EXPECTED = resolve_precision(PRECISION, "bf16", bf16_support("cpu")).precision
LOSS_TOL = 2e-3
GLOBAL_BATCH, MICRO, STEPS = 8, 2, 4


@pytest.fixture(scope="module")
def model_numel():
    from hfscale.models import build_model

    m = build_model("tiny-gemma3")
    return sum(p.numel() for p in m.parameters()), sum(v.numel() for v in m.state_dict().values())


@pytest.fixture(scope="module")
def nvme_config(tmp_path_factory, cli_module):
    """The shipped zero3_nvme preset with its NVMe directory pointed at a local temp dir."""
    d = tmp_path_factory.mktemp("nvme")
    r = cli_module("config", "zero3_nvme", "--nvme-path", d / "swap", "--out-accelerate", d, "--out-deepspeed", d)
    assert r.returncode == 0, r.stderr
    return d / "zero3_nvme.yaml", d / "swap"


@pytest.fixture(scope="module")
def cli_module():
    from conftest import run_cli

    return run_cli


def _config_path(name, nvme_config):
    return nvme_config[0] if name == "zero3_nvme" else ROOT / "accelerate_configs" / f"{name}.yaml"


def _common_asserts(reports, ref):
    assert len(reports) == 2
    for r in reports:
        assert r["accelerate_num_processes"] == 2, "accelerate must see both ranks (the CPU trap)"
        assert r["torch_world_size"] == 2 and r["backend"] == "gloo"
        assert r["accelerate_process_index"] == r["torch_rank"]
    assert sorted(r["torch_rank"] for r in reports) == [0, 1]
    # each rank trained on its own half of the data, together all of it, nothing twice
    a, b = (set(r["sample_indices"]) for r in reports)
    n = reports[0]["dataset_size"]
    assert n == STEPS * GLOBAL_BATCH and len(a) == len(b) == n // 2 and not (a & b) and a | b == set(range(n))
    assert ref[0]["sample_indices"] == list(range(n))
    # the loss is the same global-batch mean on both ranks, it falls, and matches the 1-process run
    assert reports[0]["losses"] == reports[1]["losses"]
    losses, ref_losses = reports[0]["losses"], ref[0]["losses"]
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.2
    diff = max(abs(x - y) for x, y in zip(losses, ref_losses))
    assert diff < LOSS_TOL, f"2-process loss {losses} vs 1-process {ref_losses}: max |Δ| {diff:.2e}"


def _deepspeed_asserts(reports, ref):
    for r in reports:
        assert r["distributed_type"] == "DEEPSPEED"
        assert r["deepspeed_world_size"] == r["deepspeed_dp_world_size"] == 2
        assert (r["deepspeed_train_batch_size"], r["deepspeed_micro_batch"], r["deepspeed_grad_accum"]) == (8, 2, 2)
        assert r["deepspeed_bf16"] is (EXPECTED == "bf16") and r["precision"] == EXPECTED
    assert ref[0]["deepspeed_world_size"] == 1 and ref[0]["deepspeed_grad_accum"] == 4
    assert sorted(r["deepspeed_rank"] for r in reports) == [0, 1]


CPU_CONFIGS = ["ddp", "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload", "zero3_nvme"]


def _family(name: str) -> str:
    return "ddp" if name == "ddp" else ("zero3" if name.startswith("zero3") else "zero2")


@pytest.fixture(scope="module")
def reference(request, tmp_path_factory):
    """The 1-process run a 2-process run is compared with, one per engine family: `ddp`, `zero2` for ZeRO stages 1
    and 2, `zero3` for stage 3 (zero.Init builds the model under partitioning, so its initial weights, and trajectory,
    differ from the others': 0.036 at step 0 in bf16). A 1-process run does not shard, so within a family offload
    changes only where its optimizer steps (DeepSpeedCPUAdam or torch's AdamW, equal up to rounding): the trajectory a
    2-process run must reproduce within LOSS_TOL is the family's. Four 1-process launches fewer than a reference per
    config; the families this session's selected tests need are launched side by side when the first is asked for
    (each is one process, mostly one thread: they overlap on 2 cores), on distinct ports, and all are waited for
    before the module ends."""
    from concurrent.futures import ThreadPoolExecutor

    from conftest import fresh_port, selected_params

    needed = sorted({_family(c.params["name"]) for c in selected_params(request, "test_shipped_config_distributes_for_real")})
    pool, runs = ThreadPoolExecutor(3), {}

    def get(name: str):
        if not runs:
            for fam in needed:
                runs[fam] = pool.submit(launch, str(ROOT / "accelerate_configs" / f"{fam}.yaml"),
                                        tmp_path_factory.mktemp(f"ref_{fam}"), 1, precision=PRECISION, port=fresh_port())
        return runs[_family(name)].result()

    yield get
    pool.shutdown(wait=True)  # a launch nobody asked for finishes (launch's own timeout) before the module's teardown


@pytest.mark.parametrize("name", CPU_CONFIGS)
def test_shipped_config_distributes_for_real(name, tmp_path, nvme_config, model_numel, monkeypatch, reference):
    full, state_full = model_numel
    cfg = _config_path(name, nvme_config)
    ref = reference(name)
    if name == "zero2":  # launched from elsewhere: the YAML's ds_configs/zero2.json is found beside it, not in the cwd
        monkeypatch.chdir(tmp_path)
    reports = launch(str(cfg), tmp_path / "ranks", 2, precision=PRECISION)
    _common_asserts(reports, ref)
    r0 = reports[0]
    assert r0["param_numel_full"] == full
    if name == "ddp":
        for r in reports:  # a full replica and a full Adam state on each rank
            assert r["distributed_type"] == "MULTI_CPU"
            assert r["param_numel_local"] == full
            assert r["optimizer_state_numel_by_key"] == {"exp_avg": full, "exp_avg_sq": full}
        return
    _deepspeed_asserts(reports, ref)
    stage = int(name[4])
    nvme = name == "zero3_nvme"
    assert ref[0]["optimizer_state_numel_by_key"]["exp_avg"] == full  # alone, a rank holds all of it
    for r in reports:
        assert r["zero_stage"] == stage
        per_moment = r["optimizer_state_numel_by_key"]["exp_avg"]
        assert per_moment == r["optimizer_state_numel_by_key"]["exp_avg_sq"]
        if nvme:  # between steps the Adam moments are swapped out: nothing of them stays in memory
            assert per_moment == 0
        else:  # half of the optimizer state (DeepSpeed may pad the flat partition by a few elements)
            assert full / 2 <= per_moment <= full / 2 + 64, (per_moment, full)
        if stage == 3:
            # every parameter tensor is cut in half (padded to ceil(numel / 2))
            assert r["params_partitioned_evenly"] == r["params_total"] == 54
            assert full / 2 <= r["param_numel_local"] <= full / 2 + r["params_total"]
        else:
            assert r["param_numel_local"] == full  # stage 1/2 keep whole parameters
        # the engine's precision is the parameters' dtype (ZeRO-3's zero.Init partitioned bf16 under an fp32
        # engine before make_accelerator re-registered the config it changed)
        assert r["param_dtypes"] == [{"bf16": "torch.bfloat16", "fp32": "torch.float32"}[EXPECTED]], r["param_dtypes"]
        # the fp32 master partition the optimizer steps on: this rank's half (swapped out under NVMe)
        if nvme:
            assert r["fp32_master_numel_local"] == 0
        else:
            assert full / 2 <= r["fp32_master_numel_local"] <= full / 2 + 64, (r["fp32_master_numel_local"], full)
        if "offload" in name or "nvme" in name:
            assert r["base_optimizer_class"] == "DeepSpeedCPUAdam"
            assert r["optimizer_state_devices"] == ["cpu"]
            assert r["offload_optimizer"] and r["offload_param"] == (stage == 3)
            if "offload" in name:  # the fp32 gradient partition stays allocated on the offload device
                assert r["fp32_grad_numel_local"] == r["fp32_master_numel_local"]
                assert r["fp32_master_devices"] == r["fp32_grad_devices"] == ["cpu"]
        else:
            assert r["base_optimizer_class"] == "AdamW"
            assert not r["offload_optimizer"] and not r["offload_param"]
        if name == "zero3_nvme":
            files = r["nvme_files"]
            rank = r["torch_rank"]
            swapped = {k: v for k, v in files.items() if f"/rank{rank}/" in k and "gradient" not in k}
            # exp_avg, exp_avg_sq and the fp32 master partition swapped to this rank's NVMe dir
            assert len(swapped) == 3 and sum("exp_avg" in k for k in swapped) == 2, files
            for size in swapped.values():  # fp32, this rank's half
                assert 4 * full / 2 <= size <= 4 * (full / 2 + 4096), (size, full)
    if stage == 3:
        # the consolidated (16-bit gathered) state dict is the whole model, not a shard
        assert r0["state_dict_numel"] == state_full


def test_fsdp2_from_hfscale_config_shards_trains_and_checkpoints_every_2(tmp_path, cli_module, model_numel):
    """`hfscale config fsdp2 --checkpointing every:2` on 2 processes: accelerate's own FSDP2 path
    (fsdp2_prepare_model -> fully_shard over a cpu mesh, gloo), not an unsharded fallback. One launch asserts
    the sharding per tensor, the loss against 1 process, the recomputed layers and the consolidated state dict (its
    size, and its logits after a reload)."""
    full, state_full = model_numel
    r = cli_module("config", "fsdp2", "--num-processes", "2", "--checkpointing", "every:2",
                   "--out-accelerate", tmp_path, "--out-deepspeed", tmp_path)
    assert r.returncode == 0, r.stderr
    cfg = str(tmp_path / "fsdp2.yaml")
    extra = ["--checkpointing", "every:2"]
    reports = launch(cfg, tmp_path / "ranks", 2, extra, precision=PRECISION)
    ref = launch(cfg, tmp_path / "ref", 1, extra, precision=PRECISION)
    _common_asserts(reports, ref)
    for r in reports + ref:
        assert r["distributed_type"] == "FSDP" and r["backend"] == "gloo"
        # every parameter tensor (54) is a DTensor, Shard(0) over a mesh of the world, holding its torch.chunk rows
        assert r["dtensor_params"] == r["params_sharded_dim0"] == r["params_total"] == 54
        assert r["param_dtypes"] == ["torch.float32"]  # fp32 sharded masters; bf16 is the MixedPrecisionPolicy's compute
        assert r["mixed_precision"] == ("bf16" if EXPECTED == "bf16" else "no")
        # every:2 of 4 layers: layers 0 and 2 run their forward again in backward, 1 and 3 once per micro step
        m = r["micro_steps"]
        assert r["checkpointed_layers"] == [0, 2] and r["layer_forward_calls"] == [2 * m, m, 2 * m, m]
    assert ref[0]["param_numel_local"] == full  # a mesh of 1 holds everything
    for r in reports:  # every dim 0 of the tiny Gemma is even: exactly half of each tensor, and of the Adam moments
        assert r["param_numel_local"] == full // 2
        assert r["optimizer_state_numel_by_key"] == {"exp_avg": full // 2, "exp_avg_sq": full // 2}
        assert r["optimizer_state_devices"] == ["cpu"] and r["base_optimizer_class"] == "AdamW"
    assert reports[0]["state_dict_numel"] == state_full  # get_state_dict gathers the full model on rank 0
    # that state dict loaded into a fresh model gives the live sharded model's logits: measured 0.0 in fp32, 0.0156
    # (one bf16 step at |logit| 2-4) in bf16; an untrained or partial model is off by whole units
    assert reports[0]["consolidated_max_abs_logit_diff"] <= (0.0625 if EXPECTED == "bf16" else 1e-5)


def test_fsdp1_on_a_cpu_host_is_refused_in_one_line():
    """FSDP1 needs CUDA; refused before any process group or Accelerator is built."""
    from hfscale.scale.runtime import enable_fsdp_on_cpu

    with pytest.raises(HfscaleError, match="fsdp_version: 2"):
        enable_fsdp_on_cpu({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"})


def test_multinode_config_two_machines_on_one_host(tmp_path, model_numel):
    """The shipped multinode_zero3 config, as 2 machines x 1 process: two launchers, machine ranks 0/1."""
    cfg = ROOT / "accelerate_configs" / "multinode_zero3.yaml"
    reports = launch(str(cfg), tmp_path / "ranks", 2, num_machines=2, precision=PRECISION)
    assert sorted(r["torch_rank"] for r in reports) == [0, 1]
    full, state_full = model_numel
    for r in reports:
        assert r["accelerate_num_processes"] == r["torch_world_size"] == r["deepspeed_world_size"] == 2
        assert r["zero_stage"] == 3 and r["params_partitioned_evenly"] == 54
        assert full / 2 <= r["param_numel_local"] <= full / 2 + 54
    a, b = (set(r["sample_indices"]) for r in reports)
    assert not (a & b) and len(a | b) == reports[0]["dataset_size"]
    assert reports[0]["state_dict_numel"] == state_full


def test_trainer_accepts_shipped_deepspeed_config_on_two_processes(tmp_path):
    """About bf16 too: the shipped JSON's bf16 as HF Trainer runs it (3 small steps, bf16 on every host)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "accelerate_configs" / "zero2.yaml"),
           "--num_processes", "2", "--main_process_port", str(free_port()),
           str(ROOT / "tests" / "scripts" / "trainer_probe.py"), str(tmp_path), str(ROOT / "ds_configs" / "zero2.json")]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    reports = [json.loads((tmp_path / f"trainer_rank{r}.json").read_text()) for r in (0, 1)]
    for r in reports:
        assert r["args_world_size"] == r["accelerate_num_processes"] == r["engine_world_size"] == 2
        assert r["zero_stage"] == 2 and r["bf16"] is True
        # the "auto" values, filled by Trainer: 2 micro x 2 accum x 2 ranks; h² bucket
        assert (r["train_batch_size"], r["micro"], r["gradient_accumulation_steps"]) == (8, 2, 2)
        assert r["reduce_bucket_size"] == 192 * 192
        assert len(r["losses"]) == 3 and all(math.isfinite(x) for x in r["losses"])
    assert sorted(r["rank"] for r in reports) == [0, 1]
