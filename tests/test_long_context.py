"""ALST's levers (hfscale.scale.long_context) against the plain step, one process, fp32, on the tiny Gemma 3 and
the small Gemma 4 (global layers with other heads, k_eq_v, final soft-capping), 2 micro batches of 256 tokens
accumulated with a 1/2-scaled backward each (what accelerate and DeepSpeed do under accumulation).

Tolerances: loss 1e-5 absolute (loss ~8.3): the tiled loss sums 4 slices' fp32 sums instead of one mean, the
same numbers in another order (measured 9.5e-7); gradients 1e-6 absolute (largest 0.035 / 0.68): measured
1.1e-8 / 6.0e-8 for the tiled loss, 6.8e-9 / 4.1e-8 for the tiled MLP, 0 for the offload (the same tensors on a
CPU host). A lever that scaled the lm_head gradient wrongly (DeepSpeed's TiledFusedLogitsLoss under this 1/2
scale) is off by ~1e-2, four orders above. With the tiled RMSNorm, gradients within 4e-6: each norm's fp32 row
reductions run over a quarter of the rows per call (CPU kernels vectorise them differently) and a norm weight's
gradient is summed in 4 slices; measured 2.6e-8 (Gemma 3) and 8.6e-7 (Gemma 4: the embedding's gradient, largest
0.75, 1.2e-6 relative, ~14 fp32 ulps), the loss exactly equal. A wrong tile (a slice's rows normalised together, a
lost slice of a weight's gradient) is off by over 1e-3.
"""

import pytest

from hfscale.util.errors import ConfigError

MICRO, S = 2, 256


def _run(config_fn, levers, checkpointing, ids):
    import torch
    from transformers import AutoModelForCausalLM

    from hfscale.scale.checkpointing import apply_checkpointing_
    from hfscale.scale.long_context import apply_levers_, with_levers

    cfg = config_fn()
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).train()
    apply_checkpointing_(model, checkpointing)
    apply_levers_(model, levers)
    loss_fn = with_levers(lambda m, b: m(input_ids=b, labels=b).loss, levers, model)
    losses = []
    for i in range(MICRO):
        loss = loss_fn(model, ids[i:i + 1])
        (loss / MICRO).backward()
        losses.append(float(loss))
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return losses, grads, getattr(loss_fn, "offload", None)


@pytest.fixture(scope="module")
def ids():
    import torch

    torch.manual_seed(1)
    return torch.randint(3, 4096, (MICRO, S))


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_each_lever_equals_the_plain_step(family, ids):
    from hfscale.models import tiny_config, tiny_gemma4_config
    from hfscale.scale.long_context import Levers

    config_fn = {"gemma3": tiny_config, "gemma4": tiny_gemma4_config}[family]
    ref_losses, ref_grads, _ = _run(config_fn, Levers(), "full", ids)
    for levers, ckpt in ((Levers(tiled_loss=4), "off"), (Levers(tiled_mlp=4), "off"), (Levers(tiled_norm=4), "off"),
                         (Levers(offload_activations=True), "full"), (Levers(4, 4, True, 4), "full")):
        losses, grads, offload = _run(config_fn, levers, ckpt, ids)
        assert losses == pytest.approx(ref_losses, abs=1e-5), levers
        assert set(grads) == set(ref_grads) and all(g is not None for g in grads.values())
        worst = max(float((grads[n] - ref_grads[n]).abs().max()) for n in ref_grads)
        tol = 4e-6 if levers.tiled_norm else 1e-6
        assert worst <= tol < max(float(g.abs().max()) for g in ref_grads.values()), (levers, worst)
        if levers.offload_activations:  # what a GPU host would hold, as the plan counts it (measured within 12 B)
            from hfscale.models.dims import dims_from_config
            from hfscale.plan.long_context import lever_prediction
            from hfscale.plan.memory import Strategy

            s = Strategy(precision="fp32", seq_len=S, checkpointing=ckpt)
            planned = lever_prediction(dims_from_config(config_fn()), s, levers).host_bytes_per_rank
            assert abs(offload.host_bytes - MICRO * planned) <= 64, (offload.host_bytes, MICRO * planned)  # 24 B with
            # the tiled norm: its fp32 internals no longer saved, its input saved instead


def test_tiled_loss_returns_no_logits_and_evaluation_is_unchanged(ids):
    import torch
    from transformers import AutoModelForCausalLM

    from hfscale.models import tiny_config
    from hfscale.scale.long_context import tile_loss_

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(), dtype=torch.float32)
    plain = model(input_ids=ids[:1]).logits
    tile_loss_(model, 8)
    assert model(input_ids=ids[:1], labels=ids[:1]).logits is None
    assert torch.equal(model(input_ids=ids[:1]).logits, plain)


def test_lever_switches_are_validated_in_the_recipe_config(tmp_path):
    from hfscale.train.config import TrainConfig, load_recipe

    cfg = TrainConfig(tiled_loss=4, tiled_mlp=2, offload_activations=True, checkpointing="full", tiled_norm=3)
    assert (cfg.levers.tiled_loss, cfg.levers.tiled_mlp, cfg.levers.offload_activations) == (4, 2, True)
    assert cfg.levers.tiled_norm == 3
    with pytest.raises(ConfigError, match="tiled_norm must be an integer >= 0"):
        TrainConfig(tiled_norm=-2)
    with pytest.raises(ConfigError, match="set checkpointing: full"):
        TrainConfig(offload_activations=True)
    with pytest.raises(ConfigError, match="tiled_mlp must be an integer >= 0"):
        TrainConfig(tiled_mlp=-1)
    with pytest.raises(ConfigError, match="use at most 128"):
        TrainConfig(tiled_loss=1000, seq_len=128, global_batch_tokens=128)
    y = tmp_path / "r.yaml"
    y.write_text("tiled_loss: 8\noffload_activations: true\ncheckpointing: full\ntiled_norm: 4\n")
    assert load_recipe(str(y)).levers.offload_activations is True and load_recipe(str(y)).levers.tiled_norm == 4
    y.write_text("tiled_loss: many\n")
    with pytest.raises(ConfigError, match="tiled_loss: 'many' is not a valid int"):
        load_recipe(str(y))


def test_fake_trace_of_a_tiled_step_equals_memtracker_on_a_real_one():
    """The planner's trace (hfscale.plan.trace, fake tensors) runs the same tiled loss + MLP + RMSNorm as a real CPU
    step measured by torch's MemTracker (tiny Gemma 3, 2 x 256 tokens, fp32, no checkpointing): equal to the byte in
    every phase (measured). With full checkpointing it is equal to the byte too (measured here, 2 x 256 tokens: forward
    42,846,600, backward 57,037,812; without the tiled norm 43,242,632 and 58,435,188); it was 196,608 bytes (+0.45%)
    above in forward until trace._unpacked_rows (the S x S mask transformers built when it could not read fake
    position ids)."""
    from hfscale.models import tiny_config
    from hfscale.plan.trace import measure_steps, trace_step
    from hfscale.scale.long_context import Levers

    levers = Levers(tiled_loss=4, tiled_mlp=4, tiled_norm=4)
    real = measure_steps(tiny_config(), 2, S, "fp32", "sdpa", "off", steps=2, levers=levers)[1]
    traced = trace_step(tiny_config(), 2, S, "fp32", "sdpa", "off", levers=levers).phases(True)
    plain = trace_step(tiny_config(), 2, S, "fp32", "sdpa", "off").phases(True)
    three = trace_step(tiny_config(), 2, S, "fp32", "sdpa", "off", levers=Levers(4, 4)).phases(True)
    for ph in ("forward", "backward", "optimizer"):
        assert traced[ph].bytes == real[ph].bytes, ph
    # the levers are seen: 108.6 MB plain, 70.8 with the tiled loss + MLP, 63.3 with the tiled norm too
    assert traced["forward"].bytes < 0.92 * three["forward"].bytes < 0.85 * plain["forward"].bytes


def _llama_8b():
    from transformers import LlamaConfig

    from hfscale.models.dims import dims_from_config

    return dims_from_config(LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                        tie_word_embeddings=False))


def test_plan_llama_8b_with_the_levers_is_the_largest_phase_not_the_sum():
    """ALST's single-GPU case from the pure functions of hfscale.plan.long_context: ZeRO-3 with the weights and
    optimizer in host memory, full checkpointing, ALST's three levers and the tiled RMSNorm. The device peak is the
    model states left on the GPU plus the largest phase (the loss's slices, a layer's recomputed backward and Ulysses'
    buffers are never alive at once; the earlier plan summed them). With the three levers alone, at 524,288 tokens
    the largest is a layer's backward, whose RMSNorm backward holds four fp32 [T x h] temporaries (the fake-tensor
    trace names them: pow, div, mul, mul.Scalar): 105.9 GB per GPU, ALST's 500K does not fit (385,024 tokens do).
    With the norms tiled the layer's backward peaks in attention instead: 61.0 GB, and 696,320 tokens fit."""
    from dataclasses import replace

    from hfscale.plan.long_context import NORM_TEMPS, alst_levers, fits, lever_prediction, longest_sequence
    from hfscale.plan.memory import Strategy
    from hfscale.plan.planner import Hardware, peak_bytes
    from hfscale.scale.long_context import Levers

    d = _llama_8b()
    s = Strategy(zero=3, dp=1, offload="cpu", checkpointing="full", seq_len=524288)
    levers = alst_levers(d, s)
    three = alst_levers(d, s, norm=False)
    assert (levers.tiled_loss, levers.tiled_mlp, levers.tiled_norm) == (251, 128, 128)  # 1 GiB of fp32 logits;
    assert replace(levers, tiled_norm=0) == three  # 4,096-token MLP and norm slices
    lp, lp3, without = lever_prediction(d, s, levers), lever_prediction(d, s, three), lever_prediction(d, s, Levers())
    states = sum(lp.base[k] for k in ("weights", "gradients", "optimizer", "zero3_live"))
    assert lp.total == states + max(lp.phases.values()) < states + sum(lp.phases.values())
    assert lp3.peak_phase == "layer_backward" and lp3.changes["norm_backward"] == (NORM_TEMPS * 4 + 2) * 524288 * 4096
    assert lp.peak_phase == "layer_backward" and "attention_backward" in lp.changes and "norm_backward" not in lp.changes
    # the recomputed layer no longer saves its two norms' fp32 input copies and statistics
    assert lp3.changes["layer_saved"] - lp.changes["layer_saved"] == 2 * (4 * 524288 * 4096 + 4 * 524288)
    assert without.peak_phase == "loss" and without.changes["logits_saved"] == 4 * 524288 * 128256
    assert peak_bytes(lp.total) <= 80e9 < peak_bytes(lp3.total) < peak_bytes(without.total) / 10
    # the norms' saved internals leave host memory too (outside the recomputed layer: the final norm), and the time
    # model's host copies shrink by more than the norms' recompute adds
    assert 140e9 < lp.host_bytes_per_rank < lp3.host_bytes_per_rank and 1.0 < lp.time_factor < lp3.time_factor < 1.1
    hw = Hardware(1, 1, 80 * 10**9, 512 * 10**9)
    longest = longest_sequence(d, hw, lambda S: replace(s, seq_len=S), alst_levers, step=8192)
    longest3 = longest_sequence(d, hw, lambda S: replace(s, seq_len=S), lambda d, s: alst_levers(d, s, norm=False),
                                step=8192)
    assert 327680 <= longest3 < 524288 < longest
    assert fits(lever_prediction(d, replace(s, seq_len=longest), alst_levers(d, replace(s, seq_len=longest))),
                80 * 10**9, 512 * 10**9, 1)


def test_phase_model_bounds_the_fake_trace_of_each_phase():
    """phase_bytes against hfscale.plan.trace.phase_trace (transformers' own code on fake tensors, CUDA's flash
    attention, the tiled loss and MLP run for real; the trace equals MemTracker on real CPU steps) on a small Llama
    shaped like Llama-3.1-8B (MLP 3.5 x hidden, 4 query heads per K/V head), bf16, full checkpointing, 8,192 tokens,
    with and without the activation offload (traced as save_on_cpu moves tensors off a GPU): each phase planned at or
    above the traced one. Measured here: forward +79% / +97%, loss +15% / +18%, layers +9.4% / +15%; with the
    RMSNorms tiled too (the layers' traced peak 191.3 -> 102.1 MB without the offload): forward +69% / +78%, layers
    +27% / +29% (the recomputed layer's saved set counted whole at attention's backward); at Llama-3.1-8B's full
    per-rank size (benchmarks/results/long_context.md) see there."""
    import itertools

    from transformers import LlamaConfig

    from hfscale.models.dims import dims_from_config
    from hfscale.plan.long_context import phase_bytes
    from hfscale.plan.memory import Strategy
    from hfscale.plan.trace import phase_trace
    from hfscale.scale.long_context import Levers

    cfg = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1792, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=64, tie_word_embeddings=False, max_position_embeddings=8192)
    layers = {}
    for offload, norm in itertools.product((False, True), (0, 16)):
        levers = Levers(tiled_loss=4, tiled_mlp=16, offload_activations=offload, tiled_norm=norm)
        traced = phase_trace(cfg, 8192, "bf16", "full", levers, kernels="cuda")
        planned = {k: sum(v.values()) for k, v in
                   phase_bytes(dims_from_config(cfg), Strategy(seq_len=8192, checkpointing="full"), levers).items()}
        for ph, tk, most in (("forward", "forward", 1.0), ("loss", "loss", 0.25),
                             ("layer_backward", "layers", 0.35 if norm else 0.2)):
            assert traced[tk] <= planned[ph] <= (1 + most) * traced[tk], (offload, norm, ph, traced[tk], planned[ph])
        layers[offload, norm] = traced["layers"]
    assert layers[True, 0] < layers[False, 0] - 8192 * 512 * 2  # the layer inputs left the traced device
    assert layers[False, 16] < 0.6 * layers[False, 0]  # the norms' fp32 internals one slice at a time: -47%


def test_per_layer_heads_patches_deepspeed_only_for_models_whose_layers_differ():
    """hfscale.scale.ulysses.per_layer_heads wraps DeepSpeed's registration for Gemma 4 only, and restores it (the
    wrapped path itself runs in tests/test_parallel_engine.py's SP launch)."""
    import torch
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers import AutoModelForCausalLM

    from hfscale.models import tiny_config, tiny_gemma4_config
    from hfscale.scale.ulysses import heterogeneous, per_layer_heads

    original = UlyssesSPAttentionHF.__dict__["register_with_transformers"]
    for config_fn, patched in ((tiny_config, False), (tiny_gemma4_config, True)):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config_fn())
        assert heterogeneous(model.config) is patched
        with per_layer_heads(model):
            assert (UlyssesSPAttentionHF.__dict__["register_with_transformers"] is not original) is patched
        assert UlyssesSPAttentionHF.__dict__["register_with_transformers"] is original


def test_plan_picks_the_levers_where_nothing_else_fits(tmp_path, cli):
    """`hfscale plan` ranks the levers as candidates when plain ZeRO / SP cannot fit: Llama-3.1-8B at ALST's 524,288
    tokens on one 80 GB GPU (plain ZeRO-3 fits 32,768; 524,288 fits with the norms tiled: 61.0 GB, see above) and
    Gemma 4 31B at 256K on 4 x 8 x 80 GB (SP4 now); the pick's per-GPU and host memory are printed, and --write emits the
    recipe switches, the tiled norm's among them."""
    import json

    import yaml

    d = tmp_path / "llama8b"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
        "tie_word_embeddings": False}))
    r = cli("plan", "--model", d / "config.json", "--seq-len", "524288", "--micro-batch", "1", "--gpus-per-node", "1",
            "--gpu-mem", "80GB", "--fast", "--json", "--write", tmp_path / "w")
    assert r.returncode == 0, r.stderr
    pick = json.loads(r.stdout)["pick"]
    assert pick["levers"] == "tiled+offload" and pick["fits"] and 55e9 < pick["peak_bytes"] <= 80e9
    assert 100e9 < pick["cpu_bytes_per_node"] <= 512e9  # offloaded states + activations in host memory
    recipe = yaml.safe_load((tmp_path / "w" / "recipe.yaml").read_text())
    assert recipe["tiled_loss"] > 1 and recipe["tiled_mlp"] > 1 and recipe["offload_activations"] is True
    assert recipe["tiled_norm"] == 128 and recipe["seq_len"] == 524288
    r = cli("plan", "--model", "gemma-4-31b", "--seq-len", "262144", "--micro-batch", "1", "--gpus-per-node", "8",
            "--nodes", "4", "--gpu-mem", "80GB", "--fast")
    # SP4 with the norms tiled (66.5 GB per GPU); SP8 without them
    assert r.returncode == 0 and "pick: ZeRO-3 SP4 +tiled" in r.stdout and "GB per GPU" in r.stdout, r.stdout[-800:]
