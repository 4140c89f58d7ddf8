"""The one model builder of the recipes (train_clm, qat_clm, distill_clm): from a built model to the prepared model,
optimizer and loss a step loop runs, every recipe through the same sequence, so a setting one recipe honours cannot
be silently dropped by another (what a recipe cannot honour is refused in one line: hfscale.train.recipe).

In this order, each step the technique's own home:
  1. the attention kernel (`attention:`, hfscale.models.varlen), or under Ulysses SP the launch's kernel
     (window-aware where it is sdpa, hfscale.scale.ulysses);
  2. activation checkpointing on the decoder layers (hfscale.scale.checkpointing; non-reentrant, so a frozen base
     needs no input gradients);
  3. the long-context levers: tiled logits + loss, MLP, RMSNorm (hfscale.scale.long_context), on the base;
  4. the adapter (hfscale.scale.adapters: a peft model, base frozen), after 2-3 so they act on the base's modules;
  5. AdamW (hfscale.scale.runtime.make_optimizer; LoRA+'s parameter groups) and accelerator.prepare (Ulysses on
     layers of different head shapes: per_layer_heads), then DoRA's ZeRO-3 gathers;
  6. the next-token loss (under SP its sharded form) with activation offload around it; a recipe with another loss
     (distillation's, made once the student is prepared) puts it under the same offload with `Prepared.wrap`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..models.loss import lm_loss


@dataclass(frozen=True)
class Prepared:
    """What `prepare_training` returns: the prepared model and optimizer, the next-token loss the loop calls, and
    the facts a recipe prints (checkpointed layer indices, the levers applied, parameter elements whole under
    ZeRO-3, AdamW's implementation)."""
    model: object
    optimizer: object
    loss_fn: object
    levers: object  # scale.long_context.Levers: `wrap` puts another loss under the same offload
    layers: list
    applied: list  # the levers applied, for the log
    params: int
    trained: int
    adamw: str

    def wrap(self, loss_fn):
        """Another loss than the next-token one (distillation) under the run's activation offload. Data parallel only:
        under SP the loss must be the sharded one (the recipes that distil refuse SP, hfscale.train.recipe)."""
        from ..scale.long_context import with_levers

        return with_levers(loss_fn, self.levers, self.model)

    def facts(self) -> str:
        """'; checkpointed layers [0, 2]; tiled MLP x2 on 2 layers' (what was applied beyond the model; '' if nothing)."""
        return "".join(f"; {s}" for s in ([f"checkpointed layers {self.layers}"] if self.layers else []) + self.applied)


def prepare_training(accelerator, cfg, pre, model, adapter=None, parallel=None) -> Prepared:
    """`model` (built, on no engine yet) made ready to train under `accelerator` per the recipe settings `cfg`
    (attention, checkpointing, the levers, lr / weight_decay / adamw) and the launch (`pre`: the preflight;
    `parallel`: its sp / tp / cp, default none). `adapter`: an hfscale.scale.adapters.AdapterSpec, default
    cfg.adapter_spec (a QLoRA spec expects its base in 4 bits already)."""
    from ..scale.adapters import adapter_param_groups, apply_adapter, gather_dora_inputs_
    from ..scale.checkpointing import apply_checkpointing_
    from ..scale.long_context import apply_levers_, with_levers
    from ..scale.optim import adamw_impl
    from ..scale.runtime import make_optimizer
    from ..scale.spec import Parallel
    from ..scale.ulysses import per_layer_heads

    spec = cfg.adapter_spec if adapter is None else adapter
    if spec.names_template:  # trainable_tokens "template": the ids the run's tokenizer's chat template writes
        from ..data.formats import template_token_ids

        spec = spec.with_tokens(template_token_ids(pre.data.tokenizer))
    parallel = parallel or Parallel()
    sp = parallel.sp > 1
    if cfg.attention:  # varlen: packed documents attend within themselves, no L x L mask (hfscale.models.varlen)
        from ..models.varlen import set_attention_

        set_attention_(model, cfg.attention)
    if sp:  # Ulysses wraps the kernel the model runs: the same one, window-aware where it is sdpa
        from ..scale.ulysses import use_window_sdpa

        model.config._attn_implementation = parallel.sp_attention
        if parallel.sp_attention == "sdpa":
            use_window_sdpa()
    layers = apply_checkpointing_(model, cfg.checkpointing, pre.launch.fsdp_checkpoints_all)
    applied = apply_levers_(model, cfg.levers)  # long context: tiled loss / MLP / RMSNorm (docs/long_context.md)
    model = apply_adapter(model, spec)  # peft: only the adapters train (non-reentrant checkpointing: no input grads)
    optimizer = make_optimizer(accelerator, model, lr=cfg.lr, weight_decay=cfg.weight_decay, adamw=cfg.adamw,
                               params=adapter_param_groups(model, spec, cfg.lr, cfg.weight_decay) if spec.enabled else None)
    with per_layer_heads(model):  # Ulysses on layers of different head shapes (Gemma 4); else nothing
        model, optimizer = accelerator.prepare(model, optimizer)
    if spec.dora:  # ZeRO-3: DoRA reads lora_A / the base weight outside their forward (a resume's recompute crashed)
        gather_dora_inputs_(accelerator.unwrap_model(model))
    loss_fn = lm_loss
    if sp:
        from deepspeed.utils import groups

        from ..scale.ulysses import sp_lm_loss

        loss_fn = sp_lm_loss(groups._get_sequence_parallel_group(), tiled=bool(cfg.tiled_loss))
    numel = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in model.parameters()]  # ZeRO-3: whole sizes
    return Prepared(model, optimizer, with_levers(loss_fn, cfg.levers, model), cfg.levers, layers, applied,
                    sum(n for n, _ in numel), sum(n for n, trains in numel if trains), adamw_impl(optimizer))
