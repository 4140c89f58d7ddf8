"""Planning adapters (hfscale/plan/adapters.py, the adapter paths of plan/memory.py and plan/trace.py): the recipe's
adapter spec counted, traced and written back; QLoRA's NF4 base against bitsandbytes' real storage."""

import pytest
import yaml

from hfscale.models import load_config
from hfscale.models.dims import dims_from_config
from hfscale.plan.memory import Strategy
from hfscale.scale.adapters import AdapterSpec
from hfscale.util.errors import HfscaleError


def test_strategy_reads_one_adapter_spec():
    assert Strategy(lora_rank=8).adapter_spec == AdapterSpec("lora", rank=8)  # --lora-rank alone: LoRA, as before
    q = Strategy(lora_rank=8, base_bits=4)  # --lora-rank --base-bits 4: QLoRA, as before
    assert (q.adapter, q.adapter_spec.base_bits) == ("qlora", 4) and "QLoRA-r8" in q.label
    d = Strategy(adapter="dora")  # a kind alone: the spec's default rank
    assert (d.lora_rank, d.base_bits, d.adapter_spec.dora) == (AdapterSpec.rank, 16, True) and "DoRA-r16" in d.label
    assert Strategy(adapter="qlora").base_bits == 4
    for bad, match in (({"adapter": "lora", "base_bits": 4}, "--adapter qlora"), ({"base_bits": 4}, "--adapter qlora"),
                       ({"adapter": "ia3"}, "--adapter must be one of")):
        with pytest.raises(HfscaleError, match=match):
            Strategy(**bad)


def test_nf4_base_is_bitsandbytes_storage(tmp_path):
    # the analytic QLoRA base against what bitsandbytes really holds after transformers quantizes a small Gemma 3
    # (the recipe's loader): packed 4-bit weights, uint8 block absmax (blocksize 64), fp32 absmax of those per 256
    # blocks, the per-tensor offset, to the byte; every other parameter in bf16 (the code books are in neither)
    import torch
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    from hfscale.plan.memory import nf4_base_bytes
    from hfscale.scale.adapters import load_quantized_base, nf4_bytes

    cfg = Gemma3TextConfig(vocab_size=640, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=6,
                           num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    m = load_quantized_base(str(tmp_path), torch.bfloat16, torch.uint8)
    planned = nf4_base_bytes(dims_from_config(m.config))
    assert planned["nf4"] == nf4_bytes(m)
    assert planned["other"] == sum(p.numel() * p.element_size() for p in m.parameters() if getattr(p, "quant_state", None) is None)


def test_compare_adapters_side_by_side(capsys):
    # one strategy, four adapters: full and LoRA / DoRA traced on fake tensors through the recipe's apply_adapter,
    # QLoRA as that LoRA trace with its decoder linears in NF4 (measured against real runs per engine in
    # benchmarks/results/adapters.md)
    from hfscale.cli import main
    from hfscale.plan.adapters import compare_adapters
    from hfscale.plan.memory import lora_params

    rows = {r.kind: r for r in compare_adapters("tiny-gemma3", 32, 1, rank=4, precision="fp32")}
    assert list(rows) == ["none", "lora", "dora", "qlora"]
    d = dims_from_config(load_config("tiny-gemma3"))
    assert rows["none"].trainable_params == rows["none"].params
    assert rows["lora"].trainable_params == rows["qlora"].trainable_params == lora_params(d, AdapterSpec("lora", rank=4))
    assert rows["dora"].trainable_params == lora_params(d, AdapterSpec("dora", rank=4)) > rows["lora"].trainable_params
    assert rows["lora"].peak < rows["dora"].peak < rows["none"].peak  # DoRA: magnitudes + its weight-norm activations
    assert rows["qlora"].weights < rows["lora"].weights
    # QLoRA: the LoRA trace with the NF4 base (bitsandbytes has no fake kernels)
    assert [r.source for r in rows.values()] == ["trace"] * 4
    from hfscale.plan.memory import decoder_linears, nf4_base_bytes

    fp32_linears = 4 * sum(i * o for _, i, o in decoder_linears(d))  # what the fp32 trace holds, NF4 holds instead
    assert rows["lora"].peak - rows["qlora"].peak == fp32_linears - nf4_base_bytes(d)["nf4"]
    # under ZeRO-3 too (was the analytic terms, +3.46% on the 101.6M Gemma 3; traced +0.56%, the quant state
    # MemTracker does not see, benchmarks/results/adapters.md): the steady peak holds the gathered base, in NF4
    z3 = {r.kind: r for r in compare_adapters("tiny-gemma3", 32, 1, rank=4, precision="fp32", zero=3, dp=2,
                                              kinds=("lora", "qlora"))}
    assert z3["qlora"].source == "trace" and z3["qlora"].note is None
    assert z3["lora"].peak - z3["qlora"].peak == fp32_linears - nf4_base_bytes(d)["nf4"]
    # under FSDP2 the recipe refuses QLoRA: the plan says so (its analytic terms for reference only)
    fsdp = compare_adapters("tiny-gemma3", 32, 1, rank=4, precision="fp32", engine="fsdp2", dp=2, kinds=("qlora",))[0]
    assert fsdp.source == "analytic" and "refuses" in fsdp.note and "accelerate_configs/ddp.yaml" in fsdp.note
    assert main(["plan", "--model", "tiny-gemma3", "--seq-len", "32", "--micro-batch", "1", "--precision", "fp32",
                 "--lora-rank", "4", "--compare-adapters"]) == 0
    out = capsys.readouterr().out
    assert "QLoRA-r4" in out and "DoRA-r4" in out and "traced step" in out
    assert main(["plan", "--model", "tiny-gemma3", "--seq-len", "32", "--micro-batch", "1", "--compare-adapters",
                 "--adapter", "lora"]) == 2
    assert "--compare-adapters plans every adapter kind" in capsys.readouterr().err
    from hfscale.plan.trace import trace_step

    with pytest.raises(HfscaleError, match="cannot be traced"):
        trace_step(load_config("tiny-gemma3"), 1, 32, lora_rank=4, adapter="qlora")


def test_zero3_qlora_above_the_reuse_distance_falls_back_to_the_analytic_terms(monkeypatch):
    """Above stage3_max_reuse_distance ZeRO-3 gathers one module at a time, which the NF4 swap does not model: the
    step is not traced (refused before tracing, as a TraceError the planner takes to the analytic terms), never an
    error that stops the whole plan (a 1B+ model's `hfscale plan --adapter qlora` once did)."""
    from hfscale.plan import zero
    from hfscale.plan.adapters import compare_adapters
    from hfscale.plan.peak import step_prediction
    from hfscale.plan.trace import TraceError

    monkeypatch.setattr(zero, "REUSE_DISTANCE", 1000)  # the tiny model's 3M parameters are "above" it
    with pytest.raises(TraceError, match="not traced"):
        step_prediction(load_config("tiny-gemma3"), 1, 32, "fp32", "sdpa", lora_rank=4, adapter="qlora", zero=3, dp=2)
    # seq_len 24: a step no other test caches (the cached prediction of a traced step would be read back)
    (row,) = compare_adapters("tiny-gemma3", 24, 1, rank=4, precision="fp32", zero=3, dp=2, kinds=("qlora",))
    assert row.source == "analytic" and "not traced" in row.note


@pytest.mark.parametrize("kind, zero, storage", [("lora", 0, None), ("qlora", 3, "bfloat16")])
def test_write_round_trips_the_adapter(tmp_path, kind, zero, storage):
    # the pick carries the adapter planned; recipe.yaml's adapter section reads back to the same spec, the
    # training arguments carry TRL's peft / bitsandbytes keys (ZeRO-3: storage in the model's dtype) and pass doctor
    from hfscale.doctor import check
    from hfscale.plan.api import plan
    from hfscale.plan.planner import Hardware
    from hfscale.plan.write import write_plan

    hw = Hardware(8, 1, 24e9, 512e9)
    res = plan("gemma-3-1b", 1024, 1, adapter=kind, lora_rank=32, hardware=hw, method="fast",
               engines="deepspeed" if zero else "ddp")
    pick = res.pick
    assert pick is not None and pick.strategy.adapter == kind and all(c.strategy.adapter == kind for c in res.candidates)
    if zero:  # only ZeRO-3 rows can be forced here: take the cheapest fitting one
        pick = next(c for c in res.candidates if c.fits and c.zero == 3)
    write_plan(pick, hw, tmp_path, model="gemma-3-1b", seq_len=1024)
    recipe = yaml.safe_load((tmp_path / "recipe.yaml").read_text())
    assert AdapterSpec.from_mapping(recipe["adapter"]) == AdapterSpec(kind, rank=32)
    from hfscale.train.config import adapter_section  # the recipe's own reader of the section

    assert adapter_section(recipe["adapter"], "recipe.yaml") == {"adapter": kind, "lora_rank": 32}
    args = yaml.safe_load((tmp_path / "training_args.yaml").read_text())
    assert args["use_peft"] is True and args["lora_r"] == 32 and args["lora_target_modules"] == list(AdapterSpec.targets)
    assert args.get("bnb_4bit_quant_storage") == storage and args.get("load_in_4bit", False) is (kind == "qlora")
    found = check(accelerate=tmp_path / "plan.yaml", args=tmp_path / "training_args.yaml", num_processes=8)
    assert [f for f in found if f.severity == "error"] == [], found


def test_lora_params_count_expert_lora_as_peft_builds_it():
    # a spec with experts: the planner's trainable count equals what peft's target_parameters really adds on a small
    # Gemma 4 MoE (26B-A4B's block: router + 4 experts beside the dense MLP), to the parameter; without experts the
    # expert stacks get nothing (the router never)
    import torch
    from transformers import AutoModelForCausalLM

    from hfscale.models.builtin import tiny_gemma4_config
    from hfscale.plan.memory import lora_params
    from hfscale.scale.adapters import apply_adapter

    cfg = tiny_gemma4_config()
    cfg.vocab_size = cfg.vocab_size_per_layer_input = 256
    cfg.enable_moe_block, cfg.num_experts, cfg.top_k_experts, cfg.moe_intermediate_size = True, 4, 2, 32
    d = dims_from_config(cfg)
    for spec in (AdapterSpec("lora", rank=4), AdapterSpec("lora", rank=4, experts=True)):
        torch.manual_seed(0)
        pm = apply_adapter(AutoModelForCausalLM.from_config(cfg), spec)
        assert lora_params(d, spec) == sum(p.numel() for p in pm.parameters() if p.requires_grad)
    # 4 layers x 4 experts x r 4 x (2 h + 3 I') = 4 x 4 x 4 x (256 + 96)
    assert lora_params(d, spec) - lora_params(d, AdapterSpec("lora", rank=4)) == 4 * 4 * 4 * (2 * 128 + 3 * 32)


def test_profile_counts_the_nf4_quant_state(tmp_path):
    """`hfscale profile` counts a QLoRA base whole: its packed weights (parameters) and their quant state (absmax,
    nested absmax, offsets), which torch's MemTracker does not see (attributes of the weights, neither parameters nor
    buffers): the QLoRA plans were +0.47-0.56% over the measured peaks on the 101.6M Gemma 3, 1,198,412 B of its
    1,198,416 B of quant state on DDP (benchmarks/results/adapters.md)."""
    import torch
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    from hfscale.plan.memory import nf4_base_bytes
    from hfscale.plan.profiler import MemoryProfiler
    from hfscale.scale.adapters import load_quantized_base

    cfg = Gemma3TextConfig(vocab_size=640, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=6,
                           num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    m = load_quantized_base(str(tmp_path), torch.float32, torch.uint8)
    held = MemoryProfiler(m, None).mt.current()
    assert held["parameters"] == nf4_base_bytes(dims_from_config(m.config), elem_bytes=4)["total"]
