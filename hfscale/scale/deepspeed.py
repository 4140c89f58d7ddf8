"""ScaleSpec -> DeepSpeed JSON. A pure function: returns a new dict, reads nothing else.

"auto" is used only where both HF Trainer and a plain accelerate loop fill the same value:
  train_batch_size, train_micro_batch_size_per_gpu  <- the dataloader batch size x accumulation x world
  gradient_accumulation_steps (when the spec says auto) <- TrainingArguments / Accelerator(...)
  reduce_bucket_size = h², stage3_prefetch_bucket_size = 0.9·h², stage3_param_persistence_threshold = 10·h
  optimizer lr, weight_decay                          <- TrainingArguments / DummyOptim
Values that plain accelerate would silently fill with a *different* default are always explicit:
gradient_clipping ("auto" -> 1.0 there) and stage3_gather_16bit_weights_on_model_save ("auto" -> false
there, the tiny-checkpoint failure). Precision is explicit so a mismatch with TrainingArguments raises.
"""

from __future__ import annotations

from .spec import ScaleSpec


def _offload_block(device: str, spec: ScaleSpec, buffer_count: int) -> dict:
    block: dict = {"device": device, "pin_memory": True}
    if device == "nvme":
        block["nvme_path"] = spec.zero.nvme_path
        block["buffer_count"] = buffer_count  # DeepSpeed's defaults: 4 optimizer, 5 parameter buffers
    return block


def zero_block(spec: ScaleSpec) -> dict:
    z = spec.zero
    block: dict = {"stage": z.stage}
    if z.stage >= 1:
        block["overlap_comm"] = z.overlap_comm
        block["reduce_bucket_size"] = "auto"
    if z.stage == 2:
        block["contiguous_gradients"] = z.contiguous_gradients
        block["allgather_bucket_size"] = 500_000_000
    if z.stage == 3:
        block["contiguous_gradients"] = z.contiguous_gradients
        block["stage3_prefetch_bucket_size"] = "auto"
        block["stage3_param_persistence_threshold"] = "auto"
        block["stage3_max_live_parameters"] = 1_000_000_000
        block["stage3_max_reuse_distance"] = 1_000_000_000
        block["stage3_gather_16bit_weights_on_model_save"] = z.gather_16bit_weights_on_model_save
    if z.offload_optimizer != "none":
        block["offload_optimizer"] = _offload_block(z.offload_optimizer, spec, 4)
    if z.offload_params != "none":
        block["offload_param"] = _offload_block(z.offload_params, spec, 5)
    return block


def to_deepspeed(spec: ScaleSpec) -> dict:
    if not spec.uses_deepspeed:
        raise ValueError(f"{spec.name}: engine {spec.engine} has no DeepSpeed config")
    z = spec.zero
    config: dict = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": spec.gradient_accumulation_steps,
        "gradient_clipping": float(spec.gradient_clipping),
        "bf16": {"enabled": spec.precision == "bf16"},
        "fp16": {"enabled": spec.precision == "fp16"},
        "zero_optimization": zero_block(spec),
    }
    if spec.precision == "fp16":
        # dynamic loss scaling, DeepSpeed's defaults written out
        config["fp16"].update(
            {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
        )
    if z.offload_optimizer != "none":
        # DeepSpeed's CPU Adam is what makes optimizer offload fast; declaring the optimizer here
        # makes both Trainer and accelerate (through DummyOptim) build it. betas/eps are explicit
        # because plain accelerate fills only lr and weight_decay.
        config["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": "auto", "weight_decay": "auto", "betas": [0.9, 0.999], "eps": 1e-8},
        }
    if z.uses_nvme:
        a = z.aio
        config["aio"] = {
            "block_size": a.block_size,
            "queue_depth": a.queue_depth,
            "intra_op_parallelism": a.intra_op_parallelism,
            "single_submit": a.single_submit,
            "overlap_events": a.overlap_events,
        }
    config["steps_per_print"] = 1_000_000  # keep DeepSpeed's own step logging out of the way
    config["wall_clock_breakdown"] = False
    return config


def ds_precision(ds: dict) -> str | None:
    """The precision a DeepSpeed JSON (as a user wrote it) asks for: bf16 | fp16 | fp32, or None where it leaves it to
    accelerate ("auto" or absent)."""

    absent = object()

    def enabled(section: str):
        sub = ds.get(section) if isinstance(ds, dict) else None
        return sub.get("enabled", absent) if isinstance(sub, dict) else absent

    bf, fp = enabled("bf16"), enabled("fp16")
    if bf is True:
        return "bf16"
    if fp is True:
        return "fp16"
    if bf is False and (fp is False or fp is absent) or (bf is absent and fp is False):
        return "fp32"
    return None  # auto / absent: filled from elsewhere
