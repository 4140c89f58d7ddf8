"""hfscale/plan/fsdp.py: FSDP2's units as accelerate wraps the model, and the per-rank bytes laid over the one-rank
trace. The 2-process measurements these formulas are held to are in benchmarks/results/step_peak.md (FSDP2 rows)."""

from hfscale.models import load_config
from hfscale.plan.fsdp import ROOT, TAIL, fsdp2_phases, fsdp2_units
from hfscale.plan.peak import scaled_trace, step_prediction

CFG = load_config("tiny-gemma3")
P = 3_001_920  # tiny Gemma 3: 4 decoder layers of 553,824 + embedding 786,432 (tied lm_head) + final norm 192


def test_units_follow_accelerates_wrapping():
    u = fsdp2_units(CFG)
    assert u.layers == (553_824,) * 4 and u.tail == 786_432 + 192 and u.root == 0 and u.total == P
    assert u.largest_param == 786_432
    assert u.param_units[0] == TAIL and u.param_units[-1] == TAIL and ROOT not in u.param_units
    assert [u.param_units.count(i) for i in range(4)] == [13] * 4


def test_phases_per_rank():
    tr = scaled_trace(CFG, micro_batch=2, seq_len=128, precision="fp32", attention="eager", checkpointing="off",
                      lora_rank=0, grad_accum=1, adamw="forloop")
    u = fsdp2_units(CFG)
    on, off = (fsdp2_phases(tr, u, 2, reshard, False, True) for reshard in (True, False))
    for ph in (on, off):
        assert ph["backward"]["param_shards"] == 4 * P // 2 and ph["backward"]["optimizer"] == -(-tr.state_bytes // 2)
        # the optimizer step: shards, fp32 gradient shards, moments, forloop AdamW's two temporaries of the largest shard
        assert ph["optimizer"]["gradient_shards"] == 4 * P // 2
        assert ph["optimizer"]["optimizer_temporaries"] == 2 * 4 * 786_432 // 2
    # the start of backward (the loss): with reshard only the tail unit is gathered, without it every unit is
    assert on["backward"]["gathered_parameters"] == 4 * u.tail
    assert off["backward"]["gathered_parameters"] == 4 * P
    # CPU offload: the same bytes, the shards / gradients / moments on the host
    host = fsdp2_phases(tr, u, 2, True, True, True)["optimizer"]
    assert {k for k in host if k.startswith("host_")} == {"host_param_shards", "host_gradient_shards", "host_optimizer"}


def test_step_prediction_engine_fsdp2():
    """The plan's path (what `hfscale profile` compares with): engine fsdp2, measured on this host at 62,535,656
    bytes per rank (2 ranks, fp32, micro 2 x 128, reshard on): predicted within 0.001%."""
    p = step_prediction(CFG, 2, 128, "fp32", "eager", "off", zero=3, dp=2, engine="FSDP", adamw="forloop")
    assert p["trace"]["engine"] == "fsdp2" and "fsdp.py" in p["trace"]["sharding"]
    assert abs(p["peak"] - 62_535_656) / 62_535_656 < 1e-5 and p["peak_phase"] == "backward"
    keep = step_prediction(CFG, 2, 128, "fp32", "eager", "off", zero=3, dp=2, engine="fsdp2", adamw="forloop",
                           reshard_after_forward=False)
    assert keep["peak"] - p["peak"] == 4 * sum(fsdp2_units(CFG).layers)  # every layer stays gathered


def test_accumulation_keeps_the_earlier_micro_batches_gradient_shards():
    """2 micro batches per step: the second backward runs beside the first one's fp32 gradient shards (4P/N); measured in
    benchmarks/results/fsdp2_engines.md (bf16, micro 4 x 128, 2 ranks): 92,780,266 bytes per rank, planned 92,780,150."""
    one = step_prediction(CFG, 4, 128, "bf16", "eager", "off", grad_accum=1, zero=3, dp=2, engine="fsdp2", adamw="forloop")
    two = step_prediction(CFG, 4, 128, "bf16", "eager", "off", grad_accum=2, zero=3, dp=2, engine="fsdp2", adamw="forloop")
    assert two["peak"] == 92_780_150 and two["peak"] - one["peak"] >= 4 * P // 2


def test_plan_predicts_fsdp2_and_ranks_it(tmp_path):
    """`plan(engine="fsdp2")` is the same FSDP2 model per rank; FSDP2 rows are candidates and an FSDP2 pick writes an
    FSDP2 accelerate config (parameter offload as Zero.offload_params, as `hfscale config fsdp2` writes it)."""
    import yaml

    from hfscale.plan import Hardware, plan
    from hfscale.plan.planner import to_scale_spec
    from hfscale.plan.write import write_plan

    r = plan("tiny-gemma3", 128, 2, precision="fp32", engine="fsdp2", dp=2)
    assert r.strategy.label.startswith("FSDP2") and r.prediction.source == "trace"
    assert r.prediction.peak == step_prediction(CFG, 2, 128, "fp32", engine="fsdp2", dp=2)["peak"]
    ranked = plan("tiny-gemma3", 128, 1, precision="fp32", hardware=Hardware(2, 1, 10**9), method="fast")
    rows = [c for c in ranked.candidates if c.engine == "fsdp2"]
    assert {c.offload for c in rows} == {"none", "cpu"} and all(c.zero == 0 for c in rows)
    offloaded = next(c for c in rows if c.offload == "cpu")
    spec = to_scale_spec(offloaded, ranked.hardware)
    assert spec.engine == "fsdp2" and spec.zero.offload_params == "cpu"
    written = write_plan(offloaded, ranked.hardware, tmp_path / "w")
    cfg = yaml.safe_load(next(p for p in written if p.suffix == ".yaml" and p.name == "plan.yaml").read_text())
    assert cfg["distributed_type"] == "FSDP" and cfg["fsdp_config"]["fsdp_offload_params"] is True


def test_adapter_units_and_the_last_arrival_finishing_its_layer():
    """An adapter's units hold its frozen base (gathered like the rest), only its trainable parameters have gradients;
    under peft accelerate's final-norm lookup finds none, so the norm is the root's. Measured with `hfscale profile
    --config accelerate_configs/fsdp2.yaml --num-processes 2 --micro-batch 1 --seq-len 8 --precision fp32` (AMD EPYC
    host, 2026-12-07): LoRA r4 17,280,828 B on both ranks, at the start of forward (the tail's and the first layer's
    all-gather outputs beside their parameters): planned within 0.1% (-0.08%; before, FSDP2 adapters had no traced rule);
    full fine-tuning 37,242,472 B on rank 1, within 0.001% (the embedding's last gradient after every layer finished;
    the rule that took the last arrival's layer as still running planned 40,565,304, +8.9%). Rank 0 measured 39,457,768:
    gloo finished the previous reduce-scatter a few ops later there, keeping its input (one layer) alive longer."""
    u = fsdp2_units(CFG, 4, "lora")
    assert u.layers == (553_824 + 16_896,) * 4 and u.trainable_layers == (16_896,) * 4 and u.tail == 786_432
    assert u.root == 192 and len(u.param_units) == 4 * 14 and TAIL not in u.param_units
    lora = step_prediction(CFG, 1, 8, "fp32", "eager", "off", zero=3, dp=2, engine="fsdp2", adamw="fused", lora_rank=4)
    assert lora["peak_phase"] == "forward" and abs(lora["peak"] / 17_280_828 - 1) < 1e-3, lora["peak"]
    assert lora["peak_breakdown"]["frozen_param_shards"] == 4 * P // 2  # every base parameter, sharded
    full = step_prediction(CFG, 1, 8, "fp32", "eager", "off", zero=3, dp=2, engine="fsdp2", adamw="fused")
    assert abs(full["peak"] / 37_242_472 - 1) < 1e-5, full["peak"]


def test_final_norm_is_accelerates_rule_owned_here(monkeypatch):
    """The tail unit's norm by hfscale's rule, not accelerate's private fsdp_utils._find_final_norm: the same module
    accelerate 1.16 picks (checked while it exists), also once it is gone, where the old fallback (`model.model.norm`)
    missed GPT-NeoX's gpt_neox.final_layer_norm; under peft none (the norm stays in the root unit)."""
    import torch
    from accelerate.utils import fsdp_utils
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, GPTNeoXConfig

    from hfscale.plan.fsdp import _final_norm

    with torch.device("meta"):
        neox = AutoModelForCausalLM.from_config(GPTNeoXConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                              num_hidden_layers=1, num_attention_heads=2))
        gemma = AutoModelForCausalLM.from_config(CFG)
        peft = get_peft_model(AutoModelForCausalLM.from_config(CFG), LoraConfig(r=2, target_modules=["q_proj"]))
    models = (neox, gemma, peft)
    accelerates = [getattr(fsdp_utils, "_find_final_norm", _final_norm)(m) for m in models]
    monkeypatch.delattr(fsdp_utils, "_find_final_norm", raising=False)
    assert [_final_norm(m) for m in models] == accelerates == [neox.gpt_neox.final_layer_norm, gemma.model.norm, None]


def test_dora_forward_peaks_within_the_layers_one_layer_gathered():
    """DoRA's weight-norm temporaries put the forward's peak inside the last decoder layer (the trace's
    forward_in_layers), where FSDP2 holds the running layer gathered beside its all-gather's flat output, not at the
    loss (one all-gather output, no layer). On the 101.6M Gemma 3 (2 ranks, fp32, micro 1 x 64,
    benchmarks/results/adapters.md): measured 498,597,956 B, planned 498,594,380 (at the loss: 472,519,756, -5.2%)."""
    p = step_prediction(CFG, 1, 64, "fp32", engine="fsdp2", dp=2, lora_rank=4, adapter="dora")
    u = fsdp2_units(CFG, 4, "dora")
    layer = max(u.layers)
    b = p["peak_breakdown"]
    assert p["peak_phase"] == "forward"
    assert (b["gathered_parameters"], b["all_gather_output"]) == (4 * (u.tail + layer), 4 * layer)
