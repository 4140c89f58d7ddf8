"""The MoE serving plan (hfscale/plan/moe_serving.py): exact byte arithmetic for Gemma 4 26B-A4B, Che's
LRU approximation against a simulated LRU, routing measured on a real model, and the GGUF size it
predicts against a file hfscale wrote."""

import json
import random

import pytest

from hfscale.cli import main
from hfscale.plan.moe_serving import Routing, lru_traffic

EXPERT_26B = 3 * 2816 * 704 * 2  # gate_up 2x704x2816 + down 2816x704, bf16 = 11,894,784 bytes


def _plan(capsys, *extra, rc=0):
    got = main(["plan", "--model", "gemma-4-26b-a4b", "--seq-len", "4096", "--micro-batch", "1", "--inference", "--json", "--fast",
                *extra])
    out = capsys.readouterr().out
    assert got == rc
    return json.loads(out)["moe_serving"]


def test_26b_a4b_bytes_budget_and_llama_cpp(capsys):
    m = _plan(capsys, "--ram-budget", "4GB")
    assert m["expert_bytes"] == EXPERT_26B
    assert m["streamed_bytes"] == 30 * 128 * EXPERT_26B  # 45.7 GB of the 50.5 GB model streams
    assert m["min_budget"] == 8 * EXPERT_26B and m["cache_experts"] == 4 * 10**9 // EXPERT_26B == 336
    assert m["routing"] == "uniform (config only)"
    at_budget = m["traffic"][0]
    assert at_budget["cache_experts"] == 336
    # uniform routing: hit rate = cached share, 240 requests/token x (1 - 336/3840) read
    assert at_budget["hit_rate"] == pytest.approx(336 / 3840, abs=1e-9)
    assert at_budget["reads_per_token"] == pytest.approx(240 * (1 - 336 / 3840), rel=1e-9)
    fits = {round(f["gpu_mem"] / 1e9): f["n_cpu_moe"] for f in m["llama_cpp"]}
    assert fits[80] == 0 and fits[8] == 29 and fits[24] == 18  # bf16: 50.5 GB file, 1.52 GB of experts per layer
    # with hardware given the training candidates are ranked too (one 12 GB GPU: ZeRO-3 with every state offloaded)
    m = _plan(capsys, "--quant", "int4", "--gpus-per-node", "1", "--gpu-mem", "12GB")
    assert [(f["gpu_mem"], f["n_cpu_moe"]) for f in m["llama_cpp"]] == [(12 * 10**9, 9)]
    assert "--n-cpu-moe 9" in m["llama_cpp"][0]["flag"]


def test_che_approximation_against_a_simulated_lru():
    """Tokens drawn independently (what the approximation assumes): each layer picks k distinct experts
    with Pareto-skewed popularity; the routing statistics are counted from the stream, as measure_routing
    counts them, and the predicted hit rate is compared with an LRU run on the same stream."""
    rng = random.Random(0)
    layers, experts, k, tokens = 4, 32, 4, 6000
    weights = [[rng.paretovariate(1.2) for _ in range(experts)] for _ in range(layers)]
    stream = []
    for _ in range(tokens):
        for layer, row in enumerate(weights):
            chosen = set()
            while len(chosen) < k:
                chosen.add(rng.choices(range(experts), row)[0])
            stream += [(layer, e) for e in sorted(chosen)]
    counts = {}
    for key in stream:
        counts[key] = counts.get(key, 0) + 1
    freq = tuple(tuple(counts.get((l, e), 0) / tokens for e in range(experts)) for l in range(layers))
    for capacity in (16, 40, 80):
        cache, hits = {}, 0
        for key in stream:
            if key in cache:
                hits += 1
                cache[key] = cache.pop(key)
            else:
                cache[key] = True
                if len(cache) > capacity:
                    cache.pop(next(iter(cache)))
        predicted = lru_traffic(Routing(freq, "test"), capacity, 1000)
        # measured: predicted 0.246 / 0.513 / 0.796 vs LRU 0.215 / 0.498 / 0.787 (distinct picks within a
        # token are not independent requests, the approximation's one misfit)
        assert predicted.hit_rate == pytest.approx(hits / len(stream), abs=0.04), capacity
        assert predicted.reads_per_token == pytest.approx(layers * k * (1 - predicted.hit_rate))
    assert lru_traffic(Routing(freq, "t"), layers * experts, 1000).read_bytes_per_token == 0


def test_routing_measured_on_the_model(tmp_path, capsys):
    from hfscale.testing.tiny_moe import build_tiny_moe

    path = build_tiny_moe(tmp_path / "m")
    rc = main(["plan", "--model", path, "--seq-len", "128", "--micro-batch", "1", "--inference", "--json", "--fast",
               "--routing-blocks", "2", "--ram-budget", "2MB"])
    m = json.loads(capsys.readouterr().out)["moe_serving"]
    assert rc == 0 and m["routing"] == "measured on 256 calibration tokens"
    assert m["cache_experts"] == 2 * 10**6 // (3 * 128 * 64 * 2)  # bf16 plan of the fp32 model: 49,152 B/expert


def test_gguf_bytes_predicted_against_the_file(tmp_path):
    from hfscale.testing.tiny_moe import build_tiny_moe
    from hfscale.export.gguf import GGUFOptions, write_gguf
    from hfscale.models import load_for_eval, load_config
    from hfscale.models.dims import dims_from_config
    from hfscale.plan.moe_serving import _gguf_bytes

    path = build_tiny_moe(tmp_path / "m")
    model, tok = load_for_eval(path)
    d = dims_from_config(load_config(path))
    for q in ("F16", "Q4_0"):
        write_gguf(model, tok, tmp_path / f"{q}.gguf", GGUFOptions(q), progress=False)
        size = (tmp_path / f"{q}.gguf").stat().st_size
        predicted, _ = _gguf_bytes(d, q)
        assert 0 < size - predicted < 150_000, q  # the rest: vocabulary metadata (4,096 tokens) and the header
