"""The step trace (hfscale/plan/trace.py, peak.py): fake tensors against real CPU steps measured with the
same MemTracker, per architecture; depth scaling against a direct trace; the plan --trace contract."""

import json
import sys

import pytest

from conftest import ROOT

# (row, exact): every row matches to the byte (with checkpointing too since trace._unpacked_rows: the fake run
# built an S x S mask the real one does not, +0.13% Gemma 4 full, +2.2% Llama every:2)
ROWS = [
    (dict(arch="gemma3", micro_batch=2, seq_len=128, precision="fp32"), True),
    (dict(arch="qwen3", micro_batch=1, seq_len=64, precision="bf16-autocast", grad_accum=2), True),
    (dict(arch="mixtral", micro_batch=2, seq_len=64, precision="bf16"), True),
    # fp32 experts: the CPU grouped_mm the real run uses (trace._cpu_grouped_mm), torch's fake kernel takes bf16 only
    (dict(arch="qwen3_moe", micro_batch=2, seq_len=64, precision="fp32"), True),
    (dict(arch="gpt_neox", micro_batch=2, seq_len=64, precision="fp32", attention="eager"), True),
    (dict(arch="llama", micro_batch=2, seq_len=64, precision="bf16", lora_rank=8), True),
    (dict(arch="gemma4", micro_batch=2, seq_len=64, precision="bf16", checkpointing="full"), True),
    # rows packed with 4 documents each (trace.packed_rows; issue 36): transformers builds the block-diagonal mask
    # of both layer types (window 64 < 128), the trace counts it as the real step holds it
    (dict(arch="gemma3", micro_batch=2, seq_len=128, precision="fp32", packing=True), True),
    # rows training 100 of their 254 trainable tokens (trace.trained_rows: masked prompts): the LM head and the loss
    # at those positions only, as hfscale.models.loss runs them
    (dict(arch="gemma3", micro_batch=2, seq_len=128, precision="fp32", trained=100), True),
]


IDS = [r["arch"] + ("-packed" if r.get("packing") else "-trained" if "trained" in r else "") for r, _ in ROWS]


@pytest.fixture(scope="module")
def row_runs(request):
    """tests/scripts/trace_row.py of every row this session selected, each in a fresh process (a real step's
    count depends on what the process ran before), two at a time (conftest.run_concurrently); id -> CompletedProcess."""
    from conftest import run_concurrently, selected_params

    chosen = {c.id for c in selected_params(request, "test_fake_trace_equals_real_steps")}
    wanted = [i for i in IDS if i in chosen]
    rows = {i: r for i, (r, _) in zip(IDS, ROWS)}
    runs = run_concurrently([([sys.executable, ROOT / "tests" / "scripts" / "trace_row.py", json.dumps(rows[i])], None)
                             for i in wanted], timeout=600 * len(wanted))  # 600 s a row, as each had alone
    return dict(zip(wanted, runs))


@pytest.mark.parametrize("row, exact", ROWS, ids=IDS)
def test_fake_trace_equals_real_steps(row, exact, row_runs, request):
    out = row_runs[request.node.callspec.id]
    assert out.returncode == 0, out.stderr[-2000:]
    d = json.loads(out.stdout.strip().splitlines()[-1])
    for real, fake in ((d["real"][0], d["fake"]["step1"]), (d["real"][1], d["fake"]["steady"])):
        for phase in ("forward", "backward", "optimizer"):
            if exact:
                assert fake[phase] == real[phase], (phase, fake, real)
            else:
                assert 0 <= fake[phase] - real[phase] <= 0.03 * real[phase], (phase, fake, real)
    assert d["fake"]["steady"]["forward"] > d["fake"]["step1"]["forward"]  # AdamW's states exist from step 2


def test_checkpointed_llama_traces_flash_attention_without_a_mask():
    """A checkpointed step has no cache, and transformers then checks the position ids for packed sequences, which
    fake tensors cannot answer: the trace built a B x 1 x S x S mask (14.4 TB at 3.8M tokens) and, with CUDA's kernels,
    sent every attention call to the memory-efficient kernel. A real run's rows are unpacked: flash, no mask, and
    the forward peak grows linearly in S (was 120.8 -> 62.8 MiB at 4,096 tokens; an S^2 term quadruples)."""
    from transformers import LlamaConfig

    from hfscale.plan.trace import trace_step

    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, tie_word_embeddings=False, max_position_embeddings=8192)
    a, b = (trace_step(cfg, 1, s, "bf16", "sdpa", "full", kernels="cuda", optimizer=False) for s in (2048, 4096))
    assert a.attention_kernels == b.attention_kernels == {"flash": 4}  # 2 layers, forward + recompute
    fa, fb = a.micro[0]["forward"].breakdown["activations"], b.micro[0]["forward"].breakdown["activations"]
    assert 1.9 < fb / fa < 2.1, (fa, fb)


def test_depth_scaling_is_exact():
    from transformers import LlamaConfig

    from hfscale.plan.peak import depth_plan, scaled_trace
    from hfscale.plan.trace import trace_step

    cfg = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=16,
                      num_attention_heads=4, num_key_value_heads=2)
    assert depth_plan(cfg, "off") == (16, 2, 3)
    kw = dict(micro_batch=2, seq_len=256, precision="bf16", checkpointing="full")
    a, b = scaled_trace(cfg, **kw), trace_step(cfg, **kw)
    assert a.depth == [2, 3] and a.prediction()["phases"] == b.prediction()["phases"]
    assert a.prediction()["phases_step1"] == b.prediction()["phases_step1"]


def test_plan_trace_any_architecture(tmp_path, cli):
    from hfscale.testing.zoo import ARCHITECTURES

    d = tmp_path / "qwen3"
    d.mkdir()
    ARCHITECTURES["qwen3"]().save_pretrained(d)
    r = cli("plan", "--model", d / "config.json", "--seq-len", "64", "--micro-batch", "2", "--trace", "--json")
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)["prediction"]
    assert p["peak"] == max(p["phases"].values()) and set(p["phases"]) == {"forward", "backward", "optimizer"}
    assert p["peak_step1"] < p["peak"] and sum(p["peak_breakdown"].values()) == p["peak"]
    # the default traces it too (no analytic formulas for qwen3), the same numbers, and says so
    r = cli("plan", "--model", d / "config.json", "--seq-len", "64", "--micro-batch", "2", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["prediction"]["peak"] == p["peak"] and out["prediction"]["source"] == "trace"
    assert any("qwen3" in n and "traced" in n for n in out["notes"])
    # was KeyError: 'weights' (the plot drew analytic terms a traced-only row lacks)
    png = tmp_path / "p.png"
    r = cli("plan", "--model", d / "config.json", "--seq-len", "64", "--micro-batch", "2", "--gpus-per-node", "2",
            "--gpu-mem", "1GB", "--plot", png)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert png.read_bytes()[:4] == b"\x89PNG" and "pick:" in r.stdout
    r = cli("plan", "--model", d / "config.json", "--seq-len", "64", "--micro-batch", "2", "--fast")
    assert r.returncode == 2 and "qwen3" in r.stderr and "--fast" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_plan_trace_ranks_candidates_on_the_traced_peak(cli):
    r = cli("plan", "--model", "tiny-gemma3", "--seq-len", "128", "--micro-batch", "1", "--gpus-per-node", "2",
            "--gpu-mem", "1GB", "--trace", "--json")
    assert r.returncode == 0, r.stderr
    pick = json.loads(r.stdout)["pick"]
    assert pick["peak_source"] == "trace"
    assert pick["peak_bytes"] == int(pick["prediction"]["peak"] * 1.1) + 512 * 2**20 <= 1e9


def test_plan_packing_traces_the_packed_step():
    """`hfscale plan --packing` (plan(packing=True)): the step traced with packed rows (the row above checks that
    trace against a real step), said in the strategy and the trace; --fast, which traces nothing, refuses it."""
    from hfscale.models.builtin import TINY
    from hfscale.plan.api import plan
    from hfscale.plan.peak import step_prediction
    from hfscale.models.builtin import load_config
    from hfscale.util.errors import HfscaleError

    packed, plain = (plan(TINY, 128, 2, precision="fp32", packing=p) for p in (True, False))
    assert packed.strategy.label == "DDP packed ckpt:off mb2" and packed.prediction.to_dict()["trace"]["packing"] is True
    assert packed.prediction.peak == step_prediction(load_config(TINY), 2, 128, "fp32", packing=True)["peak"]
    assert packed.prediction.peak != plain.prediction.peak
    with pytest.raises(HfscaleError, match="--packing"):
        plan(TINY, 128, 2, packing=True, method="fast")


def test_depth_scaled_engine_walks_equal_the_full_depth_trace(monkeypatch):
    """ZeRO-3's and FSDP2's backward walk the gradient arrivals, which a trace scaled in depth does not keep: peak.py
    walks the two shallow traces and extrapolates per kind. Equal to walking a full-depth trace on a Llama whose model
    states outweigh its activations (1 x 16 tokens), full fine-tuning and LoRA (without the shallow walks all three rows
    differ). (Checked by hand on a 20-layer Gemma 3 of 384, ZeRO-3 / FSDP2, full / LoRA / DoRA: equal but ZeRO-3 full's
    step-1 backward, -1.8%, its walk peaking at another place in depth, and DoRA, whose trace varied with the GC until
    hfscale's tracker dropped ModTracker's input hooks (plan/tracker.py): not rechecked since.)"""
    from transformers import LlamaConfig

    import hfscale.plan.peak as peak

    cfg = LlamaConfig(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=5,
                      num_attention_heads=4, num_key_value_heads=2)
    # the rows whose scaled plan differed from the full-depth walk before (ZeRO-3 LoRA's peak is backward's start)
    rows = [dict(zero=3, engine="deepspeed"), dict(engine="fsdp2"), dict(engine="fsdp2", lora_rank=4)]
    scaled = [peak.step_prediction(cfg, 1, 16, "fp32", dp=2, **kw) for kw in rows]
    assert peak.depth_plan(cfg, "off") == (5, 2, 3)
    monkeypatch.setattr(peak, "depth_plan", lambda *a, **k: None)
    for kw, s in zip(rows, scaled):
        d = peak.step_prediction(cfg, 1, 16, "fp32", dp=2, **kw)
        assert s["trace"]["traced_layers"] == [2, 3] and d["trace"]["traced_layers"] is None
        assert s["phases"] == d["phases"], (kw, s["phases"], d["phases"])
