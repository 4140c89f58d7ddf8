"""On-device speed of an artifact in its own runtime: prefill tokens/s, decode tokens/s, time to
first token, peak RSS, file bytes, with the thread count stated. What `hfscale bench` runs.

Each run is a fresh process (`python -m hfscale.export.bench WORKER_JSON`), so its peak RSS
(VmHWM of that process: interpreter + runtime + model + KV cache) is that artifact's
alone, and nothing is warm from a previous run. In one run:
- load the artifact (load_s);
- prefill: the prompt's tokens in one call (llama.cpp: `Llama.eval`, n_batch 512; transformers: one
  forward with the cache on; ExecuTorch: the exported program takes one token per call - see
  export/pte.py - so its "prefill" is prompt_tokens single-token steps, said in the result);
- time to first token = prefill + the argmax of the last position's logits;
- decode: `decode_tokens` single-token steps, each feeding the previous argmax back (greedy; EOS
  does not stop it), timed together: decode_tokens_per_s = decode_tokens / their seconds.
The prompt is held-out text (the built-in corpus's validation split) tokenized with the artifact's
tokenizer (a transformers dir's own; for .gguf / .pte the source model named in its sidecar, else
the built-in one), repeated if shorter than --prompt-tokens.

Runs of A and B under --compare alternate (A B A B ...) in one invocation, so both see the same
machine state; ratios are B / A of the medians. Timings only mean something on the host they were
measured on: results carry the host's CPU (host_info: torch's CPU capability, bf16 flags). Runs on CPU;
the .gguf path uses llama.cpp's plain CPU buffers (verify_llama._plain_cpu_buffers: the AMX
repack segfaults on some hosts).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..util.errors import HfscaleError, first_line

KINDS = {"gguf": "llama.cpp (llama-cpp-python)", "pte": "executorch.runtime (XNNPACK)", "transformers": "transformers (torch eager)"}
METRICS = ("prefill_tokens_per_s", "decode_tokens_per_s", "ttft_s", "peak_rss_bytes", "load_s")
# for a ratio B / A: which direction is better, so the table can say "faster" / "smaller"
HIGHER_IS_BETTER = {"prefill_tokens_per_s": True, "decode_tokens_per_s": True, "ttft_s": False, "peak_rss_bytes": False,
                    "load_s": False, "bytes": False}


@dataclass(frozen=True)
class BenchSpec:
    prompt_tokens: int = 1024
    decode_tokens: int = 256
    runs: int = 3
    threads: int = 0  # 0: the cores this process may run on

    def __post_init__(self):
        if min(self.prompt_tokens, self.decode_tokens, self.runs) < 1 or self.threads < 0:
            raise HfscaleError("--prompt-tokens, --decode-tokens and --runs must be >= 1 and --threads >= 0")

    @property
    def n_threads(self) -> int:
        return self.threads or len(os.sched_getaffinity(0))


@dataclass(frozen=True)
class Run:
    prefill_tokens: int
    decode_tokens: int
    prefill_s: float
    decode_s: float
    ttft_s: float
    load_s: float
    peak_rss_bytes: int
    baseline_rss_bytes: int  # after imports, before the artifact is loaded
    threads: int

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_s

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s


@dataclass(frozen=True)
class BenchResult:
    artifact: str
    kind: str
    runtime: str
    bytes: int
    spec: BenchSpec
    runs: tuple[Run, ...]
    prefill_mode: str

    def median(self, metric: str) -> float:
        return statistics.median(getattr(r, metric) for r in self.runs)

    def spread(self, metric: str) -> tuple[float, float]:
        vals = [getattr(r, metric) for r in self.runs]
        return min(vals), max(vals)

    def to_dict(self) -> dict:
        out = {"artifact": self.artifact, "kind": self.kind, "runtime": self.runtime, "bytes": self.bytes,
               "threads": self.runs[0].threads, "runs": len(self.runs), "prompt_tokens": self.spec.prompt_tokens,
               "decode_tokens": self.spec.decode_tokens, "prefill_mode": self.prefill_mode}
        out.update({m: self.median(m) for m in METRICS})
        out["peak_rss_bytes"] = int(out["peak_rss_bytes"])
        out["spread"] = {m: {"min": self.spread(m)[0], "max": self.spread(m)[1]} for m in METRICS}
        out["per_run"] = [{**asdict(r), "prefill_tokens_per_s": r.prefill_tokens_per_s,
                           "decode_tokens_per_s": r.decode_tokens_per_s} for r in self.runs]
        return out


# --- what an artifact is -------------------------------------------------------------------------


def artifact_kind(path: str) -> str:
    p = Path(path)
    if not p.exists():
        raise HfscaleError(f"{path} not found; give a .gguf file, a .pte file or a transformers directory")
    if p.is_file() and p.suffix in (".gguf", ".pte"):
        return p.suffix[1:]
    if p.is_dir() and (p / "config.json").is_file():
        return "transformers"
    raise HfscaleError(f"{path} is not a .gguf file, a .pte file or a transformers directory (with config.json)")


def artifact_bytes(path: str, kind: str) -> int:
    from ..compress.save import dir_bytes

    return dir_bytes(path) if kind == "transformers" else Path(path).stat().st_size


def _sidecar(path: str) -> dict:
    from .sidecar import sidecar_path

    sc = sidecar_path(Path(path))
    try:
        return json.loads(sc.read_text()) if sc.is_file() else {}
    except (OSError, ValueError):
        return {}


def tokenizer_source(path: str, kind: str) -> str:
    from ..models.builtin import TINY, has_tokenizer

    if kind == "transformers":
        return path if has_tokenizer(path) else TINY
    src = _sidecar(path).get("source", {}).get("model")
    return src if src and (src == TINY or Path(src).is_dir()) and has_tokenizer(src) else TINY


def prompt_ids(path: str, kind: str, n: int) -> list[int]:
    """n token ids of held-out text under the artifact's tokenizer (bos first)."""
    from ..data.corpus import load_text
    from ..models.builtin import load_tokenizer

    tok = load_tokenizer(tokenizer_source(path, kind))
    ids: list[int] = []
    for text in load_text()["validation"]["text"]:
        ids.extend(tok(text, add_special_tokens=False).input_ids)
        if len(ids) >= n:
            break
    while len(ids) < n - 1:  # a corpus shorter than the prompt: repeat it
        ids = ids + ids
    return [tok.bos_token_id if tok.bos_token_id is not None else ids[0]] + ids[: n - 1]


def check_fits(path: str, kind: str, spec: BenchSpec) -> None:
    if kind != "pte":
        return
    limit = _sidecar(path).get("scheme", {}).get("max_seq_len")
    need = spec.prompt_tokens + spec.decode_tokens
    if limit is not None and need > limit:
        raise HfscaleError(f"{path} was exported with a {limit}-token KV cache but --prompt-tokens {spec.prompt_tokens} + "
                           f"--decode-tokens {spec.decode_tokens} = {need}; lower them or re-export with "
                           f"hfscale quantize --format pte --max-seq-len {need}")


# --- one run, in its own process ------------------------------------------------------------------


def _rss_now() -> int:
    with open("/proc/self/status") as f:
        return int(next(ln for ln in f if ln.startswith("VmRSS:")).split()[1]) * 1024


def _peak_rss() -> int:
    """VmHWM: the peak RSS of this process's own address space. Not getrusage's ru_maxrss, which Linux
    carries across exec from the forking parent (measured: every run reported its 1 GiB parent's peak)."""
    with open("/proc/self/status") as f:
        return int(next(ln for ln in f if ln.startswith("VmHWM:")).split()[1]) * 1024


def _run_gguf(path: str, ids: list[int], n_decode: int, threads: int) -> dict:
    import llama_cpp
    import numpy as np

    from .verify_llama import _plain_cpu_buffers

    base = _rss_now()
    t = time.perf_counter()
    with _plain_cpu_buffers():
        llm = llama_cpp.Llama(path, n_ctx=len(ids) + n_decode + 8, n_batch=512, n_threads=threads,
                              n_threads_batch=threads, logits_all=False, verbose=False, seed=0)
    load = time.perf_counter() - t
    n_vocab = llm.n_vocab()

    def last_argmax() -> int:
        return int(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,)).argmax())

    try:
        t = time.perf_counter()
        llm.eval(ids)
        prefill = time.perf_counter() - t
        tok = last_argmax()
        ttft = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(n_decode):
            llm.eval([tok])
            tok = last_argmax()
        decode = time.perf_counter() - t
        assert llm.n_tokens == len(ids) + n_decode
    finally:
        llm.close()
    return {"load_s": load, "prefill_s": prefill, "ttft_s": ttft, "decode_s": decode, "baseline_rss_bytes": base,
            "threads": threads}


def _run_pte(path: str, ids: list[int], n_decode: int, threads: int) -> dict:
    from executorch.extension.pybindings import portable_lib

    from .pte import PteRunner

    portable_lib._unsafe_reset_threadpool(threads)
    base = _rss_now()
    t = time.perf_counter()
    rt = PteRunner(Path(path))
    load = time.perf_counter() - t
    t = time.perf_counter()
    for i, tok in enumerate(ids[:-1]):
        rt.step(tok, i)
    last = rt.step(ids[-1], len(ids) - 1)
    prefill = time.perf_counter() - t
    tok = int(last.argmax())
    ttft = time.perf_counter() - t
    t = time.perf_counter()
    for i in range(n_decode):
        tok = int(rt.step(tok, len(ids) + i).argmax())
    decode = time.perf_counter() - t
    assert len(rt.step_seconds) == len(ids) + n_decode
    return {"load_s": load, "prefill_s": prefill, "ttft_s": ttft, "decode_s": decode, "baseline_rss_bytes": base,
            "threads": int(portable_lib._threadpool_get_thread_count())}


def _run_transformers(path: str, ids: list[int], n_decode: int, threads: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    base = _rss_now()
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, use_safetensors=True).eval()
    model.config.use_cache = True
    load = time.perf_counter() - t
    with torch.inference_mode():
        t = time.perf_counter()
        out = model(input_ids=torch.tensor([ids]), use_cache=True)
        prefill = time.perf_counter() - t
        tok = int(out.logits[0, -1].argmax())
        ttft = time.perf_counter() - t
        cache, n = out.past_key_values, len(ids)
        t = time.perf_counter()
        for i in range(n_decode):
            out = model(input_ids=torch.tensor([[tok]]), past_key_values=cache, use_cache=True,
                        cache_position=torch.tensor([n + i]))
            cache, tok = out.past_key_values, int(out.logits[0, -1].argmax())
        decode = time.perf_counter() - t
    return {"load_s": load, "prefill_s": prefill, "ttft_s": ttft, "decode_s": decode, "baseline_rss_bytes": base,
            "threads": torch.get_num_threads()}


RUNNERS = {"gguf": _run_gguf, "pte": _run_pte, "transformers": _run_transformers}


def _worker(job: dict) -> dict:
    ids = job["ids"]
    got = RUNNERS[job["kind"]](job["path"], ids, job["decode_tokens"], job["threads"])
    return {**got, "prefill_tokens": len(ids), "decode_tokens": job["decode_tokens"], "peak_rss_bytes": _peak_rss()}


def run_once(path: str, kind: str, ids: list[int], spec: BenchSpec) -> Run:
    """One measured run in a fresh Python process."""
    job = {"path": str(path), "kind": kind, "ids": ids, "decode_tokens": spec.decode_tokens, "threads": spec.n_threads}
    env = {**os.environ, "OMP_NUM_THREADS": str(spec.n_threads), "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run([sys.executable, "-m", "hfscale.export.bench"], input=json.dumps(job), capture_output=True,
                       text=True, env=env, timeout=3600)
    if r.returncode != 0:
        lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
        raise HfscaleError(f"{KINDS[kind]} could not run {path}: {lines[-1][:240] if lines else 'exit ' + str(r.returncode)}")
    return Run(**json.loads(r.stdout.strip().splitlines()[-1]))


# --- the verb ----------------------------------------------------------------------------------


def bench(paths: list[str], spec: BenchSpec, progress: bool = True) -> list[BenchResult]:
    """Bench each artifact spec.runs times, runs interleaved across artifacts (A B A B ...)."""
    from tqdm.auto import tqdm

    kinds = [artifact_kind(p) for p in paths]
    for p, k in zip(paths, kinds):
        check_fits(p, k, spec)
    ids = [prompt_ids(p, k, spec.prompt_tokens) for p, k in zip(paths, kinds)]
    runs: list[list[Run]] = [[] for _ in paths]
    bar = tqdm(total=spec.runs * len(paths), desc="bench", disable=not progress)
    for _ in range(spec.runs):
        for j, (p, k) in enumerate(zip(paths, kinds)):
            runs[j].append(run_once(p, k, ids[j], spec))
            bar.update(1)
    bar.close()
    return [BenchResult(str(p), k, KINDS[k], artifact_bytes(p, k), spec, tuple(rs),
                        "one call over the prompt" if k != "pte" else "one token per call (the program's only method)")
            for p, k, rs in zip(paths, kinds, runs)]


def host_info(threads: int) -> dict:
    import platform

    import torch

    from ..util.hosts import bf16_support

    model = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), platform.machine())
    return {"cpu": model, "cpu_capability": torch.backends.cpu.get_cpu_capability(), "bf16": bf16_support("cpu").detail,
            "native_bf16": bf16_support("cpu").native, "cores_available": len(os.sched_getaffinity(0)), "threads": threads}


def ratios(a: BenchResult, b: BenchResult) -> dict:
    """B / A of the medians (and of the file sizes)."""
    out = {m: b.median(m) / a.median(m) for m in METRICS if a.median(m)}
    out["bytes"] = b.bytes / a.bytes
    return out


def table(results: list[BenchResult]) -> str:
    head = ("| artifact | runtime | bytes | threads | prefill tok/s | decode tok/s | ttft s | peak RSS MiB | runs |\n"
            "|---|---|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for r in results:
        def cell(m, fmt):
            lo, hi = r.spread(m)
            return f"{fmt(r.median(m))} ({fmt(lo)}-{fmt(hi)})" if len(r.runs) > 1 else fmt(r.median(m))
        rows.append(f"| {r.artifact} | {r.kind} | {r.bytes:,} | {r.runs[0].threads} | "
                    f"{cell('prefill_tokens_per_s', lambda v: f'{v:,.0f}')} | {cell('decode_tokens_per_s', lambda v: f'{v:,.1f}')} | "
                    f"{cell('ttft_s', lambda v: f'{v:.3f}')} | {cell('peak_rss_bytes', lambda v: f'{v / 2**20:,.0f}')} | {len(r.runs)} |")
    return "\n".join([head, *rows]) + "\n(median, min-max over runs in parentheses)"


def ratio_table(a: BenchResult, b: BenchResult) -> str:
    rs = ratios(a, b)
    lines = ["| B / A | ratio | |", "|---|---:|---|"]
    for m, v in rs.items():
        better = (v > 1) == HIGHER_IS_BETTER[m]
        lines.append(f"| {m} | {v:.3f} | {'B better' if better and v != 1 else 'A better' if v != 1 else 'equal'} |")
    return f"A = {a.artifact}, B = {b.artifact} (measured in the same invocation, runs alternating)\n" + "\n".join(lines)


def main() -> int:
    try:
        print(json.dumps(_worker(json.loads(sys.stdin.read()))))
    except Exception as e:  # the parent reports the last stderr line as one HfscaleError
        print(f"{type(e).__name__}: {first_line(e, 300)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
