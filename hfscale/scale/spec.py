"""What a scaled training job is: typed, validated dataclasses. Nothing here knows file formats.

`ScaleSpec` is the single source from which the DeepSpeed JSON (deepspeed.py), the accelerate YAML
(accelerate.py) and the TrainingArguments keywords (runtime.py) are all derived, so the three can
never disagree. Every check raises `ConfigError` with the fix in the message.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import Literal, Union

from .checkpointing import parse_checkpointing
from ..util.errors import ConfigError

Engine = Literal["ddp", "deepspeed", "fsdp2"]
Device = Literal["none", "cpu", "nvme"]
Precision = Literal["bf16", "fp16", "fp32"]
Auto = Literal["auto"]

ENGINES = ("ddp", "deepspeed", "fsdp2")
DEVICES = ("none", "cpu", "nvme")
ZERO_STAGES = (0, 1, 2, 3)
PRECISIONS = ("bf16", "fp16", "fp32")
RDZV_BACKENDS = ("static", "c10d")
# attention kernels DeepSpeed Ulysses SP runs (accelerate 1.16's DeepSpeedSequenceParallelConfig refuses eager
# and flex_attention: Ulysses drops the 4-D mask they need)
SP_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3")


def _positive_int(name: str, value, allow_auto: bool = False) -> None:
    if allow_auto and value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        hint = " or 'auto'" if allow_auto else ""
        raise ConfigError(f"{name} must be a positive integer{hint} (got {value!r})")


@dataclass(frozen=True)
class Aio:
    """DeepSpeed async-I/O settings for NVMe offload (the `aio` block)."""

    block_size: int = 1_048_576  # 1 MiB requests; DeepSpeed's default
    queue_depth: int = 8
    intra_op_parallelism: int = 1  # DeepSpeed >= 0.15 name (formerly thread_count)
    single_submit: bool = False
    overlap_events: bool = True

    def __post_init__(self):
        for f in ("block_size", "queue_depth", "intra_op_parallelism"):
            _positive_int(f"aio.{f}", getattr(self, f))


@dataclass(frozen=True)
class Zero:
    """ZeRO sharding and offload. Stage 0 is plain data parallelism inside DeepSpeed."""

    stage: int = 2
    offload_optimizer: Device = "none"
    offload_params: Device = "none"
    nvme_path: str | None = None
    aio: Aio = field(default_factory=Aio)
    # Without this a ZeRO-3 save writes each rank's shard only: the "610 KB model" (DeepSpeed #3841).
    gather_16bit_weights_on_model_save: bool = True
    overlap_comm: bool = True
    contiguous_gradients: bool = True

    def __post_init__(self):
        if self.stage not in ZERO_STAGES or isinstance(self.stage, bool):
            raise ConfigError(f"ZeRO stage must be 0, 1, 2 or 3 (got {self.stage!r})")
        for name in ("offload_optimizer", "offload_params"):
            if getattr(self, name) not in DEVICES:
                raise ConfigError(f"{name} must be one of {', '.join(DEVICES)} (got {getattr(self, name)!r})")
        if self.offload_params != "none" and self.stage != 3:
            raise ConfigError(
                f"parameter offload ({self.offload_params}) needs ZeRO stage 3 (got stage {self.stage}); "
                "use --zero 3 or drop --offload-params"
            )
        if self.offload_optimizer != "none" and self.stage == 0:
            raise ConfigError("optimizer offload needs ZeRO stage 1, 2 or 3 (got 0); use --zero 2 or drop --offload-optimizer")
        uses_nvme = "nvme" in (self.offload_optimizer, self.offload_params)
        if uses_nvme and not self.nvme_path:
            raise ConfigError("NVMe offload needs a directory; pass --nvme-path /local/nvme/dir")
        if self.nvme_path and not uses_nvme:
            raise ConfigError("--nvme-path is only used with NVMe offload; add --offload-optimizer nvme or drop it")

    @property
    def uses_nvme(self) -> bool:
        return "nvme" in (self.offload_optimizer, self.offload_params)


STATE_DICT_TYPES = ("SHARDED", "FULL")


@dataclass(frozen=True)
class Fsdp:
    """FSDP2 settings accelerate's FullyShardedDataParallelPlugin reads (fsdp_* keys of the YAML). Parameter
    offload is `Zero.offload_params: cpu` (one flag for both engines); checkpointing is the spec's own."""

    reshard_after_forward: bool = True  # free each unit's gathered parameters after its forward (ZeRO-3-like)
    state_dict_type: str = "SHARDED"  # save_state: SHARDED (torch.distributed.checkpoint, reshardable) | FULL (rank 0)
    transformer_layer_cls: str | None = None  # the class wrapped as one unit; None: the model's _no_split_modules

    def __post_init__(self):
        if not isinstance(self.reshard_after_forward, bool):
            raise ConfigError(f"fsdp.reshard_after_forward must be true or false (got {self.reshard_after_forward!r})")
        if self.state_dict_type not in STATE_DICT_TYPES:
            raise ConfigError(f"fsdp.state_dict_type must be one of {', '.join(STATE_DICT_TYPES)} (got "
                              f"{self.state_dict_type!r}); SHARDED resumes on another world size")
        cls = self.transformer_layer_cls
        if cls is not None and (not isinstance(cls, str) or not cls.isidentifier()):
            raise ConfigError(f"fsdp.transformer_layer_cls must be a class name such as Gemma3DecoderLayer (got {cls!r})")


@dataclass(frozen=True)
class Launch:
    """Where the processes run: accelerate's launcher fields."""

    num_processes: int = 1  # over all machines
    num_machines: int = 1
    machine_rank: int = 0
    main_process_ip: str | None = None
    main_process_port: int = 29500
    rdzv_backend: str = "static"
    same_network: bool = True
    use_cpu: bool = False  # force CPU processes even where a GPU is visible

    def __post_init__(self):
        _positive_int("num_processes", self.num_processes)
        _positive_int("num_machines", self.num_machines)
        if isinstance(self.machine_rank, bool) or not isinstance(self.machine_rank, int) or not (
            0 <= self.machine_rank < self.num_machines
        ):
            raise ConfigError(
                f"machine_rank must be in 0..{self.num_machines - 1} (got {self.machine_rank!r}); "
                "give each machine its own --machine-rank"
            )
        if self.num_processes % self.num_machines:
            raise ConfigError(
                f"num_processes {self.num_processes} does not divide over {self.num_machines} machines; "
                f"use a multiple of {self.num_machines} (processes are counted over all machines)"
            )
        if not isinstance(self.main_process_port, int) or not (1 <= self.main_process_port <= 65535):
            raise ConfigError(f"main_process_port must be 1..65535 (got {self.main_process_port!r})")
        if self.rdzv_backend not in RDZV_BACKENDS:
            raise ConfigError(f"rdzv_backend must be one of {', '.join(RDZV_BACKENDS)} (got {self.rdzv_backend!r})")
        if self.num_machines > 1 and not self.main_process_ip:
            raise ConfigError("a multi-machine launch needs --main-process-ip (the address of machine rank 0)")


@dataclass(frozen=True)
class Parallel:
    """Sequence (DeepSpeed Ulysses), tensor (transformers tp_plan / DTensor) and context (torch, FSDP2)
    parallel sizes: the non-data-parallel dimensions of accelerate's ParallelismConfig. The data-parallel
    size is what is left: num_processes / (sp x tp x cp)."""

    sp: int = 1
    tp: int = 1
    cp: int = 1
    sp_attention: str = "sdpa"  # the kernel Ulysses wraps; the model must be loaded with the same
    sp_seq_length: int | None = None  # None: sequence length may vary between batches

    def __post_init__(self):
        for name in ("sp", "tp", "cp"):
            _positive_int(f"parallel.{name}", getattr(self, name))
        if self.sp > 1 and self.cp > 1:
            raise ConfigError(f"sequence parallel (sp={self.sp}) and context parallel (cp={self.cp}) exclude each other "
                              "in accelerate; keep one: --cp 1 (DeepSpeed Ulysses) or --sp 1 (FSDP2 context parallel)")
        if self.sp_attention not in SP_ATTENTION:
            raise ConfigError(f"sp_attention must be one of {', '.join(SP_ATTENTION)} (got {self.sp_attention!r}); "
                              "Ulysses drops 4-D masks, so eager / flex_attention cannot run under it")
        if self.sp_seq_length is not None:
            _positive_int("parallel.sp_seq_length", self.sp_seq_length)
            if self.sp_seq_length % self.sp:
                raise ConfigError(f"sp_seq_length {self.sp_seq_length} is not divisible by sp {self.sp}; "
                                  f"use a multiple of {self.sp} (each rank holds sp_seq_length / sp tokens)")

    @property
    def size(self) -> int:
        """Processes one model replica spans (sp x tp x cp)."""
        return self.sp * self.tp * self.cp


@dataclass(frozen=True)
class ScaleSpec:
    """A scaled training setup. `name` is used for file names and the header comment."""

    name: str
    engine: Engine = "deepspeed"
    zero: Zero = field(default_factory=Zero)
    precision: Precision = "bf16"
    gradient_accumulation_steps: Union[int, Auto] = "auto"
    gradient_clipping: float = 1.0
    gradient_checkpointing: str = "off"  # off | full | every:K
    launch: Launch = field(default_factory=Launch)
    parallel: Parallel = field(default_factory=Parallel)
    fsdp: Fsdp = field(default_factory=Fsdp)

    def __post_init__(self):
        if not self.name or not all(c.isalnum() or c in "_-." for c in self.name):
            raise ConfigError(f"config name {self.name!r} must be non-empty letters, digits, '-', '_' or '.'")
        if self.engine not in ENGINES:
            raise ConfigError(f"engine must be one of {', '.join(ENGINES)} (got {self.engine!r})")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)} (got {self.precision!r}); bf16 and fp16 are exclusive")
        _positive_int("gradient_accumulation_steps", self.gradient_accumulation_steps, allow_auto=True)
        clip = self.gradient_clipping
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not math.isfinite(clip) or clip < 0:
            # NaN / inf would be written as NaN / Infinity: not JSON, and every update NaN
            raise ConfigError(f"gradient_clipping must be a finite number >= 0, 0 meaning off (got {clip!r})")
        parse_checkpointing(self.gradient_checkpointing)
        if self.engine != "fsdp2" and self.fsdp != Fsdp():
            raise ConfigError(f"fsdp settings apply to engine fsdp2 (got engine {self.engine}); use --engine fsdp2 or drop them")
        if self.engine != "deepspeed":
            z = self.zero
            if z.offload_optimizer != "none" or z.uses_nvme:
                raise ConfigError(
                    f"optimizer / NVMe offload needs engine deepspeed (got {self.engine}); use --engine deepspeed"
                )
            if self.engine == "ddp" and z.offload_params != "none":
                raise ConfigError("DDP keeps a full replica per rank and cannot offload; use --engine fsdp2 or deepspeed")
        self._check_parallel()

    def _check_parallel(self) -> None:
        """What accelerate 1.16 / DeepSpeed 0.19 accept for sp / tp / cp, refused here with the value to set."""
        p, n = self.parallel, self.launch.num_processes
        if p.size == 1:
            return
        if n % p.size:
            raise ConfigError(f"sp x tp x cp = {p.size} does not divide num_processes {n}: the sizes times the data-parallel "
                              f"size must equal the process count; use --num-processes {p.size * max(1, n // p.size)} "
                              f"(a multiple of {p.size})")
        if p.sp > 1:
            if self.engine != "deepspeed":
                raise ConfigError(f"sequence parallel (sp={p.sp}) is DeepSpeed Ulysses in accelerate; use --engine deepspeed "
                                  "--zero 3 (or --cp for FSDP2 context parallel)")
            if self.zero.stage < 2:
                raise ConfigError(f"sequence parallel needs ZeRO stage 2 or 3 (got {self.zero.stage}); use --zero 3")
        if p.cp > 1 and self.engine != "fsdp2":
            raise ConfigError(f"context parallel (cp={p.cp}) runs only under FSDP2 in accelerate (got engine {self.engine}); "
                              "use --engine fsdp2, or --sp for DeepSpeed Ulysses")
        if p.tp > 1:
            if self.engine == "deepspeed":
                raise ConfigError(f"tensor parallel (tp={p.tp}) is transformers' tp_plan under DDP or FSDP2 here; use "
                                  f"--engine fsdp2 (tp x FSDP) or --engine ddp --num-processes {p.tp}")
            if self.engine == "ddp" and n != p.tp:
                raise ConfigError(f"accelerate cannot compose DDP replicas with tensor parallel ({n} processes, tp={p.tp}); "
                                  f"use --num-processes {p.tp}, or --engine fsdp2 to shard the rest")
        if self.engine == "fsdp2" and n == p.tp:
            raise ConfigError(f"fsdp2 with tp = num_processes = {n} leaves FSDP nothing to shard (accelerate refuses it); "
                              f"use --engine ddp, or --num-processes {2 * p.tp}")

    @property
    def data_parallel(self) -> int:
        """Data-parallel ranks: num_processes / (sp x tp x cp)."""
        return self.launch.num_processes // self.parallel.size

    @property
    def uses_deepspeed(self) -> bool:
        return self.engine == "deepspeed"

    def with_launch(self, **kw) -> "ScaleSpec":
        return replace(self, launch=replace(self.launch, **kw))


def check_nvme_path(spec: ScaleSpec) -> None:
    """Checked where the config is written or run, not in __post_init__, so specs stay pure data."""
    path = spec.zero.nvme_path
    if not (spec.uses_deepspeed and spec.zero.uses_nvme and path):
        return
    # DeepSpeed creates the swap folder itself, so the path or its nearest existing parent must be
    # a writable directory.
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK):
        raise ConfigError(f"NVMe path {path} cannot be created or written here ({probe} is not a writable directory); pass another --nvme-path")
