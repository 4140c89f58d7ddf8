"""The pre-flight checks. Each takes the read Setup and yields Findings; none may raise on odd input
(the fuzz test feeds them mutated configs), so every value is type-checked before use."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from typing import Callable, Iterable, Iterator

from .findings import Finding
from ..scale.deepspeed import ds_precision
from .inputs import Setup

MISSING = object()
CHECKS: list[Callable[[Setup], Iterable[Finding]]] = []


def check(fn):
    CHECKS.append(fn)
    return fn


# --- helpers --------------------------------------------------------------------------------------


def get(d, dotted: str):
    cur = d
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return MISSING
        cur = cur[part]
    return cur


def as_int(v):
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def as_bool(v):
    return v if isinstance(v, bool) else None


def _ds(s: Setup, key: str) -> str:
    return f"{s.deepspeed_file}:{key}"


def _acc(s: Setup, key: str) -> str:
    return f"{s.accelerate_file}:{key}"


def _args(s: Setup, key: str) -> str:
    return f"{s.args_file}:{key}"


def zero_stage(s: Setup) -> int | None:
    return as_int(get(s.deepspeed, "zero_optimization.stage")) if s.deepspeed else None


def world_size(s: Setup) -> int | None:
    if s.num_processes is not None:
        return s.num_processes
    return as_int(get(s.accelerate, "num_processes")) if s.accelerate else None


def _walk(d, prefix=""):
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _walk(v, f"{prefix}{k}." if isinstance(k, str) else f"{prefix}{k!r}.")
    else:
        yield prefix[:-1], d


NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")
# string-valued keys whose values may legitimately look like numbers
STRING_KEYS = {"main_process_ip", "nvme_path", "gpu_ids", "output_dir", "run_name", "deepspeed_config_file"}


# --- 1. values of the wrong type ------------------------------------------------------------------


@check
def string_numbers(s: Setup) -> Iterator[Finding]:
    """"8" is not 8: the engines compare them as unequal (LLaMA-Factory #1116), YAML reads 3e-4 as a string."""
    for label, data, fmt in ((s.deepspeed_file, s.deepspeed, "json"), (s.accelerate_file, s.accelerate, "yaml"), (s.args_file, s.args, "yaml")):
        if not isinstance(data, dict):
            continue
        for key, v in _walk(data):
            if not isinstance(v, str) or key.split(".")[-1] in STRING_KEYS:
                continue
            t = v.strip()
            if NUMBER.match(t):
                num = float(t)
                shown = int(num) if num.is_integer() and "." not in t and "e" not in t.lower() else num
                if fmt == "yaml" and "e" in t.lower():
                    shown = f"{num} (YAML 1.1 reads {t!r} as a string: write {num:.1e} with a dot, e.g. 3.0e-4)"
                yield Finding("string-number", "error", f"{label}:{key}", f"value is the string {v!r}, not a number",
                              f"set {key}: {shown}")
            elif t.lower() in ("true", "false"):
                yield Finding("string-bool", "error", f"{label}:{key}", f"value is the string {v!r}, not a boolean",
                              f"set {key}: {t.lower()} (no quotes)")


@check
def non_finite_numbers(s: Setup) -> Iterator[Finding]:
    """NaN / Infinity: Python's json (DeepSpeed's reader) accepts them, JSON does not, and a NaN clipping
    norm or learning rate silently turns every update into NaN."""
    for label, data in ((s.deepspeed_file, s.deepspeed), (s.accelerate_file, s.accelerate), (s.args_file, s.args)):
        if not isinstance(data, dict):
            continue
        for key, v in _walk(data):
            if isinstance(v, float) and not math.isfinite(v):
                yield Finding("non-finite-number", "error", f"{label}:{key}", f"value is {v} (not a finite number; "
                              "not valid JSON either)", f"set {key} to a finite number")


# --- 2. batch arithmetic --------------------------------------------------------------------------


@check
def batch_arithmetic(s: Setup) -> Iterator[Finding]:
    ds, args = s.deepspeed or {}, s.args or {}
    world = world_size(s)
    ga_sources = []
    for where, v in ((_ds(s, "gradient_accumulation_steps"), get(ds, "gradient_accumulation_steps")),
                     (_args(s, "gradient_accumulation_steps"), get(args, "gradient_accumulation_steps")),
                     (_acc(s, "gradient_accumulation_steps"), get(s.accelerate or {}, "gradient_accumulation_steps"))):
        if as_int(v) is not None:
            ga_sources.append((where, v))
    if len({v for _, v in ga_sources}) > 1:
        listed = ", ".join(f"{w}={v}" for w, v in ga_sources)
        yield Finding("accumulation-conflict", "error", ga_sources[0][0], f"gradient accumulation set differently: {listed}",
                      f"use one value everywhere, or set {ga_sources[0][0].split(':')[-1]}: \"auto\" in the DeepSpeed JSON")
    micro, tb = as_int(get(ds, "train_micro_batch_size_per_gpu")), as_int(get(ds, "train_batch_size"))
    args_micro = as_int(get(args, "per_device_train_batch_size"))
    if micro is not None and args_micro is not None and micro != args_micro:
        yield Finding("micro-batch-conflict", "error", _ds(s, "train_micro_batch_size_per_gpu"),
                      f"micro batch {micro} in the DeepSpeed JSON but per_device_train_batch_size={args_micro}",
                      f"set train_micro_batch_size_per_gpu: {args_micro} (or \"auto\")")
    micro = micro if micro is not None else args_micro
    ga = ga_sources[0][1] if ga_sources else (1 if get(ds, "gradient_accumulation_steps") is MISSING and s.deepspeed else None)
    if tb is not None and micro is not None and ga is not None and world is not None:
        if tb != micro * ga * world:
            yield Finding("batch-arithmetic", "error", _ds(s, "train_batch_size"),
                          f"train_batch_size {tb} != micro {micro} x accumulation {ga} x world {world} = {micro * ga * world}",
                          f"set train_batch_size: {micro * ga * world} (or \"auto\")")
    for where, v in ((_ds(s, "train_batch_size"), get(ds, "train_batch_size")),
                     (_ds(s, "train_micro_batch_size_per_gpu"), get(ds, "train_micro_batch_size_per_gpu")),
                     (_args(s, "per_device_train_batch_size"), get(args, "per_device_train_batch_size")),
                     (_args(s, "gradient_accumulation_steps"), get(args, "gradient_accumulation_steps"))):
        if as_int(v) is not None and v < 1:
            yield Finding("non-positive", "error", where, f"value {v} must be at least 1", f"set {where.split(':')[-1]} to a positive integer")


# --- 3. precision ---------------------------------------------------------------------------------


@check
def precision(s: Setup) -> Iterator[Finding]:
    ds, args, acc = s.deepspeed, s.args, s.accelerate
    if ds is not None and get(ds, "bf16.enabled") is True and get(ds, "fp16.enabled") is True:
        yield Finding("bf16-and-fp16", "error", _ds(s, "fp16.enabled"), "bf16 and fp16 are both enabled",
                      "set fp16.enabled: false (bf16 is the safe choice for Gemma and most LLMs)")
    if args is not None and get(args, "bf16") is True and get(args, "fp16") is True:
        yield Finding("bf16-and-fp16", "error", _args(s, "fp16"), "bf16 and fp16 are both true", "set fp16: false")
    found: list[tuple[str, str]] = []
    if ds is not None and (p := ds_precision(ds)):
        found.append((_ds(s, "bf16.enabled"), p))
    if args is not None:
        a_bf, a_fp = get(args, "bf16"), get(args, "fp16")
        if a_bf is True or a_fp is True:
            found.append((_args(s, "bf16" if a_bf is True else "fp16"), "bf16" if a_bf is True else "fp16"))
        elif ds is not None and (a_bf is False or a_fp is False) and ds_precision(ds) in ("bf16", "fp16"):
            found.append((_args(s, "bf16"), "fp32"))
    if acc is not None:
        mp = get(acc, "mixed_precision")
        if isinstance(mp, str) and mp in ("bf16", "fp16", "no"):
            if ds is not None and (get(acc, "deepspeed_config.deepspeed_config_file") not in (MISSING, None, "none")):
                yield Finding("precision-in-yaml-and-json", "error", _acc(s, "mixed_precision"),
                              "accelerate refuses mixed_precision in the YAML when a deepspeed_config_file is given",
                              "delete mixed_precision from the YAML; the JSON's bf16/fp16 blocks decide")
            found.append((_acc(s, "mixed_precision"), {"no": "fp32"}.get(mp, mp)))
    if len({p for _, p in found}) > 1:
        listed = ", ".join(f"{w}={p}" for w, p in found)
        yield Finding("precision-conflict", "error", found[1][0], f"precision disagrees: {listed} (\"BFloat16 != Half\")",
                      f"use {found[0][1]} everywhere")
    host = s.host_bf16
    if s.cpu_launch and host is not None and not host.native and any(p == "bf16" for _, p in found):
        from ..util.hosts import EMULATED_BF16_SLOWDOWN

        yield Finding("bf16-emulated-cpu", "warning", next(w for w, p in found if p == "bf16"),
                      f"bf16 on a CPU launch, and this CPU emulates bf16 ({host.detail}): measured "
                      f"{EMULATED_BF16_SLOWDOWN}x slower than fp32 on such a host",
                      "train in fp32 here (bf16.enabled: false / hfscale config NAME --precision fp32); "
                      "keep bf16 for GPUs and CPUs with AVX512-BF16 / AMX")
    model_type = getattr(s.model_config, "model_type", "") or ""
    if model_type.startswith("gemma") and any(p == "fp16" for _, p in found):
        where = next(w for w, p in found if p == "fp16")
        yield Finding("fp16-gemma", "error", where, f"fp16 on {model_type}: Gemma activations overflow fp16's 65504 range",
                      "train Gemma in bf16 (bf16.enabled: true / bf16: true)")


# --- 4. keys given in both the YAML and the JSON --------------------------------------------------

YAML_DS_KEYS = {  # accelerate YAML deepspeed_config key -> DeepSpeed JSON key
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
    "zero_stage": "zero_optimization.stage",
    "offload_optimizer_device": "zero_optimization.offload_optimizer.device",
    "offload_param_device": "zero_optimization.offload_param.device",
    "offload_optimizer_nvme_path": "zero_optimization.offload_optimizer.nvme_path",
    "offload_param_nvme_path": "zero_optimization.offload_param.nvme_path",
    "zero3_save_16bit_model": "zero_optimization.stage3_gather_16bit_weights_on_model_save",
}


@check
def duplicated_keys(s: Setup) -> Iterator[Finding]:
    block = get(s.accelerate, "deepspeed_config") if s.accelerate else MISSING
    if not isinstance(block, dict) or block.get("deepspeed_config_file") in (None, "none", MISSING):
        return
    for k, ds_key in YAML_DS_KEYS.items():
        if k in block:
            yield Finding("key-in-yaml-and-json", "error", _acc(s, f"deepspeed_config.{k}"),
                          f"{k} is set in the YAML while deepspeed_config_file is used: accelerate raises at start",
                          f"delete it from the YAML and set {ds_key} in the DeepSpeed JSON")


# --- 5. offload -----------------------------------------------------------------------------------

OFFLOADABLE = {"adam", "adamw", "adagrad", "lion", "cpuadam", "deepspeedcpuadam"}
ARGS_OFFLOADABLE_PREFIXES = ("adamw_torch", "adamw_hf", "adamw", "adam", "adagrad", "lion")


@check
def offload(s: Setup) -> Iterator[Finding]:
    ds = s.deepspeed
    if not isinstance(ds, dict):
        return
    stage = zero_stage(s)
    p_dev, o_dev = get(ds, "zero_optimization.offload_param.device"), get(ds, "zero_optimization.offload_optimizer.device")
    if isinstance(p_dev, str) and p_dev not in ("none",) and stage is not None and stage < 3:
        yield Finding("param-offload-below-3", "error", _ds(s, "zero_optimization.offload_param.device"),
                      f"parameter offload needs ZeRO stage 3 (stage is {stage})", "set zero_optimization.stage: 3 or offload_param.device: none")
    for block, dev in (("offload_param", p_dev), ("offload_optimizer", o_dev)):
        if dev != "nvme":
            continue
        key = f"zero_optimization.{block}.nvme_path"
        path = get(ds, key)
        if not isinstance(path, str) or not path:
            yield Finding("nvme-no-path", "error", _ds(s, key), "NVMe offload without nvme_path", f"set {key} to a local NVMe directory")
        elif not os.path.exists(path):
            # often doctor runs on a login node: a warning here, an error where it exists but is unusable
            yield Finding("nvme-path-missing", "warning", _ds(s, key), f"{path} does not exist on this host",
                          f"on the training nodes create it on local NVMe (mkdir -p {path}) or change {key}")
        elif not (os.path.isdir(path) and os.access(path, os.W_OK)):
            yield Finding("nvme-path-unwritable", "error", _ds(s, key), f"{path} is not a writable directory",
                          f"point {key} at a writable directory on local NVMe")
    if isinstance(o_dev, str) and o_dev in ("cpu", "nvme"):
        opt_type = get(ds, "optimizer.type")
        if isinstance(opt_type, str):
            if opt_type.lower().replace("_", "") not in OFFLOADABLE:
                yield Finding("optimizer-not-offloadable", "error", _ds(s, "optimizer.type"),
                              f"DeepSpeed cannot offload optimizer {opt_type!r} (CPU kernels: Adam, AdamW, Adagrad, Lion)",
                              "set optimizer.type: AdamW")
        else:
            optim = get(s.args or {}, "optim")
            if isinstance(optim, str) and not optim.lower().startswith(ARGS_OFFLOADABLE_PREFIXES):
                yield Finding("optimizer-not-offloadable", "error", _args(s, "optim"),
                              f"optimizer offload with optim={optim!r}: DeepSpeed's CPU offload runs Adam/AdamW/Adagrad/Lion only",
                              "set optim: adamw_torch, or declare optimizer AdamW in the DeepSpeed JSON")
            if get(ds, "zero_force_ds_cpu_optimizer") is not False:
                yield Finding("offload-client-optimizer", "warning", _ds(s, "optimizer"),
                              "optimizer offload without an optimizer block: DeepSpeed rejects a client optimizer unless it is its CPU Adam",
                              'add "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}')


# --- 6. ZeRO-3 save -------------------------------------------------------------------------------


@check
def zero3_save(s: Setup) -> Iterator[Finding]:
    if zero_stage(s) != 3:
        return
    key = "zero_optimization.stage3_gather_16bit_weights_on_model_save"
    v = get(s.deepspeed, key)
    if v is MISSING:
        v = get(s.deepspeed, "zero_optimization.stage3_gather_fp16_weights_on_model_save")
    if v is not True:
        why = "plain accelerate fills \"auto\" with false" if v == "auto" else f"it is {v if v is not MISSING else 'unset'}"
        yield Finding("zero3-tiny-checkpoint", "error", _ds(s, key),
                      f"ZeRO-3 without 16-bit gathering on save writes each rank's shard only, a model of a few hundred KB ({why})",
                      f"set {key}: true")


# --- 7. quantized base under ZeRO-3; checkpointing with frozen parameters -------------------------


def _quantized_4bit(s: Setup) -> bool:
    from .adapters import adapter_view  # the recipe's `adapter: {kind: qlora}` too

    a = s.args or {}
    qc = getattr(s.model_config, "quantization_config", None)
    v = adapter_view(s)
    return (get(a, "load_in_4bit") is True or isinstance(get(a, "quantization_config"), dict) or isinstance(qc, dict)
            or (v is not None and v.kind == "qlora"))


def _uses_adapters(s: Setup) -> bool:
    from .adapters import adapter_view

    return adapter_view(s) is not None


@check
def quantized_zero3(s: Setup) -> Iterator[Finding]:
    if zero_stage(s) != 3:
        return
    a = s.args or {}
    # the recipe's own `adapter: qlora` under ZeRO-3 loads its base with the storage it needs (scale.adapters.qlora_dtypes)
    if _quantized_4bit(s) and not isinstance(a.get("adapter") if isinstance(a, dict) else None, (dict, str)):
        storage = get(a, "bnb_4bit_quant_storage")
        if storage is MISSING:
            storage = get(a, "quantization_config.bnb_4bit_quant_storage")
        from ..scale.adapters import nf4_storage  # the one storage rule (the recipe's and plan --write's)

        dtype = nf4_storage("bf16" if get(a, "bf16") is True or ds_precision(s.deepspeed) == "bf16" else "fp16", 3, False)
        if storage not in (dtype, "bf16" if dtype == "bfloat16" else "fp16"):
            yield Finding("qlora-zero3-storage", "error", _args(s, "bnb_4bit_quant_storage"),
                          f"a 4-bit base under ZeRO-3 needs its storage dtype to equal the model dtype (got {storage if storage is not MISSING else 'unset'})",
                          f"set bnb_4bit_quant_storage: {dtype}")
        init = get(s.accelerate or {}, "deepspeed_config.zero3_init_flag")
        if s.accelerate is not None and init is not True:
            yield Finding("qlora-zero3-init", "error", _acc(s, "deepspeed_config.zero3_init_flag"),
                          "a quantized base under ZeRO-3 must be loaded partitioned", "set deepspeed_config.zero3_init_flag: true")
    gc = get(a, "gradient_checkpointing")
    if gc is True and _uses_adapters(s):
        reentrant = get(a, "gradient_checkpointing_kwargs.use_reentrant")
        if reentrant is not False:
            sev = "error" if reentrant is True else "warning"
            yield Finding("zero3-checkpointing-reentrant", sev, _args(s, "gradient_checkpointing_kwargs.use_reentrant"),
                          "ZeRO-3 + gradient checkpointing + frozen parameters with reentrant checkpointing fails "
                          "(CheckpointError: recomputed shape [0])", "set gradient_checkpointing_kwargs: {use_reentrant: false}")


# --- 8. QAT combinations --------------------------------------------------------------------------


@check
def qat_combinations(s: Setup) -> Iterator[Finding]:
    a = s.args or {}
    qat = get(a, "qat")
    if qat in (MISSING, None, False):
        return
    if get(a, "load_in_4bit") is True or get(a, "load_in_8bit") is True or isinstance(get(a, "quantization_config"), dict):
        yield Finding("qat-on-quantized-base", "error", _args(s, "qat"),
                      "QAT fake-quantizes full-precision weights; a bitsandbytes-quantized base has none to train",
                      "load the base in bf16 (drop load_in_4bit/8bit) or use QAT + LoRA on a bf16 base")
    if get(a, "fp16") is True or ds_precision(s.deepspeed) == "fp16":
        yield Finding("qat-fp16", "warning", _args(s, "fp16"), "QAT scales and fake-quantized activations in fp16 can overflow",
                      "use bf16 for QAT")


@check
def padding_free(s: Setup) -> Iterator[Finding]:
    """TRL's SFTConfig(padding_free=True) or a recipe's `padding_free: true`: each batch flattened into one row
    (hfscale.data.dataset), which only a varlen kernel keeps apart without a mask over the whole batch."""
    a = s.args or {}
    if get(a, "padding_free") is not True:
        return
    from ..data.dataset import keeps_documents_apart

    attn = get(a, "attn_implementation")
    attn = get(a, "attention") if attn in (MISSING, None) else attn
    if keeps_documents_apart(attn):
        return
    kernel = f"attention {attn!r}" if isinstance(attn, str) else "the model's default attention"
    yield Finding("padding-free-attention", "error", _args(s, "padding_free"),
                  f"padding_free flattens each batch into one row; under {kernel} that row gets a mask over the whole "
                  "batch, (B x L)^2, and with a cache on in train mode its documents attend to each other",
                  "set attn_implementation: flash_attention_2 (GPUs) or hfscale's varlen (a recipe's attention: varlen; "
                  "hfscale.models.varlen.use_varlen_(model)), or drop padding_free")


# --- 9. unknown keys ------------------------------------------------------------------------------

DS_TOP = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
    "optimizer", "scheduler", "fp16", "bf16", "bfloat16", "amp", "zero_optimization", "aio", "activation_checkpointing",
    "flops_profiler", "steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer", "communication_data_type", "prescale_gradients", "gradient_predivide_factor",
    "sparse_gradients", "dump_state", "memory_breakdown", "tensorboard", "wandb", "csv_monitor", "comet", "elasticity",
    "checkpoint", "data_types", "compression_training", "data_efficiency", "curriculum_learning", "autotuning",
    "pipeline", "tensor_parallel", "seq_parallel_communication_data_type", "dataloader_drop_last", "torch_autocast",
    "compile", "nebula", "sparse_attention", "weight_quantization", "hybrid_engine", "comms_logger",
    "use_node_local_storage", "load_universal_checkpoint", "disable_allgather", "timers", "gradient_allreduce_op",
    "zero_quantized_weights", "graph_harvesting", "eigenvalue", "progressive_layer_drop", "quantize_training",
    "expert_parallel", "mics_shard_size", "mics_hierarchical_params_gather",
}
ACC_DS_KEYS = {"deepspeed_config_file", "zero3_init_flag", "deepspeed_hostfile", "deepspeed_exclusion_filter",
               "deepspeed_inclusion_filter", "deepspeed_multinode_launcher", "deepspeed_moe_layer_cls_names", *YAML_DS_KEYS}
# hfscale recipe keys accepted beside TrainingArguments fields
RECIPE_KEYS = {"model", "model_name_or_path", "data", "dataset", "validation", "seq_len", "global_batch_tokens",
               "qat", "use_peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "load_in_4bit",
               "load_in_8bit", "bnb_4bit_quant_storage", "bnb_4bit_quant_type", "quantization_config",
               "adapter", "use_dora", "use_rslora", "lora_modules_to_save", "modules_to_save", "target_modules",
               "bnb_4bit_use_double_quant", "use_bnb_nested_quant", "merge_adapter",  # TRL ModelConfig / peft names
               "checkpointing", "resume", "keep_last", "eval_every", "save_every", "attn_implementation", "sp_window_sdpa",
               "torch_dtype", "dtype",  # the dtype the model is loaded in (from_pretrained)
               "padding_free", "attention"}  # TRL SFTConfig's / a recipe's padding-free batches and attention kernel
# The TrainingArguments fields a recipe passes doctor (train.loop.run_doctor): known without importing transformers'
# training_args, which imports peft and bitsandbytes (~3.7 s of each rank's start; tests/test_doctor.py checks they are
# TrainingArguments fields)
RECIPE_ARGS = frozenset({"per_device_train_batch_size", "gradient_accumulation_steps", "bf16", "fp16",
                         "gradient_checkpointing", "gradient_checkpointing_kwargs"})


# spelling suggestions cost ~0.3 ms per key (difflib against every known key): given for this many
# unknown keys of a mapping, in key order (the order doctor lists them in), so a huge file stays linear
# and fast; `hfscale doctor` shows 50 findings by default
SUGGEST_LIMIT = 100


def _unknown(keys, known, where_fn, label) -> Iterator[Finding]:
    candidates = sorted(known)
    for i, k in enumerate(sorted((k for k in keys if k not in known), key=str)):
        close = difflib.get_close_matches(str(k), candidates, n=1, cutoff=0.75) if i < SUGGEST_LIMIT else []
        if close:
            fix = f"did you mean {close[0]!r}?"
        elif i < SUGGEST_LIMIT:
            fix = f"remove it ({label} does not read it)"
        else:
            fix = f"remove it ({label} does not read it; no spelling suggestions past {SUGGEST_LIMIT} unknown keys)"
        yield Finding("unknown-key", "error", where_fn(k), f"unknown key {k!r}", fix)


def _zero_known() -> set[str]:
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    f = DeepSpeedZeroConfig.model_fields
    return set(f) | {v.alias for v in f.values() if v.alias}


def _offload_known(block: str) -> set[str]:
    from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig, DeepSpeedZeroOffloadParamConfig

    model = DeepSpeedZeroOffloadOptimizerConfig if block == "offload_optimizer" else DeepSpeedZeroOffloadParamConfig
    return set(model.model_fields)


@check
def unknown_keys(s: Setup) -> Iterator[Finding]:
    ds = s.deepspeed
    if isinstance(ds, dict):
        yield from _unknown(ds, DS_TOP, lambda k: _ds(s, k), "DeepSpeed")
        z = ds.get("zero_optimization")
        from ..util.extras import installed, line

        if isinstance(z, dict) and not installed("deepspeed"):  # its pydantic schema is the reference for ZeRO keys
            yield Finding("unknown-key", "warning", _ds(s, "zero_optimization"), "ZeRO keys not checked for typos",
                          line("checking them against DeepSpeed's schema", "deepspeed"))
        elif isinstance(z, dict):
            yield from _unknown(z, _zero_known(), lambda k: _ds(s, f"zero_optimization.{k}"), "DeepSpeed ZeRO")
            for block in ("offload_optimizer", "offload_param"):
                if isinstance(z.get(block), dict):
                    yield from _unknown(z[block], _offload_known(block), lambda k, b=block: _ds(s, f"zero_optimization.{b}.{k}"), "DeepSpeed")
    acc = s.accelerate
    if isinstance(acc, dict):
        from accelerate.commands.config.config_args import ClusterConfig

        yield from _unknown(acc, {f.name for f in dataclasses.fields(ClusterConfig)}, lambda k: _acc(s, k), "accelerate")
        if isinstance(acc.get("deepspeed_config"), dict):
            yield from _unknown(acc["deepspeed_config"], ACC_DS_KEYS, lambda k: _acc(s, f"deepspeed_config.{k}"), "accelerate")
    if isinstance(s.args, dict) and set(s.args) - RECIPE_KEYS - RECIPE_ARGS:
        from transformers import TrainingArguments

        known = {f.name for f in dataclasses.fields(TrainingArguments)} | RECIPE_KEYS
        yield from _unknown(s.args, known, lambda k: _args(s, k), "TrainingArguments")


# --- 10. launch shape -----------------------------------------------------------------------------


@check
def launch_shape(s: Setup) -> Iterator[Finding]:
    acc = s.accelerate or {}
    procs = s.num_processes if s.num_processes is not None else as_int(get(acc, "num_processes"))
    machines = s.num_machines if s.num_machines is not None else as_int(get(acc, "num_machines"))
    src = "command line:--num-processes" if s.num_processes is not None else _acc(s, "num_processes")
    if procs is not None and procs < 1:
        yield Finding("launch-shape", "error", src, f"{procs} processes", "launch at least 1 process")
        return
    if machines is not None and machines < 1:
        yield Finding("launch-shape", "error", _acc(s, "num_machines"), f"{machines} machines", "use at least 1 machine")
        return
    if procs and machines and procs % machines:
        yield Finding("launch-shape", "error", src, f"{procs} processes do not divide over {machines} machines",
                      f"use a multiple of {machines} (num_processes counts all machines)")
    if procs and machines and s.gpus_per_machine and procs // machines > s.gpus_per_machine:
        yield Finding("launch-shape", "error", src,
                      f"{procs // machines} processes per machine but {s.gpus_per_machine} GPUs per machine",
                      f"set num_processes: {machines * s.gpus_per_machine} (or add machines)")
    rank = as_int(get(acc, "machine_rank"))
    if rank is not None and machines and not (0 <= rank < machines):
        yield Finding("launch-shape", "error", _acc(s, "machine_rank"), f"machine_rank {rank} with {machines} machines",
                      f"use 0..{machines - 1}")
    if machines and machines > 1 and not isinstance(get(acc, "main_process_ip"), str) and s.accelerate is not None:
        yield Finding("launch-shape", "error", _acc(s, "main_process_ip"), "multi-machine launch without main_process_ip",
                      "set main_process_ip to machine rank 0's address (or pass --main_process_ip)")


@check
def missing_files(s: Setup) -> Iterator[Finding]:
    for kind, ref in s.notes:
        if kind == "missing-deepspeed-file":
            yield Finding("missing-file", "error", _acc(s, "deepspeed_config.deepspeed_config_file"),
                          f"DeepSpeed config {ref} not found (relative paths resolve against the launch directory)",
                          "launch from the directory it is relative to, or make the path absolute")
