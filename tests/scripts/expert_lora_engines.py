"""By hand (not in the suite: it launches): LoRA on MoE expert tensors (hfscale.scale.adapters.apply_adapter with
experts=True, peft's target_parameters) on a tiny Qwen3-MoE under each engine, 2 CPU ranks, 4 AdamW steps. Prints one
RESULT line per rank: the losses, the non-adapter tensors that moved (gathered from ZeRO-3 partitions / FSDP2 shards;
must be none) and how many adapter tensors moved (must be all).

    for c in ddp zero2 zero3 fsdp2; do
      accelerate launch --config_file accelerate_configs/$c.yaml --num_processes 2 tests/scripts/expert_lora_engines.py
    done
"""

import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from hfscale.scale.adapters import AdapterSpec, adapted, apply_adapter
from hfscale.scale.runtime import make_accelerator, set_deepspeed_micro_batch


def gathered(accelerator, model) -> dict:
    """Every parameter whole, in fp32, on this rank."""
    if accelerator.distributed_type.name == "DEEPSPEED":
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            return {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return {n: (p.detach().full_tensor() if hasattr(p.detach(), "full_tensor") else p.detach()).float().clone()
            for n, p in model.named_parameters()}


def main():
    accelerator = make_accelerator(precision="bf16")
    set_deepspeed_micro_batch(accelerator, 2)
    cfg = Qwen3MoeConfig(vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                         num_experts_per_tok=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)  # under ZeRO-3 (zero3_init_flag) partitioned by zero.Init
    spec = AdapterSpec("lora", rank=4, targets=("q_proj",), experts=True)
    model = apply_adapter(model, spec)
    modules, params = adapted(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = accelerator.prepare(model, opt)
    before = gathered(accelerator, model)
    ids = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(accelerator.process_index))
    losses = []
    for _ in range(4):
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(round(loss.item(), 4))
    after = gathered(accelerator, model)
    moved = [n for n in after if not torch.equal(after[n], before[n])]
    print(f"RESULT {accelerator.distributed_type.name} rank {accelerator.process_index}: {len(modules)} linears + "
          f"{len(params)} expert tensors adapted; losses {losses}; non-adapter tensors moved "
          f"{[n for n in moved if 'lora_' not in n]}; adapter tensors moved {sum('lora_' in n for n in moved)} of "
          f"{sum('lora_' in n for n in after)}", flush=True)


if __name__ == "__main__":
    main()
