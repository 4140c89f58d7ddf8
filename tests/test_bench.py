"""`hfscale bench` on real artifacts in their runtimes (llama.cpp, executorch.runtime, transformers):
structure and consistency of what it reports (bytes = file sizes, tokens counted, medians of the
runs, ratios of the medians), never timing thresholds; tiny token counts."""

from __future__ import annotations

import json
import statistics

import pytest


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    from hfscale.export import export_gguf, export_pte
    from hfscale.models import save_pretrained_dir
    from hfscale.testing.pruned import one_layer_tiny

    d = tmp_path_factory.mktemp("bench")
    save_pretrained_dir("tiny-gemma3", d / "teacher")
    one_layer_tiny(d / "one_layer")  # a 1-layer model lowers to .pte quickly
    export_gguf(str(d / "teacher"), d / "teacher-Q4_0.gguf", "Q4_0", verify=False, progress=False)
    export_pte(str(d / "one_layer"), d / "one_layer.pte", "fp32", max_seq_len=32, verify=False, progress=False)
    return d


def _check_run_consistency(res: dict, prompt: int, decode: int, threads: int):
    runs = res["per_run"]
    assert res["runs"] == len(runs) and res["threads"] == threads == runs[0]["threads"]
    for r in runs:
        assert r["prefill_tokens"] == prompt and r["decode_tokens"] == decode
        assert r["ttft_s"] >= r["prefill_s"] > 0 and r["decode_s"] > 0
        assert r["prefill_tokens_per_s"] == pytest.approx(prompt / r["prefill_s"])
        assert r["peak_rss_bytes"] > r["baseline_rss_bytes"] > 0  # loading the artifact took memory in that process
    for m in ("prefill_tokens_per_s", "decode_tokens_per_s", "ttft_s"):
        assert res[m] == pytest.approx(statistics.median(r[m] for r in runs))
        assert res["spread"][m]["min"] <= res[m] <= res["spread"][m]["max"]


def test_bench_gguf_against_transformers(cli, artifacts):
    from hfscale.compress.save import dir_bytes

    gguf, ref = artifacts / "teacher-Q4_0.gguf", artifacts / "teacher"
    r = cli("bench", ref, "--compare", gguf, "--json", "--runs", "2", "--prompt-tokens", "24", "--decode-tokens", "8",
            "--threads", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    a, b = out["a"], out["b"]
    assert (a["kind"], b["kind"]) == ("transformers", "gguf")
    assert a["bytes"] == dir_bytes(ref) and b["bytes"] == gguf.stat().st_size
    for res in (a, b):
        _check_run_consistency(res, 24, 8, 1)
        assert {"prefill_tokens_per_s", "decode_tokens_per_s", "ttft_s", "peak_rss_bytes", "bytes", "threads", "runs"} <= set(res)
    for m in ("prefill_tokens_per_s", "decode_tokens_per_s", "ttft_s", "peak_rss_bytes"):
        assert out["ratios_b_over_a"][m] == pytest.approx(b[m] / a[m])
    assert out["ratios_b_over_a"]["bytes"] == pytest.approx(b["bytes"] / a["bytes"]) and b["bytes"] < a["bytes"]
    assert out["host"]["cpu_capability"] and out["host"]["threads"] == 1


def test_bench_pte_steps_one_token_per_call(cli, artifacts):
    pte = artifacts / "one_layer.pte"
    r = cli("bench", pte, "--runs", "1", "--prompt-tokens", "16", "--decode-tokens", "8", "--threads", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "prefill is 16 single-token steps" in r.stdout and "| pte |" in r.stdout
    r = cli("bench", pte, "--json", "--runs", "1", "--prompt-tokens", "16", "--decode-tokens", "8", "--threads", "1")
    res = json.loads(r.stdout)
    assert res["bytes"] == pte.stat().st_size and res["kind"] == "pte"
    _check_run_consistency(res, 16, 8, 1)


def test_bench_refusals(cli, artifacts, tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    for args, needle in [([tmp_path / "missing.gguf"], "not found"),
                         ([tmp_path / "notes.txt"], "is not a .gguf file"),
                         ([artifacts / "one_layer.pte", "--prompt-tokens", "30", "--decode-tokens", "8"], "32-token KV cache"),
                         ([artifacts / "teacher-Q4_0.gguf", "--runs", "0"], "must be >= 1")]:
        r = cli("bench", *args)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr, (args, r.stderr)
