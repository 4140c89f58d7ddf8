"""`hfscale plan`: the memory model against exact measurements, model states against ZeRO's algebra,
and the planner / CLI contract."""

import json

import pytest
import torch

from hfscale.util.errors import HfscaleError
from hfscale.models.dims import dims_from_config
from hfscale.plan.measure import saved_activation_bytes
from hfscale.plan.memory import Strategy, activation_bytes, kv_cache_bytes, model_state_bytes, predict


def _gemma4_config(variant="e"):
    """Small Gemma 4 text configs with every feature of the shipped shapes. "e" (E2B/E4B-like): per-layer
    inputs, the last 3 of 6 layers reuse earlier K/V, double-wide MLPs there, 32-wide global heads.
    "moe" (26B-A4B/31B-like): k_eq_v with 1 global K/V head of width 288 (> 256: sdpa gets repeat_kv copies),
    router + 4 experts (top 2) beside the dense MLP. Both: sliding window 40 (the test shapes sit on both sides
    of it), final logit soft-capping."""
    from transformers import Gemma4TextConfig

    kw = dict(vocab_size=640, hidden_size=96, intermediate_size=160, num_attention_heads=6, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=512, sliding_window=40, final_logit_softcapping=30.0, vocab_size_per_layer_input=640)
    if variant == "e":
        return Gemma4TextConfig(**kw, num_hidden_layers=6, layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
                                global_head_dim=32, hidden_size_per_layer_input=8, num_kv_shared_layers=3, use_double_wide_mlp=True)
    return Gemma4TextConfig(**kw, num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, global_head_dim=288,
                            hidden_size_per_layer_input=0, attention_k_eq_v=True, num_global_key_value_heads=1,
                            enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=24)


def _small(family, attn):
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Qwen2Config

    kw = dict(vocab_size=640, hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=6,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    cfg = {"gemma3": lambda: Gemma3TextConfig(**kw, sliding_window=4096, layer_types=["full_attention"] * 3, query_pre_attn_scalar=16),
           "gemma3sw": lambda: Gemma3TextConfig(**{**kw, "num_hidden_layers": 4}, sliding_window=40, query_pre_attn_scalar=16,
                                                layer_types=["sliding_attention"] * 3 + ["full_attention"], final_logit_softcapping=30.0),
           "gemma4": lambda: _gemma4_config("e"),
           "gemma4moe": lambda: _gemma4_config("moe"),
           "llama": lambda: LlamaConfig(**kw, tie_word_embeddings=False),
           "qwen2": lambda: Qwen2Config(**kw, tie_word_embeddings=True)}[family]()
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def _set_checkpointing(model, mode):
    if mode == "off":
        model.gradient_checkpointing_disable()
        return
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if mode.startswith("every:"):
        k = int(mode.split(":")[1])
        for i, layer in enumerate(model.model.layers):
            layer.gradient_checkpointing = i % k == 0


@pytest.mark.parametrize("family, attn", [("tiny", "eager"), ("gemma3", "sdpa"), ("llama", "eager"), ("llama", "sdpa"), ("qwen2", "sdpa")])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_activation_prediction_within_10_percent_of_measurement(family, attn, precision):
    _check_activations(family, attn, precision, tolerance=0.10)


def _check_activations(family, attn, precision, tolerance):
    """Saved-for-backward bytes (hooks) vs prediction, checkpointing off / full / every:2, two shapes."""
    from hfscale.models import build_model

    model = build_model("tiny-gemma3") if family == "tiny" else _small(family, attn)
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    model.train()
    d = dims_from_config(model.config)
    for ckpt in ("off", "full", "every:2"):
        _set_checkpointing(model, ckpt)
        for B, S in ((1, 32), (2, 96)):
            ids = torch.randint(4, d.vocab, (B, S))
            measured = saved_activation_bytes(model, ids)
            predicted = activation_bytes(d, B, S, precision, ckpt, attn)["total"]
            assert abs(predicted - measured) / measured < tolerance, (family, attn, precision, ckpt, B, S, predicted, measured)


@pytest.mark.parametrize("family, attn", [("gemma4", "sdpa"), ("gemma4", "eager"), ("gemma4moe", "sdpa"), ("gemma4moe", "eager"),
                                          ("gemma3sw", "sdpa")])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gemma4_and_windowed_gemma3_activations_within_1_percent(family, attn, precision):
    """Gemma 4 (per-layer inputs, shared K/V, double-wide MLP, k_eq_v, 288-wide global heads, MoE, soft-capping)
    and Gemma 3 with a sliding window shorter than the sequence: checkpointing off / full / every:2, shapes
    below and above the window (sdpa then saves a mask and repeat_kv'd keys/values)."""
    _check_activations(family, attn, precision, tolerance=0.01)


def test_gemma4_param_count_is_exact():
    """Small configs of every Gemma 4 variant (built) and the shipped shapes (on the meta device)."""
    from transformers import AutoModelForCausalLM

    from hfscale.models import dimension_configs, load_config

    cfgs = [_gemma4_config("e"), _gemma4_config("moe")]
    cfgs += [load_config(n) for n in dimension_configs() if n.startswith("gemma-4-")]
    assert len(cfgs) >= 6
    for cfg in cfgs:
        with torch.device("meta"):
            m = AutoModelForCausalLM.from_config(cfg)
        assert dims_from_config(cfg).params == sum(p.numel() for p in m.parameters()), cfg.num_hidden_layers


def test_shipped_gemma4_shapes_match_published_sizes():
    """Gemma 4 model card: 31B 30.7B; 26B A4B 25.2B total, 3.8B active; E2B 5.1B / E4B 8B with embeddings,
    which includes the vision (~150M) and audio (~300M) encoders that the text decoder shipped here leaves out."""
    from hfscale.models import load_config
    from hfscale.plan.memory import expert_params

    d31 = dims_from_config(load_config("gemma-4-31b"))
    assert abs(d31.params - 30.7e9) / 30.7e9 < 0.01
    moe = dims_from_config(load_config("gemma-4-26b-a4b"))
    assert abs(moe.params - 25.2e9) / 25.2e9 < 0.01
    active = moe.params - expert_params(moe) * (moe.experts - moe.top_k) // moe.experts
    assert abs(active - 3.8e9) / 3.8e9 < 0.02
    for name, total in (("gemma-4-e2b", 5.1e9), ("gemma-4-e4b", 8.0e9)):
        d = dims_from_config(load_config(name))
        assert abs(d.params + 0.45e9 - total) / total < 0.02, name
        assert d.ple_embedding_params > d.params / 3  # most of an E model is its per-layer embedding table


def test_gemma4_kv_cache_matches_transformers_cache():
    """KV-shared layers hold no cache, global layers their own head size / K/V heads, sliding layers the window
    (transformers' DynamicSlidingWindowLayer keeps window - 1 tokens: one token per sliding layer less)."""
    from transformers import AutoModelForCausalLM

    from hfscale.models import load_config
    from hfscale.plan.memory import kv_cache_bytes

    for cfg in (_gemma4_config("e"), _gemma4_config("moe")):
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).eval()
        d = dims_from_config(cfg)
        for B, S in ((2, 24), (2, 100)):
            with torch.no_grad():
                out = m(input_ids=torch.randint(4, d.vocab, (B, S)), use_cache=True)
            held = sum(t.numel() * t.element_size() for layer in out.cache.layers
                       for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None)
            sliding = [ld for ld in d.per_layer if ld.attention == "sliding_attention" and not ld.kv_shared]
            one_token = sum(2 * ld.kv_heads * ld.head_dim * 2 * B for ld in sliding) if S >= d.sliding_window else 0
            assert kv_cache_bytes(d, B, S) == held + one_token, (S, held)
    e2b = dims_from_config(load_config("gemma-4-e2b"))
    assert sum(not ld.kv_shared for ld in e2b.per_layer) == 15  # 20 of 35 layers read earlier layers' K/V


def test_gemma4_adapter_count_matches_the_recipes_adapter():
    # the recipe's targets (hfscale.scale.adapters): q/k/v/o/gate/up/down, never the per-layer-embedding projections
    # or the router, which peft's all-linear would adapt; DoRA adds one magnitude per output feature
    from transformers import AutoModelForCausalLM

    from hfscale.plan.memory import lora_params
    from hfscale.scale.adapters import AdapterSpec, apply_adapter

    for cfg in (_gemma4_config("e"), _gemma4_config("moe")):
        d = dims_from_config(cfg)
        for kind in ("lora", "dora"):
            spec = AdapterSpec(kind, rank=4)
            with torch.device("meta"):  # shapes only (as the planner's trace builds it): no weight init
                pm = apply_adapter(AutoModelForCausalLM.from_config(cfg), spec)
            trained = [n for n, p in pm.named_parameters() if p.requires_grad]
            assert lora_params(d, spec) == sum(p.numel() for p in pm.parameters() if p.requires_grad)
            assert not any(k in n for n in trained for k in ("per_layer", "router"))


def test_gemma4_is_the_only_new_family_and_others_still_refused():
    from transformers import GPT2Config

    with pytest.raises(HfscaleError, match="gemma4_text"):
        dims_from_config(GPT2Config())


def test_cli_plans_shipped_gemma4(cli):
    r = cli("plan", "--model", "gemma-4-e4b", "--seq-len", "4096", "--micro-batch", "1", "--json", "--inference", "--context", "32768",
            "--fast")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    p = out["prediction"]
    assert 7.0e9 < out["params"] < 8.0e9 and p["activations"] > 0 and p["total"] > p["weights"]
    assert 0 < out["inference"]["kv_cache"] < 2 * 24 * 2 * 512 * 2 * 32768  # 24 layers hold K/V, at most 2 heads x 512
    r = cli("plan", "--model", "gemma-4-26b-a4b", "--seq-len", "4096", "--micro-batch", "1", "--gpus-per-node", "8",
            "--gpu-mem", "80GB", "--global-batch-tokens", "262144", "--fast")
    assert r.returncode == 0, r.stderr
    assert "pick:" in r.stdout


def test_param_count_is_exact_for_three_families():
    from hfscale.models import build_model

    for m in (build_model("tiny-gemma3"), _small("llama", "sdpa"), _small("qwen2", "sdpa")):
        assert dims_from_config(m.config).params == sum(p.numel() for p in m.parameters())


def test_shipped_gemma3_shapes_match_published_sizes():
    from hfscale.models import load_config

    sizes = {"gemma-3-270m": 0.268e9, "gemma-3-1b": 1.0e9, "gemma-3-4b": 3.88e9, "gemma-3-12b": 11.77e9, "gemma-3-27b": 27.0e9}
    for name, n in sizes.items():
        assert abs(dims_from_config(load_config(name)).params - n) / n < 0.01, name


def test_model_states_follow_zero_algebra():
    from hfscale.models import tiny_config

    d = dims_from_config(tiny_config())
    P = d.params
    base = dict(precision="bf16", micro_batch=1, seq_len=8)
    s0 = model_state_bytes(d, Strategy(zero=0, dp=4, **base))
    # DDP bf16 runs as accelerate runs it: autocast over fp32 weights and gradients, fp32 AdamW moments (16Ψ)
    assert (s0["weights"], s0["gradients"], s0["optimizer"]) == (4 * P, 4 * P, 8 * P)
    s1 = model_state_bytes(d, Strategy(zero=1, dp=1, **base))
    assert (s1["weights"], s1["gradients"], s1["optimizer"]) == (2 * P, 2 * P, 12 * P)  # DeepSpeed bf16: K=12
    s1 = model_state_bytes(d, Strategy(zero=1, dp=4, **base))
    assert (s1["weights"], s1["gradients"], s1["optimizer"]) == (2 * P, 2 * P, 12 * P // 4)
    s2 = model_state_bytes(d, Strategy(zero=2, dp=4, **base))
    assert s2["gradients"] == 2 * P // 4
    s3 = model_state_bytes(d, Strategy(zero=3, dp=4, **base))
    assert s3["weights"] + s3["gradients"] + s3["optimizer"] == pytest.approx(16 * P / 4, abs=3)
    assert s3["zero3_live"] == 2 * P  # below stage3_max_reuse_distance every parameter stays gathered (zero.py)
    off = model_state_bytes(d, Strategy(zero=3, dp=4, offload="cpu", **base))
    assert off["optimizer"] == off["weights"] == 0 and off["offloaded_per_rank"] > 0


def test_kv_cache_respects_sliding_windows():
    from hfscale.models import load_config

    d = dims_from_config(load_config("gemma-3-27b"))
    full = 2 * d.layers * d.kv_heads * d.head_dim * 2 * 32768
    kv = kv_cache_bytes(d, 1, 32768)
    n_global = sum(t == "full_attention" for t in d.layer_types)
    assert kv == 2 * d.kv_heads * d.head_dim * 2 * (n_global * 32768 + (d.layers - n_global) * 1024)
    assert kv < full / 4


def test_cli_json_contract(cli):
    r = cli("plan", "--model", "gemma-3-27b", "--seq-len", "4096", "--micro-batch", "1", "--zero", "3", "--dp", "16",
            "--checkpointing", "full", "--json", "--fast")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    p = out["prediction"]
    assert all(isinstance(p[k], int) for k in ("weights", "gradients", "optimizer", "activations", "total"))
    assert p["source"] == "analytic" and p["peak"] == p["total"] and "--fast" in p["peak_not_traced"]
    # ZeRO-3 over 16 ranks: the bf16 weights' partition, fp32 master + moments / 16; 27B > the reuse distance
    from hfscale.models import load_config

    d = dims_from_config(load_config("gemma-3-27b"))
    assert p["weights"] == 2 * d.params // 16 and p["optimizer"] == 12 * d.params // 16
    assert p["zero3_live"] == 2 * 2 * d.largest_layer_params
    assert "candidates" not in out


def test_cli_pick_and_write(tmp_path, cli):
    out = tmp_path / "cfg"
    png = tmp_path / "plan.png"
    r = cli("plan", "--model", "gemma-3-12b", "--seq-len", "4096", "--micro-batch", "1", "--gpus-per-node", "8", "--nodes", "2",
            "--gpu-mem", "80GB", "--global-batch-tokens", "1048576", "--json", "--write", out, "--plot", png, "--fast")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    pick = res["pick"]
    assert pick["fits"] and pick["peak_bytes"] <= 80e9
    assert all(c["cost"] >= pick["cost"] for c in res["candidates"] if c["fits"])
    assert pick["micro_batch"] * pick["grad_accum"] * 16 * 4096 == 1048576
    assert png.read_bytes()[:4] == b"\x89PNG"
    args = (out / "training_args.yaml").read_text()
    assert f"gradient_accumulation_steps: {pick['grad_accum']}" in args
    # the AdamW the plan assumed, for Trainer and for the recipe
    assert res["adamw"] == "fused" and "optim: adamw_torch_fused" in args and "adamw: fused" in (out / "recipe.yaml").read_text()
    # the written set passes doctor, the AdamW check included
    from hfscale.doctor import check

    found = check(accelerate=out / "plan.yaml", args=out / "training_args.yaml", num_processes=16)
    assert [f for f in found if f.severity == "error"] == [] and "adamw-not-planned" not in {f.code for f in found}


def test_nothing_fits_says_by_how_much(cli):
    # 16 GB now fits with the long-context levers and everything offloaded; 4 GB cannot hold ZeRO-3's gathered
    # 262k-row embedding (and its gradient) alone
    r = cli("plan", "--model", "gemma-3-27b", "--seq-len", "8192", "--micro-batch", "1", "--gpus-per-node", "1",
            "--gpu-mem", "4GB", "--json", "--fast")
    assert r.returncode == 1
    out = json.loads(r.stdout)
    assert out["pick"] is None and "GB over 4 GB" in out["nothing_fits"]


@pytest.mark.parametrize("args, fix", [
    (["--model", "no-such-model", "--gpus-per-node", "8"], "gemma-3-27b"),
    (["--model", "gemma-3-1b", "--gpus-per-node", "0"], "at least 1"),
    (["--model", "gemma-3-1b", "--gpus-per-node", "8", "--gpu-mem=-80GB"], "positive"),
    (["--model", "gemma-3-1b", "--gpus-per-node", "8", "--gpu-mem", "lots"], "80GB"),
    (["--model", "gemma-3-1b", "--micro-batch", "0", "--gpus-per-node", "8"], "positive"),
])
def test_bad_input_exit_2(args, fix, cli, tmp_path):
    full = ["plan", "--seq-len", "1024", *(["--micro-batch", "1"] if "--micro-batch" not in args else []), *args, "--write", tmp_path / "w"]
    r = cli(*full)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert fix in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "w").exists()


def test_plan_for_27b_needs_no_weights():
    from hfscale.models import load_config

    d = dims_from_config(load_config("gemma-3-27b"))
    p = predict(d, Strategy(zero=3, dp=64, micro_batch=1, seq_len=8192, checkpointing="full"))
    assert p["params"] > 26e9 and p["total"] < 80e9


def test_lora_adapter_count_matches_peft_and_shrinks_states():
    from peft import LoraConfig, get_peft_model

    from hfscale.models import build_model
    from hfscale.plan.memory import lora_params

    m = build_model("tiny-gemma3")
    d = dims_from_config(m.config)
    pm = get_peft_model(m, LoraConfig(r=8, target_modules="all-linear"))  # on Gemma 3 all-linear = the 7 decoder linears
    assert lora_params(d, 8) == sum(p.numel() for p in pm.parameters() if p.requires_grad)
    full = model_state_bytes(d, Strategy(micro_batch=1, seq_len=8))
    lora = model_state_bytes(d, Strategy(micro_batch=1, seq_len=8, lora_rank=8))
    qlora = model_state_bytes(d, Strategy(micro_batch=1, seq_len=8, lora_rank=8, base_bits=4))
    assert lora["optimizer"] == 8 * lora_params(d, 8) < full["optimizer"] / 10
    assert qlora["weights"] < lora["weights"]


def test_inference_weights_and_kv(cli):
    r = cli("plan", "--model", "gemma-3-4b", "--seq-len", "1024", "--micro-batch", "1", "--inference", "--quant", "int4",
            "--context", "32768", "--json", "--fast")
    assert r.returncode == 0, r.stderr
    inf = json.loads(r.stdout)["inference"]
    assert inf["total"] == inf["weights"] + inf["kv_cache"]
    assert 2.5e9 < inf["weights"] < 4.5e9  # 3.2B decoder params at ~0.56 B + 0.67B embedding at 2 B
