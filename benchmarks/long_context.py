"""Issue 28's proof on CPU: each of ALST's levers (hfscale.scale.long_context) at three sequence lengths, the real
step peak measured by torch's MemTracker against the plan, and tokens/s with and without the lever in one run.

    .venv/bin/python benchmarks/long_context.py           # -> benchmarks/results/long_context.{md,json}
    .venv/bin/python benchmarks/long_context.py --redo tiled_loss          # those rows again, into the same files
    .venv/bin/python benchmarks/long_context.py --speed tiled_mlp offload  # only their tokens/s
    .venv/bin/python benchmarks/long_context.py --planned   # only the planned tables (no CPU measurement, ~5 min):
                                                            # the measured sections already in the results stay

Rows: the built-in tiny Gemma 3 (vocabulary 4,096, MLP 768), one process, fp32, micro batch 1, sdpa.
  measured  `trace.measure_steps(levers=...)`: a real steady step (step 2) under MemTracker, each in a fresh
            process; the peak of forward / backward / optimizer.
  traced    `trace.trace_step(levers=...)`: the plan's fake-tensor trace of the same step (what `--trace` runs).
  analytic  `plan.long_context.lever_prediction`: the bytes the lever removes from / adds to the saved
            activations (its formulas, what the full-size plans below use); compared with the measured change of
            the forward peak (where every saved activation is alive).
  offload   on a CPU host save_on_cpu's copy is the tensor itself, so the device peak cannot drop: the measured
            number is the host bytes it would hold (Offload.host_bytes over one forward) against the plan's.
  tokens/s  one plain and one lever step alternated 10 times after a warm-up, no tracker; the median step per wall
            second and per CPU-second of the process; the ratio is the lever's price.
Then the longest sequence planned per model and hardware (analytic, bf16, full checkpointing, ALST's three levers and
the tiled RMSNorm, and the three alone)
beside ALST's published numbers, and the per-phase model against the fake-tensor trace at Llama-3.1-8B's full
per-rank size (`full_size_check`: the trace at 2 and 3 layers, extrapolated to 32 as plan/peak.py scales depth).
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results"
SEQS = (512, 1024, 2048)
LEVERS = {"tiled_loss": dict(tiled_loss=8), "tiled_mlp": dict(tiled_mlp=8), "offload": dict(offload_activations=True),
          "tiled_norm": dict(tiled_norm=8)}
CKPT = {"tiled_loss": "off", "tiled_mlp": "off", "offload": "full", "tiled_norm": "off"}
ROUNDS = 10


def _levers(name):
    from hfscale.scale.long_context import Levers

    return Levers(**LEVERS[name]) if name else None


def worker(kind: str, lever: str, seq: int) -> dict:
    import torch

    from hfscale.models import tiny_config
    from hfscale.plan.trace import measure_steps, trace_step

    ckpt = CKPT.get(lever, "off")
    if kind == "measure":
        step = measure_steps(tiny_config(), 1, seq, "fp32", "sdpa", ckpt, steps=2, levers=_levers(lever))[1]
        traced = trace_step(tiny_config(), 1, seq, "fp32", "sdpa", ckpt, levers=_levers(lever)).phases(True)
        return {ph: {"measured": step[ph].bytes, "traced": traced[ph].bytes} for ph in step}
    from transformers import AutoModelForCausalLM

    from hfscale.scale.checkpointing import apply_checkpointing_
    from hfscale.scale.long_context import Levers, apply_levers_, with_levers

    def build(levers):
        cfg = tiny_config()
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).train()
        apply_checkpointing_(m, ckpt)
        apply_levers_(m, levers)
        return m, with_levers(lambda mm, b: mm(input_ids=b, labels=b).loss, levers, m)

    ids = torch.randint(3, 4096, (1, seq))
    runs = {"plain": build(Levers()), "lever": build(_levers(lever))}
    out = {}
    if lever == "offload":
        m, fn = runs["lever"]
        fn(m, ids).backward()
        out["host_bytes"] = fn.offload.host_bytes
    import statistics

    wall, cpu = {k: [] for k in runs}, {k: [] for k in runs}
    for k, (m, fn) in runs.items():  # warm-up
        fn(m, ids).backward()
    for _ in range(ROUNDS):  # one plain step, one lever step, alternating: a burst of other jobs hits both
        for k, (m, fn) in runs.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn(m, ids).backward()
            m.zero_grad(set_to_none=True)
            wall[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
    out["tokens_per_s"] = {k: seq / statistics.median(v) for k, v in wall.items()}
    # per CPU-second of this process: what other jobs on the shared cores take from the wall clock is not in it
    out["tokens_per_cpu_s"] = {k: seq / statistics.median(v) for k, v in cpu.items()}
    return out


def _sub(kind, lever, seq) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, __file__, "--worker", kind, lever or "", str(seq)], capture_output=True, text=True,
                       env=env, timeout=1800)
    if r.returncode:
        raise SystemExit(f"worker {kind} {lever} {seq} failed: {r.stderr[-1500:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def analytic(lever: str, seq: int):
    from hfscale.models import tiny_config
    from hfscale.models.dims import dims_from_config
    from hfscale.plan.long_context import lever_prediction
    from hfscale.plan.memory import Strategy

    d = dims_from_config(tiny_config())
    s = Strategy(precision="fp32", micro_batch=1, seq_len=seq, checkpointing=CKPT[lever])
    return lever_prediction(d, s, _levers(lever))


def frontier() -> list[dict]:
    from dataclasses import replace

    from transformers import LlamaConfig

    from hfscale.models import load_config
    from hfscale.models.dims import dims_from_config
    from hfscale.plan.long_context import alst_levers, lever_prediction, longest_sequence
    from hfscale.plan.memory import Strategy
    from hfscale.plan.planner import Hardware, peak_bytes
    from hfscale.scale.long_context import Levers

    llama = dims_from_config(LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False))
    g31 = dims_from_config(load_config("gemma-4-31b"))
    g27 = dims_from_config(load_config("gemma-3-27b"))
    cases = [("Llama-3.1-8B", llama, Hardware(1, 1, 80 * 10**9, 512 * 10**9), Strategy(zero=3, offload="cpu", checkpointing="full"),
              524288, "500K (1 H100)"),
             ("Llama-3.1-8B", llama, Hardware(8, 1, 80 * 10**9, 2048 * 10**9), Strategy(zero=3, sp=8, offload="cpu", checkpointing="full"),
              3801088, "3.7M (8 H100)"),
             # ALST's 4-node run spans Ulysses over all 32 GPUs; hfscale's planner keeps SP within a node (sp <= 8)
             ("Llama-3.1-8B", llama, Hardware(8, 4, 80 * 10**9, 2048 * 10**9),
              Strategy(zero=3, sp=32, offload="cpu", checkpointing="full"), 15204352, "15M (32 H100)"),
             ("Gemma 3 27B", g27, Hardware(2, 1, 80 * 10**9, 2048 * 10**9), Strategy(zero=3, sp=2, offload="cpu", checkpointing="full"),
              131072, "-"),
             ("Gemma 4 31B", g31, Hardware(8, 4, 80 * 10**9, 2048 * 10**9), Strategy(zero=3, sp=8, dp=4, offload="cpu", checkpointing="full"),
              262144, "-")]
    rows = []
    for name, d, hw, s, at, alst in cases:
        s_at = replace(s, seq_len=at)
        lv = alst_levers(d, s_at)
        three = replace(lv, tiled_norm=0)  # ALST's three levers, without the tiled RMSNorm
        p, plain, p3 = lever_prediction(d, s_at, lv), lever_prediction(d, s_at, Levers()), lever_prediction(d, s_at, three)
        step = 8192 * s.sp
        longest = longest_sequence(d, hw, lambda S: replace(s, seq_len=S), alst_levers, step=step)
        longest_plain = longest_sequence(d, hw, lambda S: replace(s, seq_len=S), Levers(), step=step)
        longest_three = longest_sequence(d, hw, lambda S: replace(s, seq_len=S),
                                         lambda d, s: alst_levers(d, s, norm=False), step=step)
        rows.append({"model": name, "hardware": f"{hw.nodes} x {hw.gpus_per_node} x {hw.gpu_mem / 1e9:.0f} GB",
                     "strategy": s_at.label, "seq_len": at,
                     "levers": {"tiled_loss": lv.tiled_loss, "tiled_mlp": lv.tiled_mlp, "tiled_norm": lv.tiled_norm},
                     "peak_phase": p.peak_phase, "peak_parts": p.changes,
                     "gpu_gb_three": peak_bytes(p3.total) / 1e9, "longest_three": longest_three,
                     "gpu_gb": peak_bytes(p.total) / 1e9, "gpu_gb_without": peak_bytes(plain.total) / 1e9,
                     "host_gb_per_node": (p.host_bytes_per_rank + p.base["offloaded_per_rank"]) * hw.gpus_per_node / 1e9,
                     "time_factor": p.time_factor, "longest": longest, "longest_without_levers": longest_plain, "alst": alst})
    return rows


def full_size_check() -> list[dict]:
    """plan.long_context.phase_bytes against the fake-tensor trace of the same per-rank step (trace.phase_trace),
    Llama-3.1-8B, bf16, CUDA's attention kernels, full checkpointing, ALST's slices, with and without the activation
    offload (traced as save_on_cpu moves tensors off a GPU, trace._FakeHost): non-state bytes (activations +
    temporaries) per phase, the trace's at 2 and 3 layers extrapolated."""
    from transformers import LlamaConfig

    from hfscale.models.dims import dims_from_config
    from hfscale.plan.long_context import alst_levers, phase_bytes
    from hfscale.plan.memory import Strategy
    from hfscale.plan.trace import phase_trace

    rows = []
    for (tokens, where), offload in itertools.product(((524288, "1 x 80 GB, 524,288"),
                                                       (475136, "8 x 80 GB SP8 at 3,801,088 (and SP32 at 15.2M)")),
                                                      (False, True)):
        traced = {}
        for L in (2, 3):
            cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=L,
                              num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                              max_position_embeddings=2 * tokens)
            s = Strategy(checkpointing="full", seq_len=tokens)
            lv = alst_levers(dims_from_config(cfg), s, offload=offload)
            traced[L] = phase_trace(cfg, tokens, "bf16", "full", lv, kernels="cuda")
        cfg.num_hidden_layers = 32
        d = dims_from_config(cfg)
        planned = {k: sum(v.values()) for k, v in phase_bytes(d, Strategy(checkpointing="full", seq_len=tokens), lv).items()}
        full = {k: traced[2][k] + 30 * (traced[3][k] - traced[2][k]) for k in traced[2]}
        rows.append({"tokens_per_rank": tokens, "where": where, "levers": [lv.tiled_loss, lv.tiled_mlp, lv.tiled_norm],
                     "offload": offload, "traced": full,
                     "planned": planned})
    return rows


def _row(lever: str, seq: int, plain: dict) -> dict:
    meas = _sub("measure", lever, seq) if lever != "offload" else None
    speed = _sub("speed", lever, seq)
    a = analytic(lever, seq)
    row = {"lever": lever, "seq": seq, "checkpointing": CKPT[lever], "tokens_per_s": speed["tokens_per_s"],
           "tokens_per_cpu_s": speed.get("tokens_per_cpu_s"),
           "analytic_saved_change": _saved_change(lever, seq, a),
           "analytic_host_bytes": a.host_bytes_per_rank}
    if meas:
        row["phases"] = meas
        row["plain_phases"] = plain[seq] if CKPT[lever] == "off" else None
        row["measured_forward_change"] = meas["forward"]["measured"] - plain[seq]["forward"]["measured"]
    else:
        row["host_bytes"] = speed["host_bytes"]
    return row


def _saved_change(lever: str, seq: int, a) -> int:
    """The saved activations the lever removes, by the plan's formula (tiled norm: `norm_saving`, all four layers
    and the final norm of the tiny model, no checkpointing)."""
    if lever == "tiled_norm":
        from hfscale.models import tiny_config
        from hfscale.models.dims import dims_from_config
        from hfscale.plan.long_context import norm_saving

        per, final = norm_saving(dims_from_config(tiny_config()), seq, 4)
        return -(sum(per) + final)
    return sum(v for k, v in a.changes.items() if k in ("logits_saved", "mlp_saved"))


def rerun(levers: list[str], speed: bool) -> int:
    """--redo LEVER...: measure those levers' rows again (bytes and tokens/s); --speed LEVER...: only their tokens/s
    (the bytes do not depend on the host's load); into the written results."""
    from hfscale.util.atomic import write_text_atomic

    res = json.loads((OUT / "long_context.json").read_text())
    for lever in levers:  # a lever with no rows yet (the tiled norm): measured at every length, plain from the rows
        if not speed and lever not in {r["lever"] for r in res["rows"]}:
            plain = {r["seq"]: r["plain_phases"] for r in res["rows"] if r.get("plain_phases")}
            for seq in SEQS:
                res["rows"].append(_row(lever, seq, plain if seq in plain else {seq: _sub("measure", "", seq)}))
                print(json.dumps(res["rows"][-1]), flush=True)
            levers = [x for x in levers if x != lever]
    for i, r in enumerate(res["rows"]):
        if r["lever"] not in levers:
            continue
        if not speed:
            r = res["rows"][i] = _row(r["lever"], r["seq"], {r["seq"]: _sub("measure", "", r["seq"])})
        else:
            s = _sub("speed", r["lever"], r["seq"])
            r["tokens_per_s"], r["tokens_per_cpu_s"] = s["tokens_per_s"], s["tokens_per_cpu_s"]
        print(json.dumps({k: r[k] for k in ("lever", "seq", "tokens_per_s", "tokens_per_cpu_s")}), flush=True)
    res["frontier"] = frontier()  # the plan as it is now (pure arithmetic, no measurement)
    write_text_atomic(OUT / "long_context.json", json.dumps(res, indent=1))
    write_text_atomic(OUT / "long_context.md", render(res))
    return 0


def planned_only() -> int:
    """--planned: the planned tables again, into the written results; the measured rows stay as they are."""
    from hfscale.util.atomic import write_text_atomic

    import torch

    t0 = time.time()
    res = json.loads((OUT / "long_context.json").read_text())
    res["frontier"] = frontier()
    res["full_size_check"] = full_size_check()
    res["planned"] = {"seconds": round(time.time() - t0), "torch": torch.__version__,
                      "host": f"{platform.node()}, {os.cpu_count()} cores shared with other jobs"}
    write_text_atomic(OUT / "long_context.json", json.dumps(res, indent=1))
    write_text_atomic(OUT / "long_context.md", render(res))
    print(render(res))
    return 0


def main() -> int:
    from hfscale.util.atomic import write_text_atomic

    t0 = time.time()
    plain = {seq: _sub("measure", "", seq) for seq in SEQS}
    rows = []
    for lever in LEVERS:
        for seq in SEQS:
            rows.append(_row(lever, seq, plain))
            print(json.dumps(rows[-1]), flush=True)
    front = frontier()
    import torch

    host = f"{platform.node()}, {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores shared with other jobs"
    res = {"host": host, "torch": torch.__version__, "seconds": round(time.time() - t0), "rows": rows, "frontier": front,
           "full_size_check": full_size_check()}
    OUT.mkdir(parents=True, exist_ok=True)
    write_text_atomic(OUT / "long_context.json", json.dumps(res, indent=1))
    write_text_atomic(OUT / "long_context.md", render(res))
    print(render(res))
    return 0


def _mb(n):
    return f"{n / 2**20:.2f}"


def render(res: dict) -> str:
    L = ["# Long context: ALST's levers on CPU, and the plan at full size", "",
         f"Host: {res['host']}; torch {res['torch']}; {res['seconds']} s. Tiny Gemma 3 (vocab 4,096, hidden 192, MLP 768, "
         "4 layers), one process, fp32, micro batch 1, sdpa; tiled loss, MLP and norms in 8 slices; the offload with full "
         "checkpointing (what it moves). Generated by benchmarks/long_context.py.", "",
         "## Step peak per lever: measured (MemTracker, real step 2) vs the plan (fake-tensor trace), MiB", "",
         "| lever | seq | phase | measured | traced | trace error | plain measured |", "|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        if "phases" not in r:
            continue
        for ph, v in r["phases"].items():
            pl = r["plain_phases"][ph]["measured"] if r.get("plain_phases") else None
            L.append(f"| {r['lever']} | {r['seq']} | {ph} | {_mb(v['measured'])} | {_mb(v['traced'])} | "
                     f"{(v['traced'] - v['measured']) / v['measured']:+.2%} | {_mb(pl) if pl else '-'} |")
    L += ["", "## What the lever changes: the analytic formula vs the measured forward peak", "",
          "The formula counts saved activations removed (hfscale/plan/long_context.py). The measured forward peak "
          "moves by more for the tiled loss: the plain step's peak also holds the logits themselves (4TV in fp32) "
          "while the loss is computed, a transient the analytic total does not count (the trace does); the lever's "
          "peak holds one slice's working set instead. The plan's saving is the lower bound. For the tiled norm it moves "
          "by less (5/6 of the saved bytes the formula removes, which the offload's host bytes confirm within 24 bytes): "
          "the forward peak is not where every norm's saved rows are alive at once. The planner does not use this "
          "difference: it takes the largest phase of `phase_bytes`, which bounds the fake trace in every phase "
          "(tests/test_long_context.py), and the trace equals the measured step to the byte above.", "",
          "| lever | seq | analytic saved change MiB | measured forward-peak change MiB |", "|---|---|---|---|"]
    for r in res["rows"]:
        if "measured_forward_change" in r:
            L.append(f"| {r['lever']} | {r['seq']} | {_mb(r['analytic_saved_change'])} | {_mb(r['measured_forward_change'])} |")
    L += ["", "## Activation offload: host bytes (a CPU host's copy is the tensor itself, so only these are measured)", "",
          "| seq | measured host bytes (save_on_cpu copies) | planned | error |", "|---|---|---|---|"]
    for r in res["rows"]:
        if "host_bytes" in r:
            L.append(f"| {r['seq']} | {r['host_bytes']:,} | {r['analytic_host_bytes']:,} | "
                     f"{(r['analytic_host_bytes'] - r['host_bytes']) / r['host_bytes']:+.2%} |")
    L += ["", "## The price of each lever: tokens/s with and without it, in one run", "",
          "One plain and one lever step alternate 10 times in one process after a warm-up; the median step. Other "
          "jobs shared the 2 cores (the host's load moved single runs by up to 10x), so small ratios are within the "
          "noise. On a CPU host the offload moves nothing (save_on_cpu's copy is the tensor itself): its rows time "
          "only the hooks' bookkeeping, and a ratio above 1 there is the host's load, not the lever.", "",
          "| lever | seq | plain tokens/s (wall) | with lever | ratio | plain tokens/CPU-s | with lever | ratio |",
          "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        t, c = r["tokens_per_s"], r.get("tokens_per_cpu_s")
        cpu = f"{c['plain']:.0f} | {c['lever']:.0f} | {c['lever'] / c['plain']:.2f}" if c else "- | - | -"
        L.append(f"| {r['lever']} | {r['seq']} | {t['plain']:.0f} | {t['lever']:.0f} | {t['lever'] / t['plain']:.2f} | {cpu} |")
    if res.get("planned"):
        L += ["", f"The planned sections below were regenerated alone (`--planned`: {res['planned']['host']}; torch "
                  f"{res['planned']['torch']}; {res['planned']['seconds']} s); the measured ones above are from the run "
                  "the header names."]
    L += ["", "## Longest sequence planned (analytic, bf16, full checkpointing, ZeRO-3 with cpu offload, ALST's three levers "
          "and the tiled RMSNorm)", "",
          "Per-GPU = the model states left on the GPU + the largest phase of hfscale.plan.long_context.phase_bytes "
          "(forward, the loss's backward, a layer's recomputed backward: not alive at once), x 1.1 fragmentation + 0.5 GiB "
          "CUDA context; per-host = offloaded activations + offloaded model states of the node's ranks. Planned only: "
          "never run on GPUs here.", "",
          "| model | hardware | strategy | at | levers (loss / MLP / norm slices) | per GPU GB | three levers (no tiled "
          "norm) | without levers | per host GB | time x | peak phase | longest planned | three levers | without levers "
          "| ALST |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for f in res["frontier"]:
        lv = f["levers"]
        L.append(f"| {f['model']} | {f['hardware']} | {f['strategy']} | {f['seq_len']:,} | {lv['tiled_loss']} / "
                 f"{lv['tiled_mlp']} / {lv.get('tiled_norm', 0)} | {f['gpu_gb']:.1f} | {f.get('gpu_gb_three', 0):.1f} | "
                 f"{f['gpu_gb_without']:.1f} | {f['host_gb_per_node']:.1f} | {f['time_factor']:.3f} | "
                 f"{f.get('peak_phase', '-')} | {f['longest']:,} | {f.get('longest_three', 0):,} | "
                 f"{f['longest_without_levers']:,} | {f['alst']} |")
    if res["frontier"] and res["frontier"][0].get("peak_parts"):
        L += ["", "The largest phase of each row at its length, GB beyond the model states (before x 1.1 + 0.5 GiB):", ""]
        for f in res["frontier"]:
            parts = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in f["peak_parts"].items())
            L.append(f"- {f['model']}, {f['hardware']}, {f['seq_len']:,}: {f['peak_phase']}: {parts}")
    if res.get("full_size_check"):
        L += ["", "## The per-phase model against the fake-tensor trace at full size (Llama-3.1-8B, per rank)", "",
              "Non-state device bytes (activations + temporaries) per phase, GB: the trace (transformers' own code on fake "
              "tensors, CUDA's flash attention, the tiled loss, MLP and RMSNorm run for real, the activation offload as "
              "save_on_cpu moves tensors off a GPU; at 2 and 3 layers, extrapolated to 32) against `phase_bytes`. No "
              "Ulysses (one process: its all-to-all buffers are counted by formula, in attention's backward).", "",
              "| tokens per rank | planned case | loss / MLP / norm slices | offload | phase | traced GB | planned GB | error |",
              "|---|---|---|---|---|---|---|---|"]
        names = {"forward": "forward", "loss": "loss", "layer_backward": "layers"}
        for c in res["full_size_check"]:
            for ph, tk in names.items():
                tr, pl = c["traced"][tk], c["planned"][ph]
                L.append(f"| {c['tokens_per_rank']:,} | {c['where']} | {' / '.join(str(x) for x in c['levers'])} | "
                         f"{'yes' if c.get('offload') else 'no'} | {ph} | "
                         f"{tr / 1e9:.2f} | {pl / 1e9:.2f} | {(pl - tr) / tr:+.2%} |")
    return "\n".join(L) + "\n"


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        print(json.dumps(worker(sys.argv[2], sys.argv[3] or None, int(sys.argv[4]))))
        sys.exit(0)
    if len(sys.argv) > 1 and sys.argv[1] == "--planned":
        sys.exit(planned_only())
    if len(sys.argv) > 1 and sys.argv[1] in ("--redo", "--speed"):
        sys.exit(rerun(sys.argv[2:], sys.argv[1] == "--speed"))
    sys.exit(main())
