"""ExecuTorch .pte export with an in-program KV cache, checked in executorch.runtime: logits vs eager,
token-by-token greedy generation vs eager's. The trained tiny Gemma 3 at 8da4w (the default scheme, where
quality is worth measuring); fp32 programs of the smallest Gemma 4 (E2B's layer kinds) and Llama 3.x models,
where the program must compute what eager does to float rounding."""

import json
from pathlib import Path

import pytest

from hfscale.util.errors import HfscaleError
from hfscale.export import FORMATS
from hfscale.export.evalset import EvalSet

# 2 prompts of 80 tokens (> the 64-token sliding window, so the mask drops the oldest keys of sliding layers)
ES = EvalSet(n_prompts=2, prompt_tokens=80, ppl_blocks=2, seq_len=128)


@pytest.fixture(scope="session")
def trained():
    from hfscale.testing.trained import trained_tiny

    return str(trained_tiny())


@pytest.fixture(scope="session")
def pte_8da4w(trained, tmp_path_factory):
    # ~70 s of CPU on 2 cores; the fp32 path is checked on the families below (Gemma 3's fp32 export cost ~44 s
    # of CPU: Gemma 4 and Llama cost ~50 s together and cover more layer kinds)
    return FORMATS["pte"].export(trained, tmp_path_factory.mktemp("pte") / "m-8da4w.pte", "8da4w", False, evalset=ES,
                                 n_generate=24, progress=False)


def test_registry_contract():
    from hfscale.export.pte import ARCHS

    assert FORMATS["pte"].qtypes == ("fp32", "8da4w") and FORMATS["pte"].default_qtype == "8da4w"
    assert set(ARCHS) == {"gemma3_text", "gemma4_text", "llama"}  # each one exported and run in this file


def test_8da4w_matches_its_eager_and_is_smaller(pte_8da4w):
    v = pte_8da4w["verification"]
    same = v["vs_eager_same_quantization"]
    assert same["max_abs_dlogit"] < 0.2 and same["top1_agreement"] >= 0.97  # measured 0.04 / 0.994
    assert same["positions"] == 160 and v["greedy"]["identical"] and len(v["greedy"]["pte"]) == 24
    assert abs(v["perplexity"] / v["perplexity_transformers_fp32"] - 1) < 0.1
    # the latency is the median over every cached decode step of the prompts, one program call per token
    assert v["timed_decode_steps"] == same["positions"] == 160
    # int4 linears (+ fp32 embedding for lookup and for the untied-at-export head) vs the fp32 program, which
    # holds every parameter in fp32 plus a second copy of the tied 4096 x 192 embedding
    src = pte_8da4w["source"]
    assert pte_8da4w["bytes"] < 0.4 * (src["fp32_bytes"] + 4 * 4096 * 192)
    side = json.loads(open(pte_8da4w["out"] + ".json").read())
    assert side["scheme"]["qtype"] == "8da4w" and side["bytes"] == pte_8da4w["bytes"]


def test_runtime_reads_the_file(pte_8da4w):
    from hfscale.export.pte import PteRunner

    r = PteRunner(pte_8da4w["out"])
    a = r.logits([2, 561, 726, 501])
    b = r.logits([2, 561, 726, 501])  # restarting at position 0 reuses the cache correctly
    assert a.shape == (4, 4096) and (a == b).all()


def test_refusals_write_nothing(trained, tmp_path):
    out = tmp_path / "x.pte"
    with pytest.raises(HfscaleError, match="fp32, 8da4w"):
        FORMATS["pte"].export(trained, out, "int2", False)
    with pytest.raises(HfscaleError, match="max_seq_len"):
        FORMATS["pte"].export(trained, out, "fp32", False, max_seq_len=24)
    assert list(tmp_path.iterdir()) == []


def test_decode_program_builds_from_a_model_saved_by_training():
    """The recipe trains with checkpointing (use_cache=False in the saved config); the KV-cache decode
    module must still build from such a model (the demo's QAT -> .pte path hit this)."""
    from hfscale.export.pte import decode_module
    from hfscale.models import build_model

    m = build_model("tiny-gemma3").eval()
    m.config.use_cache = False
    mod = decode_module(m, 32)
    import torch

    with torch.no_grad():
        out = mod(input_ids=torch.tensor([[5]]), cache_position=torch.tensor([0]))
    assert out.shape[-1] == m.config.vocab_size


# --- families beyond Gemma 3: the smallest models that keep each architecture's distinct layers -----------------
# Random weights (seeded): nothing here measures quality, only that the program computes what eager does.
# 1 prompt of 40 tokens (> the 32-token sliding window of the Gemma 4 shape), one 48-token perplexity block.
FAMILY_ES = EvalSet(n_prompts=1, prompt_tokens=40, ppl_blocks=1, seq_len=48)
S, F = "sliding_attention", "full_attention"
# fp32 .pte vs eager, max |dlogit| (see test_family_fp32_decode_matches_eager): under half the smallest eager top-2
# gap on these seeded models' prompt positions and greedy steps (gemma4 1.4e-3, llama 1.6e-4: random weights give flat
# logits), so a program within TOL must also agree on every top-1 and greedy token
TOL = {"gemma4": 5e-4, "llama": 5e-5}
FAMILIES = {
    # E2B's layer kinds in 3 layers (Gemma 4 makes the last layer full): sliding and full attention (head 32 vs
    # global head 64, proportional RoPE on a quarter of the global head), one K/V head, per-layer embeddings (PLE),
    # and a last layer that reads layer 1's K/V cache (num_kv_shared_layers) with the double-wide MLP E2B gives
    # those layers; final logit soft-capping, tied embeddings
    "gemma4": ("Gemma4TextConfig", dict(num_hidden_layers=3, layer_types=[S, F, F], num_key_value_heads=1, head_dim=32,
                                        global_head_dim=64, sliding_window=32, hidden_size_per_layer_input=8,
                                        vocab_size_per_layer_input=4096, num_kv_shared_layers=1,
                                        use_double_wide_mlp=True, final_logit_softcapping=30.0)),
    # Llama 3.x (every layer alike, so one): GQA, "llama3" RoPE scaling, untied output head
    "llama": ("LlamaConfig", dict(num_hidden_layers=1, num_key_value_heads=2, tie_word_embeddings=False,
                                  rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 64})),
}


def _family_config(family: str, **overrides):
    """The architecture zoo's shape (hfscale.testing.zoo.SHAPE: hidden 128, 4 heads, MLP 256) with the family's
    layer kinds and the built-in tokenizer's vocabulary."""
    import transformers

    from hfscale.testing.zoo import SHAPE

    cls, kinds = FAMILIES[family]
    return getattr(transformers, cls)(**{**SHAPE, "vocab_size": 4096, "pad_token_id": 0, "eos_token_id": 1,
                                         "bos_token_id": 2, **kinds, **overrides})


def _save_family(family: str, out):
    import torch
    from transformers import AutoModelForCausalLM

    from hfscale.models import load_tokenizer

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_family_config(family)).save_pretrained(out)
    load_tokenizer("tiny-gemma3").save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_pte(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"pte-{request.param}")
    src = _save_family(request.param, d / "model")
    rec = FORMATS["pte"].export(src, d / "m.pte", "fp32", False, max_seq_len=48, evalset=FAMILY_ES, n_generate=16,
                                progress=False)
    return request.param, src, rec


def test_family_fp32_decode_matches_eager(family_pte):
    family, src, rec = family_pte
    v = rec["verification"]
    same = v["vs_eager_same_quantization"]
    # Token by token through the in-program cache with XNNPACK's fp32 kernels vs one eager ATen forward: only the
    # order of fp32 sums and XNNPACK's polynomial tanh / exp differ (each ~1e-6 relative, a few dozen ops deep).
    # Measured max |dlogit| 9.4e-6 (gemma4: GELU and soft-capping tanh; GELU spelled out by
    # export.pte.spell_out_tanh_gelu, 8e-4 before) and 5.7e-7 (llama) on logits |x| < 1.1: TOL leaves 50x / 90x.
    # A cache that loses the context moves them 1000x more (test_family_tolerance_sees_a_wrong_context).
    assert same["max_abs_dlogit"] < TOL[family] and same["top1_agreement"] == 1.0 and same["positions"] == 40
    assert abs(v["perplexity"] / v["perplexity_transformers_fp32"] - 1) < 1e-4
    assert v["greedy"]["identical"] and len(v["greedy"]["pte"]) == 16 and len(set(v["greedy"]["pte"])) > 1
    assert rec["source"]["model_type"] == {"gemma4": "gemma4_text", "llama": "llama"}[family]


def test_family_shape_keeps_its_layer_kinds(family_pte):
    """The fixture still has what sets the family apart (a config edit cannot silently drop a layer kind)."""
    family, src, rec = family_pte
    cfg = json.loads((Path(src) / "config.json").read_text())  # as saved: Gemma 4's per-layer fields stay readable
    if family == "gemma4":
        assert cfg["layer_types"] == [S, F, F] and cfg["num_kv_shared_layers"] == 1 and cfg["num_key_value_heads"] == 1
        assert cfg["head_dim"] == 32 and {p["head_dim"] for p in cfg["per_layer_config"].values()} == {64}
        assert cfg["hidden_size_per_layer_input"] > 0 and cfg["use_double_wide_mlp"] and cfg["final_logit_softcapping"]
        assert cfg["sliding_window"] < FAMILY_ES.prompt_tokens
    else:
        assert cfg["rope_parameters"]["rope_type"] == "llama3" and not cfg["tie_word_embeddings"]
        assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]
        # untied: the file holds each fp32 parameter once (no second embedding copy), plus < 1 MB of program
        assert rec["source"]["fp32_bytes"] < rec["bytes"] < rec["source"]["fp32_bytes"] + 1_000_000


def test_family_tolerance_sees_a_wrong_context(family_pte):
    """What a cache bug would do (the last token seen without the earlier context) moves the logits far more than
    the tolerance above, so that check can fail."""
    import torch

    from hfscale.export.evalset import eager_logits, prompt_ids
    from hfscale.models import load_for_eval

    family, src, _ = family_pte
    m, tok = load_for_eval(src)
    p = prompt_ids(tok, FAMILY_ES)[0]
    with torch.no_grad():
        full, tail = eager_logits(m, p)[-1], eager_logits(m, p[-8:])[-1]
    assert abs(full - tail).max() > 1000 * TOL[family]  # measured 1.1 (gemma4), 0.48 (llama)


def test_family_refusals_write_nothing(tmp_path):
    """What ExecuTorch cannot export is refused in one line, before anything is built or written."""
    from transformers import Qwen3Config

    cases = {
        # Gemma 4's MoE block routes tokens with aten.histc, outside the core ATen ops ExecuTorch lowers
        "moe": (_family_config("gemma4", enable_moe_block=True, num_experts=4, top_k_experts=2,
                               moe_intermediate_size=32), "enable_moe_block"),
        # "dynamic" RoPE recomputes its frequencies from the largest position: a data-dependent branch
        "dyn": (_family_config("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
                "rope_type 'dynamic'"),
        "qwen3": (Qwen3Config(vocab_size=4096), "supports model types gemma3_text, gemma4_text, llama "),
    }
    for name, (cfg, match) in cases.items():
        cfg.save_pretrained(tmp_path / name)  # a config is all the check reads
        with pytest.raises(HfscaleError, match=match) as e:
            FORMATS["pte"].export(str(tmp_path / name), tmp_path / f"{name}.pte", "fp32", False)
        assert "\n" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dyn", "moe", "qwen3"]
