"""Doctor's N-D parallelism checks (issue 18): the accelerate `parallelism_config:` block against the launch,
the engine, the DeepSpeed JSON, the attention kernel and the model (heads, TP plan, sliding windows).

What each check guards against, read from accelerate 1.16 / DeepSpeed 0.19.8:
  - the launcher copies every `parallelism_config_*` key onto its arguments without checking the name,
    so a misspelt key is silently dropped;
  - ParallelismConfig checks total_size == num_processes at Accelerator(), except for DeepSpeed SP, where
    the mismatch surfaces later as DeepSpeed's batch assertion (measured: 4 ranks, sp 2, no dp_shard_size:
    "train_batch_size ... 1 != 1 * 1 * 2");
  - SP runs only under DeepSpeed (accelerate raises "you need to configure sp_backend='deepspeed'" only
    inside the DeepSpeed path; under other engines sp_size is ignored) and refuses eager / flex_attention;
  - CP runs only under FSDP2 (`context_parallel` asserts it at run time).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Iterator

from .checks import MISSING, _acc, _args, _unknown, as_int, check, get, world_size, zero_stage
from .findings import Finding
from .inputs import Setup

PREFIX = "parallelism_config_"


@lru_cache(maxsize=1)
def _launcher_keys() -> frozenset:
    from accelerate.commands.launch import launch_command_parser

    return frozenset(a.dest for a in launch_command_parser()._actions if a.dest.startswith(PREFIX))


def _sizes(block: dict) -> dict:
    """The sizes as accelerate's launcher defaults them (1 when absent); None where a value is not an int."""
    return {k: (as_int(block.get(PREFIX + k, 1))) for k in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")}


def _parallel(s: Setup):
    """(hfscale Parallel, sizes) for the YAML's block, or None when absent / unusable."""
    block = get(s.accelerate or {}, "parallelism_config")
    if not isinstance(block, dict) or not block:
        return None
    sz = _sizes(block)
    if any(v is None or v < 1 for v in sz.values()):
        return None
    return block, sz


@check
def parallelism_keys(s: Setup) -> Iterator[Finding]:
    block = get(s.accelerate or {}, "parallelism_config")
    if isinstance(block, dict):
        yield from _unknown(block, _launcher_keys(), lambda k: _acc(s, f"parallelism_config.{k}"),
                            "accelerate's launcher (it drops unknown parallelism keys silently)")
        for k in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size"):
            v = block.get(PREFIX + k, 1)
            if as_int(v) is None or v < 1:
                yield Finding("parallel-size", "error", _acc(s, f"parallelism_config.{PREFIX}{k}"),
                              f"{k} is {v!r}, not a positive integer", f"set {PREFIX}{k}: 1 (or the size you mean)")


@check
def parallel_mesh(s: Setup) -> Iterator[Finding]:
    got = _parallel(s)
    world = world_size(s)
    if got is None:
        return
    block, sz = got
    sp, tp, cp = sz["sp_size"], sz["tp_size"], sz["cp_size"]
    product = sz["dp_replicate_size"] * sz["dp_shard_size"] * sp * tp * cp
    where = _acc(s, f"parallelism_config.{PREFIX}dp_shard_size")
    if sp > 1 and cp > 1:
        yield Finding("parallel-sp-cp", "error", _acc(s, f"parallelism_config.{PREFIX}cp_size"),
                      f"sp_size {sp} and cp_size {cp}: accelerate's ParallelismConfig refuses both",
                      f"set {PREFIX}cp_size: 1 (DeepSpeed Ulysses) or {PREFIX}sp_size: 1 (FSDP2 context parallel)")
    if world is not None and product != world:
        inner = sp * tp * cp * sz["dp_replicate_size"]
        if world % inner:
            fix = f"launch a multiple of {inner} processes (sp x tp x cp x dp_replicate), or change the sizes"
        else:
            fix = f"set {PREFIX}dp_shard_size: {world // inner}"
        why = (" (DeepSpeed SP skips accelerate's check and fails later in its batch assertion)" if sp > 1 else "")
        yield Finding("parallel-mesh", "error", where,
                      f"mesh dp_replicate x dp_shard x tp x cp x sp = {product} but {world} processes{why}", fix)


@check
def parallel_engine(s: Setup) -> Iterator[Finding]:
    got = _parallel(s)
    if got is None:
        return
    block, sz = got
    dtype = str(get(s.accelerate, "distributed_type"))
    if sz["sp_size"] > 1:
        if dtype != "DEEPSPEED":
            yield Finding("sp-engine", "error", _acc(s, "distributed_type"),
                          f"sp_size {sz['sp_size']} runs only under DeepSpeed (Ulysses); with {dtype} it is ignored",
                          "set distributed_type: DEEPSPEED with a ZeRO-3 JSON (hfscale config zero3 --sp N)")
        stage = zero_stage(s)
        if stage is not None and stage < 2:
            yield Finding("sp-zero", "error", f"{s.deepspeed_file}:zero_optimization.stage",
                          f"sequence parallel with ZeRO stage {stage}", "set zero_optimization.stage: 3 (or 2)")
        attn = block.get(PREFIX + "sp_attn_implementation", "sdpa")
        from ..scale.spec import SP_ATTENTION

        if attn not in SP_ATTENTION and not (isinstance(attn, str) and "/" in attn and "flash-attn" in attn):
            yield Finding("sp-attention", "error", _acc(s, f"parallelism_config.{PREFIX}sp_attn_implementation"),
                          f"{attn!r} cannot run under Ulysses (it drops the 4-D masks eager / flex_attention need)",
                          f"set {PREFIX}sp_attn_implementation: sdpa (or flash_attention_2 on GPUs)")
        model_attn = get(s.args or {}, "attn_implementation")
        if isinstance(model_attn, str) and model_attn != attn:
            yield Finding("sp-attention-mismatch", "error", _args(s, "attn_implementation"),
                          f"the model loads attn_implementation={model_attn!r} but Ulysses wraps {attn!r} (DeepSpeed "
                          "raises at prepare)", f"set attn_implementation: {attn}")
    if sz["cp_size"] > 1:
        fsdp2 = dtype == "FSDP" and get(s.accelerate, "fsdp_config.fsdp_version") == 2
        if not fsdp2:
            yield Finding("cp-engine", "error", _acc(s, "distributed_type"),
                          f"cp_size {sz['cp_size']} runs only under FSDP2 (got {dtype})",
                          "set distributed_type: FSDP with fsdp_config.fsdp_version: 2 (hfscale config fsdp2 --cp N)")
    if sz["tp_size"] > 1 and dtype == "DEEPSPEED":
        yield Finding("tp-engine", "error", _acc(s, f"parallelism_config.{PREFIX}tp_size"),
                      "accelerate's tp_size (transformers tp_plan) is not applied under DeepSpeed (DeepSpeed's AutoTP "
                      "reads tensor_parallel.autotp_size in the JSON)", "use distributed_type: FSDP (v2) or MULTI_GPU for tp_size")


@check
def parallel_model(s: Setup) -> Iterator[Finding]:
    """Heads, KV heads per layer kind, TP plan, sliding windows: hfscale.scale.parallel's checks as findings."""
    got = _parallel(s)
    if got is None or s.model_config is None:
        return
    block, sz = got
    from ..scale.parallel import model_problems
    from ..scale.spec import Parallel

    attn = block.get(PREFIX + "sp_attn_implementation", "sdpa")
    try:
        par = Parallel(sp=sz["sp_size"], tp=sz["tp_size"], cp=sz["cp_size"],
                       sp_attention=attn if isinstance(attn, str) and attn in ("sdpa", "flash_attention_2", "flash_attention_3") else "sdpa")
        seq = as_int(get(s.args or {}, "seq_len"))
        window = get(s.args or {}, "sp_window_sdpa") is True
        accum = [as_int(get(d or {}, "gradient_accumulation_steps")) for d in (s.deepspeed, s.args)]
        problems = model_problems(par, s.model_config, seq_len=seq, window_sdpa=window,
                                  grad_accum=max((a for a in accum if a), default=None))
    except Exception:  # noqa: BLE001 - a model config doctor cannot read is reported elsewhere, never a crash
        return
    keys = {"sp": "sp_size", "tp": "tp_size", "cp": "cp_size"}
    for p in problems:
        key = "sp_attn_implementation" if p.code == "sp-sliding-window" else keys[p.code.split("-")[0]]
        where = _args(s, "gradient_accumulation_steps") if p.code == "tp-accumulation" else _acc(s, f"parallelism_config.{PREFIX}{key}")
        yield Finding(p.code, p.severity, where, f"{s.model_name}: {p.what}", p.fix)


__all__ = ["parallelism_keys", "parallel_mesh", "parallel_engine", "parallel_model", "MISSING"]
