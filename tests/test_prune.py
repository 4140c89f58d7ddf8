"""hfscale.compress.prune and `hfscale prune`: a pruned model computes exactly what the unpruned one
computes with the removed layers skipped and the removed heads / MLP channels masked to zero (so the
slicing is right, for every supported family), its directory loads with plain transformers, and
impossible targets are refused in one line with nothing written."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from hfscale.compress.prune import PruneTarget, choose_layers, prune

S, F = "sliding_attention", "full_attention"


def _gemma4():
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(vocab_size=4096, vocab_size_per_layer_input=4096, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
                            layer_types=[S, S, F] * 2, sliding_window=16, hidden_size_per_layer_input=0,
                            num_kv_shared_layers=0, final_logit_softcapping=30.0, max_position_embeddings=512)


def _llama():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)


def _qwen2():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=512)


def _qwen3():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, max_position_embeddings=512)


def _gemma3():
    from hfscale.models import tiny_config

    return tiny_config()


CONFIGS = {"gemma3": _gemma3, "gemma4-dense": _gemma4, "llama": _llama, "qwen2": _qwen2, "qwen3": _qwen3}


@pytest.fixture(scope="module")
def calib():
    from hfscale.compress.evaluate import calibration_blocks
    from hfscale.models import load_tokenizer

    return calibration_blocks(load_tokenizer("tiny-gemma3"), 4, 48)


def _build(cfg):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # a random init's norms are all 1 (Gemma: 0): give them something to carry
        for n, p in m.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    return m


def _rows_in(new, old):
    """Index in `old` of every row of `new` (the pruned tensor is made of exact copies)."""
    return [int(((old - r).abs().sum(-1) == 0).nonzero()[0]) for r in new]


def _masked_reference(model, small, kept_layers, x):
    """The unpruned model with the pruned model's removed layers skipped and removed heads / MLP channels zeroed."""
    hooks = []
    for i, layer in enumerate(model.model.layers):
        if i not in kept_layers:
            hooks.append(layer.register_forward_hook(lambda m, a, k, o: a[0] if a else k["hidden_states"], with_kwargs=True))
            continue
        new = small.model.layers[kept_layers.index(i)]
        hd = layer.self_attn.head_dim
        heads = _rows_in(new.self_attn.q_proj.weight.view(-1, hd * model.config.hidden_size),
                         layer.self_attn.q_proj.weight.view(-1, hd * model.config.hidden_size))
        chans = _rows_in(new.mlp.gate_proj.weight, layer.mlp.gate_proj.weight)
        hmask = torch.zeros(layer.self_attn.q_proj.out_features // hd)
        hmask[heads] = 1
        cmask = torch.zeros(layer.mlp.down_proj.in_features)
        cmask[chans] = 1
        hooks.append(layer.self_attn.o_proj.register_forward_pre_hook(
            lambda m, a, hm=hmask, hd=hd: (a[0] * hm.repeat_interleave(hd),)))
        hooks.append(layer.mlp.down_proj.register_forward_pre_hook(lambda m, a, cm=cmask: (a[0] * cm,)))
    try:
        with torch.no_grad():
            return model(input_ids=x).logits
    finally:
        for h in hooks:
            h.remove()


@pytest.mark.parametrize("family", CONFIGS)
def test_pruned_equals_skipped_layers_and_masked_channels(family, calib):
    cfg = CONFIGS[family]()
    model = _build(cfg)
    L = cfg.num_hidden_layers
    small, r = prune(model, PruneTarget(layers=L - 2, heads=2, intermediate_size=64), calib)
    assert (small.config.num_hidden_layers, small.config.num_attention_heads, small.config.intermediate_size) == (L - 2, 2, 64)
    assert len(r.kept_layers) == L - 2 and r.params_after == sum(p.numel() for p in small.parameters()) < r.params_before
    if getattr(cfg, "layer_types", None):  # each kept layer keeps its type; a global layer survives
        assert list(small.config.layer_types) == [cfg.layer_types[i] for i in r.kept_layers]
        assert F in small.config.layer_types
    if family == "gemma4-dense":  # its last layer must stay full attention
        assert r.kept_layers[-1] == L - 1
        assert small.model.layers[-1].self_attn.k_proj.out_features == 1 * 32  # the global layer's single KV head
    x = calib[:2, :40]
    with torch.no_grad():
        got = small(input_ids=x).logits
    want = _masked_reference(model, small, list(r.kept_layers), x)
    assert torch.allclose(got, want, atol=2e-5, rtol=1e-5), (got - want).abs().max()


@pytest.mark.parametrize("family", ["gemma3", "gemma4-dense", "llama", "qwen3"])
def test_params_target_saves_a_directory_plain_transformers_loads(family, calib, tmp_path):
    from hfscale.compress.save import save_model_dir

    model = _build(CONFIGS[family]())
    small, r = prune(model, PruneTarget(params=0.5), calib)
    assert 0.40 <= r.fraction <= 0.5, r.fraction
    assert small.config.hidden_size < model.config.hidden_size and small.config.hidden_size % 32 == 0
    # hidden channels kept are exact columns of the original embedding
    cols = _rows_in(small.model.embed_tokens.weight.T, model.model.embed_tokens.weight.T)
    assert cols == sorted(cols) and len(set(cols)) == small.config.hidden_size
    out = tmp_path / "pruned"
    save_model_dir(small, out, extra_files={"hfscale_prune.json": r.to_json()})
    code = ("import sys, torch; from transformers import AutoModelForCausalLM; "
            f"m = AutoModelForCausalLM.from_pretrained({str(out)!r}).eval(); assert 'hfscale' not in sys.modules; "
            "print(sum(p.numel() for p in m.parameters()), m.config.hidden_size, m.config.intermediate_size)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    n, h, i = map(int, res.stdout.split()[-3:])
    assert (n, h, i) == (r.params_after, small.config.hidden_size, small.config.intermediate_size)
    assert json.loads((out / "hfscale_prune.json").read_text())["params_after"] == n


def test_layer_choice_keeps_a_global_layer():
    from hfscale.models import tiny_config

    cfg = tiny_config()  # S S S F; the full-attention layer scores lowest
    assert choose_layers(cfg, [0.5, 0.4, 0.3, 0.1], 2) == [0, 3]
    assert choose_layers(cfg, [0.5, 0.4, 0.3, 0.1], 3) == [0, 1, 3]
    assert choose_layers(cfg, [0.1, 0.4, 0.3, 0.5], 2) == [1, 3]


def test_cli_prune_tiny_and_refusals(cli, tmp_path, capfd):
    out = tmp_path / "half"
    r = cli("prune", "tiny-gemma3", "--out", out, "--params", "0.5x", "--calib-blocks", "4", "--seq-len", "64")
    assert r.returncode == 0, r.stderr
    assert "3,001,920 -> 1,460,736 parameters (0.487x)" in r.stdout
    # fp32, same weights: 0.0 here; a reloaded (differently aligned) copy may take another GEMM blocking on other
    # hosts, which moves logits of ~10 by float32's last bits (~1e-6), never 1e-5
    assert float(re.search(r"max \|dlogit\| ([0-9.e+-]+)", r.stdout).group(1)) < 1e-5, r.stdout
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (128, 416, 4)
    assert (out / "tokenizer.json").is_file() and (out / "hfscale_prune.json").is_file()
    before = sorted(p.name for p in tmp_path.iterdir())
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(gpt2)
    for model, args, needle in [("tiny-gemma3", ["--layers", "9"], "the model has 4"),
                                ("tiny-gemma3", ["--heads", "3"], "cannot be split into KV groups"),
                                ("tiny-gemma3", ["--params", "1.5x"], "between 0 and 1"),
                                ("tiny-gemma3", [], "nothing to prune to"),
                                (gpt2, ["--layers", "1"], "supports model types"),
                                ("tiny-gemma3", ["--params", "0.5x", "--out", out], "exists; pass --force")]:
        code, err = _main(capfd, "prune", str(model), "--out", str(tmp_path / "x"), "--calib-blocks", "2", "--seq-len", "32",
                          *map(str, args))
        assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err and "Traceback" not in err, (args, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(before + ["gpt2"])  # nothing else written


def _main(capfd, *argv):
    from hfscale.cli import main

    capfd.readouterr()
    code = main(list(argv))
    return code, capfd.readouterr().err
