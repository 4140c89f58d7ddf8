"""ExecuTorch .pte export of the trained tiny Gemma 3 with an in-program KV cache, checked in
executorch.runtime: logits vs eager, token-by-token greedy generation vs eager's."""

import json

import pytest

from hfscale.util.errors import HfscaleError
from hfscale.export import FORMATS
from hfscale.export.evalset import EvalSet

# 2 prompts of 80 tokens (> the 64-token sliding window, so the window-sized cache wraps)
ES = EvalSet(n_prompts=2, prompt_tokens=80, ppl_blocks=2, seq_len=128)


@pytest.fixture(scope="session")
def trained():
    from hfscale.testing.trained import trained_tiny

    return str(trained_tiny())


@pytest.fixture(scope="session")
def ptes(trained, tmp_path_factory):
    d = tmp_path_factory.mktemp("pte")
    # fp32 lowers in ~35 s, 8da4w in ~75 s on 2 cores
    return {q: FORMATS["pte"].export(trained, d / f"m-{q}.pte", q, False, evalset=ES, n_generate=24, progress=False)
            for q in ("fp32", "8da4w")}


def test_registry_contract():
    assert FORMATS["pte"].qtypes == ("fp32", "8da4w") and FORMATS["pte"].default_qtype == "8da4w"


def test_fp32_decode_matches_eager(ptes):
    v = ptes["fp32"]["verification"]
    # token-by-token through the cache vs one full eager forward: only float reassociation differs
    assert v["vs_eager_same_quantization"]["max_abs_dlogit"] < 5e-3  # measured 7e-4
    assert v["vs_eager_same_quantization"]["top1_agreement"] == 1.0
    assert v["vs_eager_same_quantization"]["positions"] == 160
    assert abs(v["perplexity"] / v["perplexity_transformers_fp32"] - 1) < 1e-4
    assert v["greedy"]["identical"] and len(v["greedy"]["pte"]) == 24
    # the latency is the median over every cached decode step of the prompts, one program call per token
    assert v["timed_decode_steps"] == v["vs_eager_same_quantization"]["positions"] == 160


def test_8da4w_matches_its_eager_and_is_smaller(ptes):
    v = ptes["8da4w"]["verification"]
    same = v["vs_eager_same_quantization"]
    assert same["max_abs_dlogit"] < 0.2 and same["top1_agreement"] >= 0.97  # measured 0.04 / 0.994
    assert v["greedy"]["identical"]
    assert abs(v["perplexity"] / v["perplexity_transformers_fp32"] - 1) < 0.1
    # int4 linears (+ fp32 embedding for lookup and for the untied-at-export head) vs fp32
    assert ptes["8da4w"]["bytes"] < 0.4 * ptes["fp32"]["bytes"]
    # the fp32 file holds every parameter in fp32 plus a second copy of the tied embedding
    src = ptes["fp32"]["source"]
    assert src["fp32_bytes"] < ptes["fp32"]["bytes"] < src["fp32_bytes"] + 4 * 4096 * 192 + 1_000_000
    side = json.loads(open(ptes["8da4w"]["out"] + ".json").read())
    assert side["scheme"]["qtype"] == "8da4w" and side["bytes"] == ptes["8da4w"]["bytes"]


def test_runtime_reads_the_file(ptes):
    from hfscale.export.pte import PteRunner

    r = PteRunner(ptes["fp32"]["out"])
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
