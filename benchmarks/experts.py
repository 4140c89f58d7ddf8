"""Experts from storage (hfscale.experts) against a full load, accelerate's disk offload and llama.cpp,
on a tiny Gemma-4-MoE-shaped model whose experts dominate its bytes.

    nice -n 5 .venv/bin/python benchmarks/experts.py [--threads 1] [--fresh]   # ~25 min on 2 busy cores
    -> benchmarks/results/experts.{md,json,png}

Model: hfscale.testing.tiny_moe's 26B-A4B block (shared MLP + routed experts, softmax -> top-k -> renormalised
-> per-expert scale) at hidden 384, 64 experts of width 192, top-8, 8 layers, fp32 (this host emulates
bf16), seeded random init with jittered scales (training a 0.5 GB model does not fit the time; so
routing is that of an untrained router, close to uniform, and hit rates track the cached share).

Workload, the same for every configuration: held-out text (the built-in corpus's validation split),
a 32-token prefill, then 48 single-token steps with the KV cache, each fed the next held-out token
(teacher forcing: routing sees real text, and every configuration computes the same tokens).
Each configuration runs in a fresh process; peak RSS is the kernel's high-water mark (VmHWM), reset
after loading (/proc/self/clear_refs) so that load and run peaks are reported apart. Threads: 1 by default
(torch and llama.cpp): on this 2-core host shared with other jobs, 2 threads per process oversubscribe the
cores and the same configuration measured 4-30 tok/s from run to run (spinning OpenMP waits). Speed is
reported twice: tokens per wall second and tokens per CPU second of the process (time.process_time, all
its threads: the read-ahead thread's work counts), the latter much less sensitive to other jobs. Storage reads
come from the page cache (the files are read once before; nothing drops caches on this shared host).

Read traffic: predicted from routing statistics measured on calibration text (the train split,
hfscale.plan.moe_serving.measure_routing, Che's approximation of the LRU) vs bytes the cache read
during the 48 steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results"
SHAPE = dict(hidden_size=384, intermediate_size=768, moe_intermediate_size=192, num_experts=64, top_k_experts=8,
             num_hidden_layers=8, layer_types=["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 3
             + ["full_attention"], head_dim=64, global_head_dim=128)
PREFILL, STEPS = 32, 48
SPEED_STEPS, SPEED_ROUNDS = 24, 3
THREADS = int(sys.argv[sys.argv.index("--threads") + 1]) if "--threads" in sys.argv else 1


# --- worker: one configuration in its own process ------------------------------------------------
def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(ln for ln in f if ln.startswith(key + ":")).split()[1]) * 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def _load(job: dict):
    import torch
    from transformers import AutoModelForCausalLM

    from hfscale.experts import from_pretrained, offload_

    kind, path = job["kind"], job["path"]
    if kind == "full":
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                    experts_implementation=job.get("experts_implementation")).eval()
    if kind == "experts":
        return from_pretrained(path, ram_budget=job["budget"], prefetch=job.get("prefetch", False),
                               reader=job.get("reader", "pread"))
    if kind == "offload_":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return offload_(model, ram_budget=job["budget"])
    if kind == "accelerate_disk":
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, device_map=_disk_map(path),
                                                    offload_folder=job["offload_folder"]).eval()
    raise ValueError(kind)


def _disk_map(path: str) -> dict:
    """accelerate device_map: every experts module on "disk", everything else on "cpu"."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    with init_empty_weights():
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    dm = {n: "cpu" for n in ("model.embed_tokens", "model.norm", "model.rotary_emb", "lm_head")}
    for i, layer in enumerate(meta.model.layers):
        for child, _ in layer.named_children():
            dm[f"model.layers.{i}.{child}"] = "disk" if child == "experts" else "cpu"
        for name, _ in [*layer.named_parameters(recurse=False), *layer.named_buffers(recurse=False)]:
            dm[f"model.layers.{i}.{name}"] = "cpu"
    return dm


def _drop_page_cache(files) -> None:
    """Storage, not RAM: the kernel drops these files' pages from the page cache, except pages some process
    has mapped (posix_fadvise DONTNEED; our own files, no privileges): what the mmap reader's cache holds
    stays, what accelerate mapped for a forward and released does not."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _run_transformers(model, ids: list[int], steps_n: int = None, cold=()) -> dict:
    import torch

    off = getattr(model, "hfscale_experts", None)
    with torch.inference_mode():
        t = time.perf_counter()
        out = model(input_ids=torch.tensor([ids[:PREFILL]]), use_cache=True)
        prefill = time.perf_counter() - t
        before = dict(off.stats()) if off else None
        cache = out.past_key_values
        steps = cpu = 0.0
        for i in range(steps_n or STEPS):
            _drop_page_cache(cold)  # before each step, not timed
            t, c = time.perf_counter(), time.process_time()
            out = model(input_ids=torch.tensor([[ids[PREFILL + i]]]), past_key_values=cache, use_cache=True,
                        cache_position=torch.tensor([PREFILL + i]))
            steps, cpu = steps + time.perf_counter() - t, cpu + time.process_time() - c
            cache = out.past_key_values
    r = {"prefill_s": prefill, "steps_s": steps, "steps_cpu_s": cpu}
    if off:
        s = off.stats()
        r["cache"] = s
        r["step_reads"] = s["reads"] - before["reads"]
        r["step_bytes_read"] = s["bytes_read"] - before["bytes_read"]
        r["step_hit_rate"] = ((s["hits"] - before["hits"]) / max(1, s["hits"] + s["misses"] - before["hits"] - before["misses"]))
    return r


def _run_gguf(path: str, ids: list[int], steps_n: int = None, threads: int = 1) -> dict:
    import llama_cpp

    from hfscale.export.verify_llama import _plain_cpu_buffers

    with _plain_cpu_buffers():
        llm = llama_cpp.Llama(path, n_ctx=PREFILL + STEPS + 8, n_batch=512, n_threads=threads, n_threads_batch=threads,
                              verbose=False, seed=0, use_mmap=True)
    try:
        t = time.perf_counter()
        llm.eval(ids[:PREFILL])
        prefill = time.perf_counter() - t
        t, c = time.perf_counter(), time.process_time()
        for i in range(steps_n or STEPS):
            llm.eval([ids[PREFILL + i]])
        steps, cpu = time.perf_counter() - t, time.process_time() - c
        assert llm.n_tokens == PREFILL + (steps_n or STEPS)
    finally:
        llm.close()
    return {"prefill_s": prefill, "steps_s": steps, "steps_cpu_s": cpu}


def worker(job: dict) -> dict:
    import torch

    torch.set_num_threads(job.get("threads", 1))
    base = _status("VmRSS")
    t = time.perf_counter()
    if job["kind"] == "imports":  # what importing transformers and the Gemma 4 model code costs, nothing loaded
        from transformers import AutoModelForCausalLM, Gemma4ForCausalLM  # noqa: F401

        import hfscale.experts  # noqa: F401
        return {"baseline_rss": base, "imports_rss": _status("VmHWM")}
    model = None if job["kind"] == "gguf" else _load(job)
    load_s = time.perf_counter() - t
    load_peak = _status("VmHWM")
    _reset_peak()
    n = job.get("steps")
    r = (_run_gguf(job["path"], job["ids"], n, job.get("threads", 1)) if job["kind"] == "gguf"
         else _run_transformers(model, job["ids"], n, sorted(Path(job["path"]).glob("*.safetensors")) if job.get("cold") else ()))
    r.update(load_s=load_s, baseline_rss=base, load_peak_rss=load_peak, run_peak_rss=_status("VmHWM"),
             rss_anon_end=_status("RssAnon"), rss_file_end=_status("RssFile"))
    if model is not None and getattr(model, "hfscale_experts", None):
        model.hfscale_experts.close()
    return r


def run_config(job: dict) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(job.get("threads", 1)), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    p = subprocess.run([sys.executable, __file__, "--worker"], input=json.dumps(job), capture_output=True, text=True,
                       env=env, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"{job['name']} failed: {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


# --- the benchmark -------------------------------------------------------------------------------
def main() -> int:
    import tempfile

    import torch
    from tqdm import tqdm

    from hfscale.compress.evaluate import calibration_blocks, heldout_blocks, EvalData
    from hfscale.testing.tiny_moe import cached_tiny_moe
    from hfscale.export import FORMATS
    from hfscale.export.bench import host_info
    from hfscale.export.evalset import EvalSet
    from hfscale.models import load_config, load_tokenizer
    from hfscale.models.dims import dims_from_config
    from hfscale.plan.memory import expert_params
    from hfscale.plan.moe_serving import lru_traffic, measure_routing

    t0 = time.time()
    # --- model ---
    path = cached_tiny_moe(steps=0, **SHAPE)
    d = dims_from_config(load_config(path))
    total_bytes = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
    expert_bytes_all = expert_params(d) * 4
    one_expert = 3 * d.hidden * d.moe_intermediate * 4
    tok = load_tokenizer(path)
    ids = heldout_blocks(tok, EvalData(seq_len=PREFILL + STEPS, n_blocks=1))[0].tolist()

    # --- routing statistics on calibration text (train split), with the model's own routers ---
    from transformers import AutoModelForCausalLM

    full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    routing = measure_routing(full, calibration_blocks(tok, n=8, seq_len=128))
    del full

    # --- llama.cpp file (F16), checked against transformers on held-out prompts ---
    gguf_dir = Path(tempfile.mkdtemp(prefix="experts-bench-"))
    gguf_path = gguf_dir / "moe-F16.gguf"
    exp = FORMATS["gguf"].export(path, gguf_path, "F16", False, evalset=EvalSet(n_prompts=2, prompt_tokens=64, ppl_blocks=2,
                                                                               seq_len=128), progress=False)

    budgets = {f"{k}/{n} experts": expert_bytes_all * k // n for k, n in ((1, 8), (1, 4), (1, 2))}
    half = budgets["1/2 experts"]
    imports = run_config({"name": "imports", "kind": "imports"})
    jobs = [{"name": "full load (transformers)", "kind": "full"},
            {"name": "full load, transformers' eager expert loop", "kind": "full", "experts_implementation": "eager"}]
    jobs += [{"name": f"hfscale.experts {b}", "kind": "experts", "budget": v} for b, v in budgets.items()]
    jobs += [{"name": "hfscale.experts 1/2 experts + prefetch", "kind": "experts", "budget": half, "prefetch": True},
             {"name": "hfscale.experts 1/2 experts, mmap reader", "kind": "experts", "budget": half, "reader": "mmap"},
             {"name": "hfscale.experts 1/2 experts, mmap reader + prefetch", "kind": "experts", "budget": half,
              "reader": "mmap", "prefetch": True},
             {"name": "hfscale.experts, every expert fits (budget = all)", "kind": "experts",
              "budget": expert_bytes_all + one_expert},
             {"name": "offload_ 1/2 experts (model loaded first)", "kind": "offload_", "budget": half},
             {"name": "accelerate disk offload (experts on disk)", "kind": "accelerate_disk",
              "offload_folder": str(gguf_dir / "offload")},
             {"name": "llama.cpp F16 GGUF (mmap)", "kind": "gguf", "path": str(gguf_path)}]
    rows = []
    # rows already measured by an interrupted run of the same model and workload are kept (--fresh: none)
    partial = Path(tempfile.gettempdir()) / f"hfscale-experts-bench-{Path(path).name}-{PREFILL}-{STEPS}-t{THREADS}.json"
    done = {} if "--fresh" in sys.argv or not partial.is_file() else json.loads(partial.read_text())
    for job in tqdm(jobs, desc="configurations", unit="run"):
        job = {"path": path, "ids": ids, "threads": THREADS, **job}
        r = done.get(job["name"]) or run_config(job)
        done[job["name"]] = r
        partial.write_text(json.dumps(done))
        r["name"], r["kind"], r["budget"] = job["name"], job["kind"], job.get("budget")
        if job["kind"] in ("experts", "offload_"):
            pred = lru_traffic(routing, job["budget"] // one_expert, one_expert)
            r["predicted_bytes_per_step"] = pred.read_bytes_per_token
            r["predicted_hit_rate"] = pred.hit_rate
        rows.append(r)

    # --- speed, interleaved: the host is shared, so the configurations compared take turns (A B C D A B C D) ---
    speed_names = ["full load (transformers)", "full load, transformers' eager expert loop", "hfscale.experts 1/2 experts",
                   "hfscale.experts 1/2 experts + prefetch", "hfscale.experts 1/2 experts, mmap reader",
                   "hfscale.experts 1/2 experts, mmap reader + prefetch", "hfscale.experts, every expert fits (budget = all)",
                   "accelerate disk offload (experts on disk)", "llama.cpp F16 GGUF (mmap)"]
    by_name = {j["name"]: j for j in jobs}
    # cold storage: the model file's pages are dropped from the page cache before every step, so what is not
    # in the process's own cache (hfscale.experts) or mapped by it comes from the disk, as for a model larger
    # than RAM; the same three configurations, with their own interleaving and baseline
    cold_names = {f"{n}, cold storage": {**by_name[n], "cold": True} for n in (
        "hfscale.experts 1/2 experts", "hfscale.experts 1/2 experts, mmap reader", "accelerate disk offload (experts on disk)")}
    by_name.update(cold_names)
    speed = {n: [] for n in [*speed_names, *cold_names]}
    speed_cpu = {n: [] for n in speed}
    for _ in tqdm(range(SPEED_ROUNDS), desc="interleaved speed rounds"):
        for n in speed:
            r = run_config({"path": path, "ids": ids, "threads": THREADS, **by_name[n], "steps": SPEED_STEPS})
            speed[n].append(SPEED_STEPS / r["steps_s"])
            speed_cpu[n].append(SPEED_STEPS / r["steps_cpu_s"])

    # --- report ---
    base = next(r for r in rows if r["kind"] == "full")
    acc = next(r for r in rows if r["kind"] == "accelerate_disk")
    for r in rows:
        r["steps_tokens_per_s"] = STEPS / r["steps_s"]
        r["steps_tokens_per_cpu_s"] = STEPS / r["steps_cpu_s"]
        r["prefill_tokens_per_s"] = PREFILL / r["prefill_s"]
    for r in rows:
        r["speed_vs_accelerate_disk"] = r["steps_tokens_per_s"] / acc["steps_tokens_per_s"]
        r["speed_vs_full"] = r["steps_tokens_per_s"] / base["steps_tokens_per_s"]
        r["peak_rss"] = max(r["load_peak_rss"], r["run_peak_rss"])
    resident = total_bytes - expert_bytes_all
    for r in rows:  # RSS above imports + resident weights + budget: activations, KV cache, allocator
        if r["budget"] and r["kind"] == "experts":
            r["overhead_rss"] = r["run_peak_rss"] - imports["imports_rss"] - resident - r["budget"]
    result = {
        "host": host_info(THREADS), "threads": THREADS, "model": {"path_key": Path(path).name, "shape": SHAPE, "file_bytes": total_bytes,
                                        "expert_bytes": expert_bytes_all, "expert_share": expert_bytes_all / total_bytes,
                                        "one_expert_bytes": one_expert, "resident_bytes": resident},
        "workload": {"prefill_tokens": PREFILL, "teacher_forced_steps": STEPS, "text": "built-in corpus, validation split"},
        "imports": imports, "routing": routing.source,
        "speed_interleaved": {n: {"tokens_per_s": v, "median": sorted(v)[len(v) // 2],
                                  "x_accelerate_disk": [a / b for a, b in zip(v, speed[_acc(n)])],
                                  "tokens_per_cpu_s": speed_cpu[n], "median_cpu": sorted(speed_cpu[n])[len(v) // 2],
                                  "x_accelerate_disk_cpu": [a / b for a, b in zip(speed_cpu[n], speed_cpu[_acc(n)])]}
                              for n, v in speed.items()}, "gguf": {"bytes": exp["bytes"], "vs_transformers": exp["verification"]["vs_transformers"]},
        "rows": rows, "seconds": round(time.time() - t0, 1),
    }
    OUT.mkdir(parents=True, exist_ok=True)
    from hfscale.util.atomic import write_text_atomic

    write_text_atomic(OUT / "experts.json", json.dumps(result, indent=1) + "\n")
    write_text_atomic(OUT / "experts.md", _markdown(result))
    _plot(result, OUT / "experts.png")
    print(_markdown(result))
    import shutil

    shutil.rmtree(gguf_dir, ignore_errors=True)
    return 0


def _acc(name: str) -> str:
    """The accelerate row a speed row is compared with: cold storage with cold storage."""
    return "accelerate disk offload (experts on disk)" + (", cold storage" if name.endswith(", cold storage") else "")


def _markdown(res: dict) -> str:
    mb = 1e6
    m, h = res["model"], res["host"]
    lines = [
        "# Experts from storage: hfscale.experts vs full load, accelerate disk offload, llama.cpp",
        "",
        f"Host: {h['cpu']}, torch CPU capability {h['cpu_capability']} ({h['bf16']}), "
        f"{res.get('threads', 2)} thread(s) per process (torch and llama.cpp), {h['cores_available']} cores shared with other jobs, fp32. "
        f"Produced by `benchmarks/experts.py` (this invocation {res['seconds']} s; rows of an interrupted run of the same "
        "model and workload are reused).",
        "",
        f"Model: tiny Gemma-4-MoE shape {json.dumps({k: v for k, v in m['shape'].items() if k != 'layer_types'})}; "
        f"safetensors {m['file_bytes'] / mb:.1f} MB, of which routed experts {m['expert_bytes'] / mb:.1f} MB "
        f"({m['expert_share']:.1%}); one expert {m['one_expert_bytes'] / mb:.3f} MB; resident part "
        f"{m['resident_bytes'] / mb:.1f} MB. Random init (routing of an untrained router).",
        "",
        f"Workload: {res['workload']['prefill_tokens']}-token prefill, then {res['workload']['teacher_forced_steps']} "
        "single-token steps with the KV cache on held-out text (teacher forced). Each row a fresh process; peak RSS = "
        "VmHWM (load and run apart, the high-water mark reset in between); page cache warm.",
        "",
        "| configuration | budget MB | load peak RSS MB | run peak RSS MB | run peak - baseline MB | steps tok/s (*) | "
        "steps tok per CPU-s (*) | hit rate | MB read / step (measured) | MB / step (predicted) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        budget = f"{r['budget'] / mb:.1f}" if r["budget"] else "-"
        cache = (f"{r['step_hit_rate']:.3f} | {r['step_bytes_read'] / STEPS / mb:.2f} | {r['predicted_bytes_per_step'] / mb:.2f}"
                 if "cache" in r else "- | - | -")
        lines.append(f"| {r['name']} | {budget} | {r['load_peak_rss'] / mb:.0f} | {r['run_peak_rss'] / mb:.0f} | "
                     f"{(r['run_peak_rss'] - r['baseline_rss']) / mb:.0f} | {r['steps_tokens_per_s']:.2f} | "
                     f"{r['steps_tokens_per_cpu_s']:.2f} | {cache} |")
    g = res["gguf"]
    lines += ["", "(*) rows of this table ran minutes apart on a host shared with other jobs: their speeds are not "
              "comparable with each other; the interleaved table below is.", "",
              f"Speed, interleaved ({SPEED_ROUNDS} rounds, each configuration in turn in a fresh process, {SPEED_STEPS} "
              "teacher-forced steps after the 32-token prefill); per round, tokens per wall second and per CPU second, "
              "and each as a ratio to accelerate's disk offload in the same round (cold-storage rows: to accelerate "
              "with cold storage). Cold storage: before every step the model file's pages are dropped from the page "
              "cache (posix_fadvise DONTNEED; pages a process has mapped stay), so experts not in the process's own "
              "cache are read from the disk:", "",
              "| configuration | tok/s per round | x accelerate (wall) | tok per CPU-s per round | x accelerate (CPU) |",
              "|---|---|---|---|---|"]
    for n, v in res["speed_interleaved"].items():
        lines.append(f"| {n} | {', '.join(f'{x:.2f}' for x in v['tokens_per_s'])} | "
                     f"{', '.join(f'{x:.2f}' for x in v['x_accelerate_disk'])} | "
                     f"{', '.join(f'{x:.2f}' for x in v.get('tokens_per_cpu_s', []))} | "
                     f"{', '.join(f'{x:.2f}' for x in v.get('x_accelerate_disk_cpu', []))} |")
    lines += ["", f"Routing statistics: {res['routing']} (train split); prediction: Che's LRU approximation "
              "(hfscale/plan/moe_serving.py). Prefetch row: read-ahead used "
              + ", ".join(f"{r['cache']['prefetch_hits']}/{r['cache']['prefetched']}" for r in res["rows"]
                          if r.get("cache", {}).get("prefetched")) + ".",
              f"GGUF F16 file {g['bytes'] / mb:.1f} MB; vs transformers on 2 held-out prompts: top-1 "
              f"{g['vs_transformers']['top1_agreement']:.3f}, max |dlogit| {g['vs_transformers']['max_abs_dlogit']:.4f} "
              "(untrained: near-uniform next-token logits and 64 near-equal router probabilities, so fp16 rounding flips "
              "top-8 choices; on a trained 26B-A4B shape the same export agrees at F16 top-1 0.997, "
              "tests/test_export_gguf_moe.py). Its speed and RSS are what this row measures.",
              f"Importing transformers and the Gemma 4 model code takes RSS from {res['imports']['baseline_rss'] / mb:.0f} to "
              f"{res['imports']['imports_rss'] / mb:.0f} MB (nothing loaded); hfscale.experts rows' run peak above that + "
              "resident weights + budget (activations, KV cache, allocator): "
              + ", ".join(f"{r['name'].split(' ', 1)[1]}: {r['overhead_rss'] / mb:.0f} MB" for r in res["rows"] if "overhead_rss" in r) + ".",
              "Baseline RSS (interpreter + torch, before loading) per row: "
              + ", ".join(f"{r['baseline_rss'] / mb:.0f}" for r in res["rows"]) + " MB.",
              "End-of-run RSS split (anon / file-backed MB): "
              + "; ".join(f"{r['name']}: {r['rss_anon_end'] / mb:.0f} / {r['rss_file_end'] / mb:.0f}" for r in res["rows"]) + ".",
              ""]
    return "\n".join(lines)


def _plot(res: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["name"] for r in res["rows"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(16, 5))
    a.barh(names, [r["run_peak_rss"] / 1e6 for r in res["rows"]], label="run peak")
    a.barh(names, [r["baseline_rss"] / 1e6 for r in res["rows"]], label="baseline (before load)", alpha=0.6)
    a.set_xlabel("RSS MB")
    a.legend()
    a.invert_yaxis()
    sp = res["speed_interleaved"]  # only the interleaved runs are comparable on a shared host
    y = range(len(sp))
    b.barh([i - 0.2 for i in y], [v["median"] for v in sp.values()], height=0.4, label="per wall second")
    b.barh([i + 0.2 for i in y], [v.get("median_cpu", 0) for v in sp.values()], height=0.4, label="per CPU second")
    b.set_yticks(list(y), list(sp))
    b.legend()
    b.set_xlabel(f"tokens/s, interleaved runs (median of {SPEED_ROUNDS})")
    b.set_xscale("log")
    b.invert_yaxis()
    fig.suptitle(f"tiny Gemma-4 MoE, {res['model']['expert_share']:.0%} experts, {res['host']['cpu_capability']}")
    fig.tight_layout()
    from hfscale.util.atomic import staged

    with staged(out) as tmp:
        fig.savefig(tmp, dpi=90, format="png")


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        print(json.dumps(worker(json.loads(sys.stdin.read()))))
        sys.exit(0)
    sys.exit(main())
