"""Using a ScaleSpec (or shipped files) from inside training code: what the launch really is, the
Accelerator factory (in the precision chosen), the optimizer that matches the DeepSpeed config, and
the TrainingArguments keywords."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from .spec import ScaleSpec
from .trainer import to_training_arguments


@dataclass(frozen=True)
class LaunchView:
    """What a launch will really run with, read once (at the edge: a recipe's or the proof's start) from the
    launcher's environment and the DeepSpeed JSON it names."""
    world: int
    deepspeed_file: str | None  # ACCELERATE_DEEPSPEED_CONFIG_FILE
    deepspeed: dict | None  # that JSON as the user wrote it
    precision: str  # what the launch config says: bf16 | fp16 | fp32
    on_cpu: bool
    fsdp_checkpoints_all: bool = False  # FSDP with fsdp_activation_checkpointing: accelerate wraps every layer at prepare
    fsdp: bool = False  # an FSDP launch (ACCELERATE_USE_FSDP)


def read_launch(environ) -> LaunchView:
    """The launch as accelerate will see it: the DeepSpeed JSON, else accelerate's mixed_precision."""
    import torch

    from .deepspeed import ds_precision
    from .load import read_mapping
    from ..util.errors import HfscaleError

    try:
        world = int(environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise HfscaleError(f"WORLD_SIZE={environ['WORLD_SIZE']!r} is not an integer; launch with accelerate launch / torchrun") from None
    mp = {"no": "fp32"}.get(environ.get("ACCELERATE_MIXED_PRECISION", "no"), environ.get("ACCELERATE_MIXED_PRECISION", "no"))
    ds_file = environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") if environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true" else None
    ds = read_mapping(ds_file, "DeepSpeed config") if ds_file else None
    precision = (ds_precision(ds) if ds is not None else None) or mp  # "auto" in the JSON: accelerate's value
    if precision not in ("bf16", "fp16", "fp32"):
        precision = "fp32"
    on_cpu = environ.get("ACCELERATE_USE_CPU", "false").lower() == "true" or not torch.cuda.is_available()
    fsdp = environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    fsdp_ac = fsdp and environ.get("FSDP_ACTIVATION_CHECKPOINTING", "false").lower() == "true"
    return LaunchView(world, ds_file, ds, precision, on_cpu, fsdp_ac, fsdp)


def cpu_only_host() -> bool:
    import torch

    return not torch.cuda.is_available()


def make_accelerator(precision: str | None = None, **kwargs):
    """`accelerate.Accelerator(**kwargs)` that really distributes, on GPU and on CPU-only hosts.

    `precision` (bf16 | fp16 | fp32, e.g. from `hfscale.util.hosts.resolve_precision`) replaces what the
    launch config says: the DeepSpeed plugin's bf16/fp16 blocks (read by `deepspeed.initialize` at
    `prepare`), or accelerate's mixed_precision for the other engines. None: the launch config decides.

    Measured traps on a CPU-only host under `accelerate launch` (torchrun starts N processes):
      DeepSpeed: torch.distributed has world size N but accelerate says 1 and every rank trains
                 alone -> fixed by InitProcessGroupKwargs(backend="gloo").
      DDP:       accelerate picks distributed_type NO, never wraps DDP and never syncs gradients
                 -> fixed by cpu=True (MULTI_CPU over gloo).
      FSDP:      accelerate switches to DistributedType.FSDP only for GPU-like MULTI_* types and
                 silently trains unsharded under MULTI_CPU -> FSDP2: the state is built as MULTI_CPU
                 (gloo, device cpu) and then switched exactly as accelerate's own switch does
                 (`enable_fsdp_on_cpu`), so prepare / save_state / get_state_dict run accelerate's
                 FSDP2 code (fsdp2_prepare_model, torch.distributed.checkpoint). FSDP1 is refused.
    Afterwards it checks that accelerate sees the world the launcher started, so a rank can never
    quietly train alone.
    """
    import os

    from accelerate import Accelerator
    from accelerate.utils import DistributedType, InitProcessGroupKwargs

    from ..util.errors import HfscaleError

    launched = int(os.environ.get("WORLD_SIZE", "1"))
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    handlers = list(kwargs.pop("kwargs_handlers", None) or [])
    if cpu_only_host() and fsdp and not deepspeed and "LOCAL_RANK" in os.environ:
        # launched (torchrun / accelerate launch), also as 1 process: a mesh of 1 runs the same FSDP2 code, so a
        # sharded checkpoint of N ranks resumes here through torch.distributed.checkpoint
        refuse_parallel_on_cpu(os.environ, deepspeed)
        enable_fsdp_on_cpu(os.environ, precision)
        kwargs.setdefault("cpu", True)
    elif cpu_only_host() and launched > 1:
        refuse_parallel_on_cpu(os.environ, deepspeed)
        if fsdp:
            raise HfscaleError("FSDP on a CPU-only host runs under a launcher that sets LOCAL_RANK; start it with "
                               "accelerate launch --config_file YOUR_FSDP2.yaml")
        if deepspeed:
            if not any(isinstance(h, InitProcessGroupKwargs) for h in handlers):
                handlers.append(InitProcessGroupKwargs(backend="gloo"))
        else:
            kwargs.setdefault("cpu", True)
    if precision is not None and not deepspeed:
        kwargs["mixed_precision"] = {"fp32": "no"}.get(precision, precision)
    if deepspeed:
        from .op_locks import refuse_stale_locks

        refuse_stale_locks()  # else DeepSpeed's op loader waits forever on a killed build's lock
    accelerator = Accelerator(kwargs_handlers=handlers, **kwargs)
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if precision is not None and plugin is not None:
        set_deepspeed_precision(plugin.deepspeed_config, precision)
        if plugin.zero3_init_flag:
            # transformers' zero.Init reads the config accelerate registered at Accelerator(): without this a
            # ZeRO-3 model is partitioned in the launch config's bf16 while the engine runs `precision`
            # (measured: fp32 engine, bf16 partitions, before this)
            plugin.set_deepspeed_weakref()
    if accelerator.num_processes != launched or (launched > 1 and accelerator.distributed_type == DistributedType.NO):
        raise RuntimeError(
            f"accelerate sees {accelerator.num_processes} process(es) ({accelerator.distributed_type}) but "
            f"{launched} were launched; each rank would train alone"
        )
    end_process_group_at_exit()
    hold_process_groups()
    return accelerator


@contextlib.contextmanager
def without_zero_init(accelerator):
    """Models built inside are whole (not partitioned by ZeRO-3's zero.Init, a collective): for what one rank builds
    alone, e.g. the base an adapter is merged into on the main rank. accelerate's zero3_init_context_manager leaves
    transformers' config registered (accelerate 1.16), so this unsets it and registers it again after."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None or not plugin.zero3_init_flag:
        yield
        return
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()


def exit_rank(code: int | None):
    """End a launched rank with `code` (its outputs written) the way every hfscale launch path ends: the
    recipes (train_clm, distill_clm, qat_clm), the proof / profile ranks, and a Trainer script's last line
    (`hfscale.exit_rank(0)`). Non-daemon threads are joined and the atexit handlers run (hfscale's process-group
    teardown among them) as at a normal exit, the standard streams are flushed, then os._exit: no interpreter
    finalization.

    Finalization is where the exit race lives. Caught under gdb on this host (2 gloo ranks, a normal exit): a
    gloo worker thread (pt_gloo_runloop) drops the last reference to a finished AsyncWork whose tensors were made
    in Python; releasing them takes the GIL (TensorImpl::decref_pyobject); the main thread is already in
    Py_FinalizeEx, so take_gil ends the thread with pthread_exit; the forced unwind meets a noexcept destructor
    (~AsyncWork) and std::terminate aborts the rank: SIGABRT, "terminate called without an active exception",
    after all its work is done. Any C++ thread that takes the GIL then dies the same way (a group DeepSpeed still
    holds outlives destroy_process_group), so the robust end is to skip finalization, not to win the race."""
    import atexit
    import os
    import sys
    import threading

    for t in threading.enumerate():  # what finalization's threading._shutdown waits for
        if t is not threading.current_thread() and not t.daemon and t.is_alive():
            t.join()
    exit_rank.ending = True  # the atexit teardown keeps the held process groups: os._exit follows
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream has nothing left to lose
            pass
    os._exit(0 if code is None else code if isinstance(code, int) else 1)  # as sys.exit reads it


_HELD_GROUPS: list = []  # every process group this process made (hold_process_groups)


def hold_process_groups() -> None:
    """Keep a reference to every registered process group, so that no c10d ProcessGroupGloo destructor runs when
    its last other holder lets go (DDP's Reducer, a DeepSpeed engine): under exit_rank the groups end with os._exit;
    on a normal exit the atexit teardown (end_process_group_at_exit) releases them before finalization. Idempotent;
    make_accelerator, the step loop (after `prepare`, once DeepSpeed made its groups) and end_process_group call it.

    The destructor joins the group's gloo worker threads while its caller holds the GIL, and a worker that is
    still releasing a finished collective's Python-made tensors needs the GIL: a deadlock. Caught under gdb here
    (2 DDP ranks over gloo, a save that failed on a full disk; 3 of 60 launches on the 2-core host with three busy
    processes beside them, 0 of 100 with the groups held: benchmarks/results/failed_save_exit.md):
    destroy_process_group had unregistered the group, DDP's Reducer still held it, and
    when the run's frames were freed rank 1 sat in ~ProcessGroupGloo -> std::thread::join while its
    pt_gloo_runloop thread sat in ~AsyncBroadcastWork -> TensorImpl::decref_pyobject -> take_gil, until torchrun
    SIGKILLed it 30 s after rank 0 had left. accelerate's end_training destroys the group the same way, with the
    model still alive."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    from torch.distributed.distributed_c10d import _world

    for pg in list(_world.pg_map):
        if all(pg is not held for held in _HELD_GROUPS):
            _HELD_GROUPS.append(pg)


def end_process_group(barrier: bool = True) -> None:
    """Destroy the default process group now, after a barrier (every rank calls it at the end of a run), so no
    rank leaves while another still talks to it. The groups' C++ objects are held (hold_process_groups) and end
    with the process. Idempotent."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if barrier:
            dist.barrier()
        hold_process_groups()
        dist.destroy_process_group()


def end_process_group_at_exit() -> None:
    """Destroy the process group at interpreter exit (atexit, while Python is still whole) if the script did not.
    Left to interpreter finalization, gloo's worker threads can still hold work objects whose tensors reference
    Python objects; destroying them then takes the GIL of a dying interpreter and the rank dies of SIGABRT
    ("terminate called without an active exception") after training finished — the exit race of a 2-rank
    Trainer run (pytorch/pytorch#179291 describes the mechanism). No barrier here: on an error exit the other
    ranks may be gone. Registered once per process by make_accelerator; a Trainer script calls it itself.

    Under exit_rank the groups stay held (hold_process_groups) and end with os._exit. On a normal exit they are
    released here, so their destructors join the gloo workers before finalization rather than in it: held into
    finalization (in a list, or leaked), the Trainer ending of tests/test_exit.py lost a rank to SIGABRT within its
    first 2 launches."""
    import atexit

    if not getattr(end_process_group_at_exit, "registered", False):
        atexit.register(_teardown_at_exit)
        end_process_group_at_exit.registered = True


def _teardown_at_exit() -> None:
    end_process_group(barrier=False)
    if not getattr(exit_rank, "ending", False):
        _HELD_GROUPS.clear()


def enable_fsdp_on_cpu(environ, precision: str | None = None):
    """Build accelerate's state for an FSDP2 launch on a CPU-only host, before `Accelerator()`.

    accelerate 1.16 (state.py, AcceleratorState.__init__) sets `distributed_type = FSDP`, stores the plugin and
    applies mixed precision to it only when the type is MULTI_GPU/NPU/XPU/...; under MULTI_CPU (gloo) it skips
    that branch and the model is never sharded. Here the state is first built as MULTI_CPU (gloo process
    group, device cpu) and then those three steps are done as accelerate does them; `Accelerator()` then finds
    the state initialised and every FSDP2 path of accelerate runs as on GPUs (fully_shard over a cpu mesh,
    DTensor parameters, torch.distributed.checkpoint). Returns the AcceleratorState."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, TorchDynamoPlugin

    from ..util.errors import HfscaleError

    version = str(environ.get("FSDP_VERSION", "1"))
    if version != "2":
        raise HfscaleError(f"FSDP version {version} does not run on a CPU-only host (FSDP1 needs CUDA); set "
                           "fsdp_config.fsdp_version: 2 (hfscale config fsdp2)")
    if environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true":
        raise HfscaleError("tp_size / cp_size with FSDP2 do not run on a CPU-only host here (accelerate builds the "
                           "mesh for a GPU device); launch FSDP2 without parallelism_config")
    plugin = FullyShardedDataParallelPlugin()  # reads the launcher's FSDP_* variables, like Accelerator() would
    from torch.distributed.fsdp import CPUOffloadPolicy

    if isinstance(plugin.cpu_offload, CPUOffloadPolicy) and plugin.cpu_offload.pin_memory:
        # fsdp_offload_params: the sharded parameters, gradients and the optimizer step stay on the host as asked;
        # only pinning (a host-to-accelerator transfer aid) needs an accelerator: torch raises "Cannot access
        # accelerator device when none is available" in reset_sharded_param without one
        plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)
    mixed = {"fp32": "no"}.get(precision, precision) if precision is not None else None
    state = AcceleratorState(mixed_precision=mixed, cpu=True, fsdp_plugin=plugin, dynamo_plugin=TorchDynamoPlugin(),
                             _from_accelerator=True)
    if state.distributed_type != DistributedType.MULTI_CPU or state.backend != "gloo":
        raise RuntimeError(f"expected a MULTI_CPU gloo state before switching to FSDP, got {state.distributed_type} "
                           f"{state.backend}")
    # accelerate's own switch (state.py, the MULTI_* branch): type, plugin, mixed precision on the plugin
    state.distributed_type = DistributedType.FSDP
    if state._mixed_precision != "no":
        plugin.set_mixed_precision(state._mixed_precision)
    state.fsdp_plugin = plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    return state


def refuse_parallel_on_cpu(environ, deepspeed: bool | None = None) -> None:
    """accelerate 1.16 applies a parallelism_config only under FSDP2, DeepSpeed or a multi-GPU/accelerator type;
    on a CPU-only host it raises at Accelerator() (MULTI_CPU). DeepSpeed Ulysses SP does run here (gloo)."""
    from ..util.errors import HfscaleError

    if environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true" or not cpu_only_host():
        return
    if deepspeed is None:
        deepspeed = environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    sizes = {k: int(environ.get(f"PARALLELISM_CONFIG_{k.upper()}_SIZE", "1") or 1) for k in ("tp", "cp")}
    sp = int(environ.get("PARALLELISM_CONFIG_SP_SIZE", "1") or 1)
    if sp > 1 and not deepspeed and not any(v > 1 for v in sizes.values()):
        raise HfscaleError(f"sequence parallel (sp_size {sp}) runs under DeepSpeed only; launch with a DeepSpeed config "
                           f"(hfscale config zero3 --sp {sp})")
    if any(v > 1 for v in sizes.values()) or not deepspeed:
        raise HfscaleError(
            f"accelerate does not apply tp_size / cp_size on a CPU-only host ({sizes}; it accepts a parallelism_config "
            "only under GPU DDP, FSDP2 or DeepSpeed); run TP / CP on GPUs, or here load the model with "
            "DistributedConfig(tp_plan=\"auto\") under a launch without parallelism_config (hfscale.proofs.parallel --mode tp)")


def set_deepspeed_precision(ds_config: dict, precision: str) -> dict:
    """Set a DeepSpeed config's bf16 / fp16 blocks to `precision` in place (both off = fp32)."""
    for key in ("bf16", "fp16"):
        block = ds_config.get(key)
        ds_config[key] = {**(block if isinstance(block, dict) else {}), "enabled": precision == key}
    return ds_config


def set_deepspeed_micro_batch(accelerator, micro_batch: int) -> None:
    """A loop that passes no DataLoader through `prepare()` sets DeepSpeed's "auto" micro batch here."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None:
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = micro_batch


def make_optimizer(accelerator, model, lr: float, weight_decay: float = 0.0, betas=(0.9, 0.999), eps: float = 1e-8,
                   adamw: str = "fused", params=None):
    """AdamW for plain accelerate loops, running the implementation `hfscale plan` assumes (`adamw`, default
    fused: hfscale.scale.optim; name it with `hfscale.scale.optim.adamw_impl(optimizer)`). If the DeepSpeed
    config declares an optimizer (hfscale does for offload, so DeepSpeed's CPU Adam is used) this returns the
    `DummyOptim` accelerate needs, and DeepSpeed's optimizer runs (the plan models it as in place).
    `params`: parameter groups to use instead (LoRA+: hfscale.scale.adapters.adapter_param_groups)."""
    from .optim import build_adamw, check_adamw

    check_adamw(adamw)
    params = params if params is not None else [p for p in model.parameters() if p.requires_grad]
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None and "optimizer" in plugin.deepspeed_config:
        from accelerate.utils import DummyOptim  # exported only where DeepSpeed is installed (hfscale[deepspeed])

        return DummyOptim(params, lr=lr, weight_decay=weight_decay)
    return build_adamw(params, adamw, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)


def training_arguments_kwargs(spec: ScaleSpec) -> dict:
    """Keyword arguments for `transformers.TrainingArguments` that agree with the spec's DeepSpeed JSON
    (`scale.trainer.to_training_arguments`), plus what this host needs (use_cpu, gloo inside a launch).

    >>> TrainingArguments(output_dir="out", per_device_train_batch_size=4, **training_arguments_kwargs(spec))

    Inside a launch it also registers `end_process_group_at_exit` (Trainer destroys its process group only in an
    explicit `trainer.end()`); end the script with `hfscale.exit_rank(0)` to skip interpreter finalization
    altogether (the exit race, see exit_rank).
    """
    import os

    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1  # inside a launch (a plan written here is for elsewhere)
    if spec.engine == "fsdp2" and launched and (cpu_only_host() or spec.launch.use_cpu):
        from ..util.errors import ConfigError

        # Trainer builds its own Accelerator(cpu=True): MULTI_CPU, where accelerate never applies FSDP (the trap
        # make_accelerator works around); every rank would train the whole model
        raise ConfigError("HF Trainer does not apply FSDP2 on a CPU-only host (its Accelerator trains each rank unsharded); "
                          "train with recipes/train_clm.py or hfscale.make_accelerator in your own loop, or use a "
                          "DeepSpeed config with Trainer")
    if launched:
        end_process_group_at_exit()
    kw = to_training_arguments(spec)
    if cpu_only_host() or spec.launch.use_cpu:
        # Trainer on a CPU host: use_cpu so it accepts bf16 there, and gloo when launched distributed
        # (outside a launch, a ddp_backend makes TrainingArguments try to join a process group)
        kw["use_cpu"] = True
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            kw["ddp_backend"] = "gloo"
    return kw


def deepspeed_engine(accelerator):
    """The DeepSpeed engine accelerate prepared, or None."""
    wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
    return wrapped.engine if wrapped is not None else None
