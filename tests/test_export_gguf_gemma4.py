"""GGUF export of tiny Gemma 4 text models, checked in llama.cpp itself against transformers.

Two tiny models keep the features llama.cpp's gemma4 graph implements:
- "e2b-like" (the E2B/E4B family): sliding + full layers with different head sizes (head_dim vs
  global_head_dim), single-KV-head GQA, proportional RoPE (partial_rotary_factor 0.25) on full
  layers, per-layer embeddings (PLE), the last layers reusing earlier layers' KV cache
  (num_kv_shared_layers), a double-wide MLP on those layers, final logit softcapping, tied embeddings.
- "31b-like": keys double as values on full layers (attention_k_eq_v, no v_proj) with their own
  KV head count (num_global_key_value_heads), no PLE, no KV sharing.

Why train: a random init has near-uniform logits (perplexity ~ vocab size), so top-1 is decided by
gaps smaller than fp16 rounding and agreement measures noise (measured 0.98 top-1 at F16, 0.92 at
Q8_0 with initializer_range 0.1). 50 AdamW steps (~25 s) make the next-token distribution peaked
(perplexity ~830 of 4096) so agreement means something. Norm weights are jittered and
`layer_scalar` set away from 1 before training, so that the norm convention (Gemma 4 stores w,
not 1 + w) and the per-layer output scale are exercised (training alone would barely move them).
"""

import json

import gguf
import numpy as np
import pytest

from hfscale.util.errors import HfscaleError
from hfscale.export import FORMATS
from hfscale.export.evalset import EvalSet
from hfscale.export.gguf import check_supported

ES = EvalSet(n_prompts=4, prompt_tokens=96, ppl_blocks=4, seq_len=128)  # 96 > the 64-token window
S, F = "sliding_attention", "full_attention"


def _config(**overrides):
    from transformers import Gemma4TextConfig

    base = dict(
        vocab_size=4096,  # the built-in tiny-gemma3 tokenizer
        vocab_size_per_layer_input=4096,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        global_head_dim=64,
        layer_types=[S, S, F] * 2,
        sliding_window=64,
        hidden_size_per_layer_input=32,
        num_kv_shared_layers=3,  # layers 3-5 read the caches of layers 1 (sliding) and 2 (full)
        use_double_wide_mlp=True,
        final_logit_softcapping=30.0,
        max_position_embeddings=2048,
    )
    return Gemma4TextConfig(**{**base, **overrides})


CONFIGS = {
    "e2b-like": {},
    "31b-like": dict(attention_k_eq_v=True, num_key_value_heads=2, num_global_key_value_heads=1,
                     hidden_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False),
}


def _build(cfg, out, steps: int):
    """Seeded init, jittered norms and layer scalars, `steps` of AdamW on the built-in corpus, saved
    as a transformers directory with the tiny-gemma3 tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    from hfscale.data.corpus import load_text, packed_blocks
    from hfscale.models import load_tokenizer

    tok = load_tokenizer("tiny-gemma3")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.mul_(1 + 0.1 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.fill_(0.5 + torch.rand(1, generator=g).item())
    blocks = packed_blocks(tok, load_text()["train"]["text"], 128)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        batch = blocks[torch.randint(len(blocks), (8,), generator=g)]
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def e2b_like(tmp_path_factory):
    return _build(_config(**CONFIGS["e2b-like"]), tmp_path_factory.mktemp("g4-e2b"), steps=50)


@pytest.fixture(scope="module")
def exports(e2b_like, tmp_path_factory):
    d = tmp_path_factory.mktemp("g4-gguf")
    return {q: FORMATS["gguf"].export(e2b_like, d / f"m-{q}.gguf", q, False, evalset=ES, progress=False)
            for q in ("F16", "Q8_0")}


def _ratio(v):
    return v["perplexity"] / v["perplexity_transformers_fp32"]


def test_f16_matches_transformers_in_llama_cpp(exports):
    v = exports["F16"]["verification"]
    # 4 held-out prompts, 4 texts with one added token each (<pad> <eos> <bos> <unk>), all of them in a row
    assert v["tokenizer"] == {"texts": 14, "identical": 14}  # + the 5 evalset.PROBE texts
    assert v["vs_transformers"]["positions"] == 4 * 96
    assert v["vs_transformers"]["top1_agreement"] >= 0.99  # measured 1.0
    assert v["vs_transformers"]["max_abs_dlogit"] < 0.02  # measured 0.0038: fp16 weights/activations only
    assert abs(_ratio(v) - 1) < 1e-3  # measured 832.245 vs 832.238
    assert v["perplexity_transformers_fp32"] < 1500  # trained: far from uniform (4096)


def test_q8_0_quality_and_sizes(exports):
    v = exports["Q8_0"]["verification"]
    assert v["vs_transformers"]["top1_agreement"] >= 0.95  # measured 0.990 (max|dlogit| 0.075)
    assert abs(_ratio(v) - 1) < 0.02  # measured 832.38 vs 832.24
    n = exports["F16"]["source"]["parameters"]
    sizes = {q: r["bytes"] for q, r in exports.items()}
    # F16: 2 bytes/param (+ F32 norms, layer scalars, rope factors, ~100 KB of vocab metadata)
    assert 2 * n < sizes["F16"] < 2 * n + 300_000
    # Q8_0: 34 bytes / 32 weights, the token and per-layer embeddings included
    assert sizes["Q8_0"] < 0.6 * sizes["F16"]
    assert exports["Q8_0"]["scheme"]["tensor_types"] == {"Q8_0": 51, "F32": 48}


def test_sidecar_and_file_metadata(exports):
    r = exports["F16"]
    side = json.loads(open(r["out"] + ".json").read())
    assert side["bytes"] == r["bytes"] and side["source"]["model_type"] == "gemma4_text"
    assert side["verification"]["perplexity"] == r["verification"]["perplexity"]
    # transformers' gemma4 GGUF reader cannot read this back faithfully: reported, not measured
    assert side["verification"]["transformers_gguf_reload"]["supported"] is False

    rd = gguf.GGUFReader(r["out"])

    def field(key):
        f = rd.fields[f"gemma4.{key}"]
        return [f.parts[i].tolist() for i in f.data] if len(f.data) > 1 else f.parts[f.data[0]].tolist()

    assert bytes(rd.fields["general.architecture"].parts[-1]).decode() == "gemma4"
    assert field("attention.sliding_window_pattern") == [[1], [1], [0]] * 2
    assert field("attention.shared_kv_layers") == [3]
    assert field("feed_forward_length") == [[512]] * 3 + [[1024]] * 3  # double-wide on shared-KV layers
    assert (field("attention.key_length"), field("attention.key_length_swa")) == ([64], [32])
    assert field("embedding_length_per_layer_input") == [32]
    tensors = {t.name: t for t in rd.tensors}
    assert "output.weight" not in tensors  # tied: llama.cpp reuses token_embd
    # proportional RoPE, partial_rotary_factor 0.25 of a 64-wide head: 8 of 32 pairs rotate
    np.testing.assert_array_equal(tensors["rope_freqs.weight"].data, np.float32([1.0] * 8 + [1e30] * 24))
    assert float(tensors["blk.0.layer_output_scale.weight"].data[0]) != 1.0
    assert "blk.3.attn_k.weight" not in tensors  # a KV-sharing layer has no K/V projections


def test_k_eq_v_full_layers_f16(tmp_path):
    model = _build(_config(**CONFIGS["31b-like"]), tmp_path / "m", steps=30)
    r = FORMATS["gguf"].export(model, tmp_path / "k.gguf", "F16", False, evalset=ES, progress=False)
    v = r["verification"]
    assert v["vs_transformers"]["top1_agreement"] >= 0.99  # measured 1.0
    assert v["vs_transformers"]["max_abs_dlogit"] < 0.02  # measured 0.0084
    assert abs(_ratio(v) - 1) < 1e-3  # measured 1148.312 vs 1148.309
    rd = gguf.GGUFReader(r["out"])
    kv = rd.fields["gemma4.attention.head_count_kv"]
    assert [kv.parts[i].tolist() for i in kv.data] == [[2], [2], [1]] * 2  # per layer: full layers have 1
    assert "blk.2.attn_v.weight" not in {t.name for t in rd.tensors}  # k=v on full layers


@pytest.mark.parametrize("overrides, message", [
    (dict(enable_moe_block=True, num_experts=4, top_k_experts=8, moe_intermediate_size=64), "top_k_experts=8"),
    (dict(layer_types=[S, F, S, S, S, F]), "sliding then full"),  # shared block preceded by full, sliding
    (dict(hidden_activation="silu"), "gelu_pytorch_tanh"),
    (dict(rope_parameters={S: {"rope_type": "default", "rope_theta": 1e4},
                           F: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}), "rope_type 'linear'"),
])
def test_unsupported_gemma4_refused_in_one_line(overrides, message, tmp_path):
    cfg = _config(**overrides)
    with pytest.raises(HfscaleError, match=message) as e:
        check_supported(cfg)
    assert "\n" not in str(e.value) and "Gemma 4 text decoders:" in str(e.value)
    cfg.save_pretrained(tmp_path / "m")  # through the export entry point: refused before anything is written
    with pytest.raises(HfscaleError, match=message):
        FORMATS["gguf"].export(str(tmp_path / "m"), tmp_path / "x.gguf", "F16", False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
