"""ScaleSpec -> accelerate config (the YAML `accelerate launch --config_file` reads). Pure functions.

Only keys that matter for the setup are written (no questionnaire dump). With DeepSpeed, the
ZeRO / precision / clipping / accumulation values live in the JSON alone: accelerate raises when
they are given in both places (accelerate #3152), so the YAML only points at the JSON.
"""

from __future__ import annotations

import yaml

from .checkpointing import parse_checkpointing
from .spec import ScaleSpec


def _distributed_type(spec: ScaleSpec) -> str:
    if spec.engine == "deepspeed":
        return "DEEPSPEED"
    if spec.engine == "fsdp2":
        return "FSDP"
    if spec.launch.num_processes == 1:
        return "NO"
    return "MULTI_CPU" if spec.launch.use_cpu else "MULTI_GPU"


def to_accelerate(spec: ScaleSpec, deepspeed_config_file: str | None = None) -> dict:
    """The accelerate config dict. `deepspeed_config_file` is the path written into the YAML."""
    L = spec.launch
    cfg: dict = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": _distributed_type(spec),
        "mixed_precision": {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}[spec.precision],
        "num_machines": L.num_machines,
        "num_processes": L.num_processes,
        "machine_rank": L.machine_rank,
        "rdzv_backend": L.rdzv_backend,
        "same_network": L.same_network,
        "use_cpu": L.use_cpu,
        "main_training_function": "main",
        "downcast_bf16": "no",
        "debug": False,
    }
    if L.num_machines > 1:
        cfg["main_process_ip"] = L.main_process_ip
        cfg["main_process_port"] = L.main_process_port
    if spec.engine == "deepspeed":
        # precision is stated in the JSON; accelerate refuses it in both places
        del cfg["mixed_precision"]
        if not deepspeed_config_file:
            raise ValueError("a DeepSpeed accelerate config needs the path of its DeepSpeed JSON")
        cfg["deepspeed_config"] = {
            "deepspeed_config_file": deepspeed_config_file,
            # ZeRO-3: build the model already partitioned (from_pretrained under zero.Init)
            "zero3_init_flag": spec.zero.stage == 3,
        }
        if L.num_machines > 1:
            cfg["deepspeed_config"]["deepspeed_multinode_launcher"] = "standard"
    elif spec.engine == "fsdp2":
        # accelerate's fsdp_activation_checkpointing (checkpoint_wrapper on every layer) fails on transformers 5's
        # decoder layers (hfscale.scale.checkpointing.with_launch): checkpointing is applied by the training code, full or
        # every:K (transformers' every_n_layers; a comment in the YAML says so)
        f = spec.fsdp
        cfg["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",  # one unit per decoder layer
            "fsdp_reshard_after_forward": f.reshard_after_forward,  # True: free gathered params after each unit's forward
            "fsdp_offload_params": spec.zero.offload_params == "cpu",
            "fsdp_cpu_ram_efficient_loading": True,
            # SHARDED: save_state writes torch.distributed.checkpoint shards (resume on any world size);
            # the recipes' consolidated model/ is gathered either way (get_state_dict)
            "fsdp_state_dict_type": f"{f.state_dict_type}_STATE_DICT",
            "fsdp_activation_checkpointing": False,
        }
        if f.transformer_layer_cls:
            cfg["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] = f.transformer_layer_cls
    block = parallelism_block(spec)
    if block:
        cfg["parallelism_config"] = block
    # accelerate's config file has no accumulation key (its loader refuses unknown keys): DeepSpeed's comes
    # from the JSON; for DDP / FSDP2 render_yaml states it in a comment and the training code passes it
    return cfg


def parallelism_block(spec: ScaleSpec) -> dict:
    """The `parallelism_config:` mapping accelerate 1.16's launcher reads (each key becomes a
    `--parallelism_config_*` argument, exported as PARALLELISM_CONFIG_* and read by ParallelismConfig()).
    Empty when sp = tp = cp = 1. Data parallel fills the rest of the processes:
      DeepSpeed SP:  dp_shard = N / sp (accelerate sizes train_batch_size by it; ZeRO shards over all N)
      FSDP2 TP / CP: dp_shard = N / (tp x cp) (FSDP shards over dp_shard x cp)
      DDP TP:        N = tp (accelerate does not compose DDP replicas with TP)"""
    p, n = spec.parallel, spec.launch.num_processes
    if p.size == 1:
        return {}
    k = "parallelism_config_"
    block: dict = {k + "dp_replicate_size": 1, k + "dp_shard_size": n // p.size}
    if p.tp > 1:
        block[k + "tp_size"] = p.tp
    if p.cp > 1:
        block[k + "cp_size"] = p.cp
        block[k + "cp_backend"] = "torch"
        block[k + "cp_comm_strategy"] = "allgather"
    if p.sp > 1:
        block[k + "sp_size"] = p.sp
        block[k + "sp_backend"] = "deepspeed"
        block[k + "sp_seq_length_is_variable"] = p.sp_seq_length is None
        if p.sp_seq_length is not None:
            block[k + "sp_seq_length"] = p.sp_seq_length
        block[k + "sp_attn_implementation"] = p.sp_attention
    return block


def launch_command(spec: ScaleSpec, yaml_path: str, script: str = "-m hfscale.proofs.engine") -> str:
    cmd = f"accelerate launch --config_file {yaml_path}"
    if spec.launch.num_machines > 1:
        cmd += " --machine_rank $MACHINE_RANK --main_process_ip $MAIN_ADDR"
    return f"{cmd} {script}"


def render_yaml(spec: ScaleSpec, yaml_path: str, deepspeed_config_file: str | None = None) -> str:
    """The YAML text, opening with comments that show how it is launched."""
    header = [
        f"# hfscale config '{spec.name}' — generated by: hfscale config {spec.name} (do not edit by hand; regenerate)",
        f"# Launch: {launch_command(spec, yaml_path, 'your_training_script.py')}",
        f"# Prove it on this host first: hfscale prove --config {yaml_path} --num-processes 2"
        + (f" --num-machines {spec.launch.num_machines}" if spec.launch.num_machines > 1 else ""),
    ]
    if spec.engine != "deepspeed" and spec.gradient_accumulation_steps != "auto":
        n = spec.gradient_accumulation_steps
        header.append(f"# Gradient accumulation {n}: accelerate's config file has no key for it; pass Accelerator("
                      f"gradient_accumulation_steps={n}) / TrainingArguments(gradient_accumulation_steps={n}), or export "
                      f"ACCELERATE_GRADIENT_ACCUMULATION_STEPS={n}")
    mode, k = parse_checkpointing(spec.gradient_checkpointing)
    if spec.engine == "fsdp2" and mode != "off":
        header.append(f"# Checkpointing {spec.gradient_checkpointing}: applied by the training code, not by accelerate's "
                      f"fsdp_activation_checkpointing (its checkpoint_wrapper fails on transformers' decoder layers): "
                      f"model.activation_checkpointing_enable({{\"use_reentrant\": False}}, every_n_layers={k}) before "
                      f"accelerator.prepare (hfscale's recipes: --checkpointing {spec.gradient_checkpointing})")
    p = spec.parallel
    if p.sp > 1:
        header.append(f"# Sequence parallel {p.sp} (DeepSpeed Ulysses): load the model with attn_implementation="
                      f"\"{p.sp_attention}\"; every batch needs position_ids; each rank holds 1/{p.sp} of each sequence. "
                      "Check the model: hfscale doctor --accelerate THIS.yaml --model MODEL")
    if p.tp > 1:
        header.append(f"# Tensor parallel {p.tp}: load the model with from_pretrained(..., distributed_config="
                      f"DistributedConfig(tp_plan=\"auto\", tp_size={p.tp})) before accelerator.prepare")
    if spec.launch.num_machines > 1:
        header.append("# Run the same command on every machine; MACHINE_RANK is 0..num_machines-1, MAIN_ADDR is rank 0's address.")
    body = yaml.safe_dump(to_accelerate(spec, deepspeed_config_file), sort_keys=False)
    return "\n".join(header) + "\n" + body
