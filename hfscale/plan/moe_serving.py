"""Serving a mixture-of-experts model under a memory budget: what stays resident, what streams, how
much a RAM budget caches, the read traffic per token that routing implies, and llama.cpp's
`--n-cpu-moe` for a GPU.

Resident: every weight but the routed experts (attention, shared MLP, routers, norms, embeddings at
16 bit) plus the KV cache. Streamed: the routed experts, `experts x 3 x hidden x moe_intermediate`
parameters per MoE layer. A budget of B bytes caches floor(B / expert_bytes) experts (hfscale.experts'
LRU, one cache over all layers); a budget below one layer's top-k experts cannot run a token.

Read traffic per token (what hfscale.experts reads from storage, decode, batch 1). Routing statistics
give f[l][e], the expected number of times layer l picks expert e per token (each row sums to top_k):
uniform (k / E) from a config alone, or measured on calibration text by running the model (its
routers see real hidden states). The LRU hit rate follows Che's approximation for a cache of C items
under independent requests with rates f: the characteristic time T solves
    sum_le (1 - exp(-f_le T)) = C,        hit_le = 1 - exp(-f_le T),
    reads/token = sum_le f_le exp(-f_le T) x expert_bytes.
Independence is an assumption: consecutive tokens reuse experts more than it allows (the benchmark
measures by how much: benchmarks/results/experts.md).

llama.cpp (`--n-cpu-moe N` keeps the experts of the first N layers in CPU memory, the rest on the
GPU): GPU bytes = GGUF bytes - N x one layer's experts + KV cache + a compute buffer (stated, not
measured here); N is the smallest that fits. GGUF bytes per weight: F16/BF16 2, Q8_0 34/32, Q4_0
18/32 (ggml block sizes); embeddings at hfscale's default for the qtype, norms F32, routers F32.
No GPU was used: the llama.cpp figures are arithmetic on the file layout.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ..util.errors import HfscaleError
from ..models.dims import Dims
from .memory import expert_params

# transformers-serving --quant -> the GGUF qtype of the same width, and ggml bytes per weight
GGUF_FOR_QUANT = {"bf16": "BF16", "int8": "Q8_0", "int4": "Q4_0"}
LLAMA_COMPUTE_BUFFER = 512 * 2**20  # llama.cpp's CUDA compute buffer, order of magnitude (not measured here)
GPU_SIZES_GB = (8, 12, 16, 24, 48, 80)


@dataclass(frozen=True)
class Routing:
    """Expected selections per token: freq[l][e] for each MoE layer l (rows sum to top_k)."""
    freq: tuple[tuple[float, ...], ...]
    source: str          # "uniform (config only)" or "measured on N calibration tokens"
    tokens: int = 0


def uniform_routing(d: Dims) -> Routing:
    layers = sum(1 for ld in d.per_layer if ld.moe)
    return Routing(tuple((d.top_k / d.experts,) * d.experts for _ in range(layers)), "uniform (config only)")


def measure_routing(model, blocks) -> Routing:
    """Run `model` (full, or with experts offloaded by hfscale.experts) on `blocks` [n, seq] and count each
    router's top-k choices: Gemma 4's `router` and Mixtral / Qwen-MoE's `gate` return (.., .., indices)."""
    import torch

    counts: dict[str, torch.Tensor] = {}
    hooks = []
    for name, mod in model.named_modules():
        if name.endswith((".router", ".mlp.gate")) and hasattr(mod, "forward"):
            def hook(m, args, out, name=name):
                if isinstance(out, tuple) and len(out) == 3:  # (scores [T, E], weights [T, k], indices [T, k])
                    c = torch.bincount(out[2].reshape(-1), minlength=out[0].shape[-1]).double()
                    counts[name] = counts[name] + c if name in counts else c
            hooks.append(mod.register_forward_hook(hook))
    if not hooks:
        raise HfscaleError(f"{type(model).__name__} has no MoE routers to measure; routing statistics need an MoE model")
    tokens = 0
    try:
        with torch.no_grad():
            for b in blocks:
                model(input_ids=b[None])
                tokens += b.numel()
    finally:
        for h in hooks:
            h.remove()
    freq = tuple(tuple((c / tokens).tolist()) for _, c in sorted(counts.items(), key=lambda kv: _layer_of(kv[0])))
    return Routing(freq, f"measured on {tokens} calibration tokens", tokens)


def _layer_of(name: str) -> int:
    import re

    m = re.search(r"layers\.(\d+)\.", name + ".")
    return int(m.group(1)) if m else 0


@dataclass(frozen=True)
class Traffic:
    cache_experts: int
    hit_rate: float              # per expert request
    reads_per_token: float       # experts read per token
    read_bytes_per_token: int


def lru_traffic(routing: Routing, cache_experts: int, expert_bytes: int) -> Traffic:
    """Che's approximation of an LRU cache of `cache_experts` experts under routing.freq (see module doc)."""
    f = [x for row in routing.freq for x in row if x > 0]
    total = sum(f)
    if cache_experts >= len(f):
        return Traffic(cache_experts, 1.0, 0.0, 0)
    if cache_experts <= 0:
        return Traffic(cache_experts, 0.0, total, int(total * expert_bytes))

    def filled(t):
        return sum(1 - math.exp(-x * t) for x in f)

    lo, hi = 0.0, 1.0
    while filled(hi) < cache_experts:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if filled(mid) < cache_experts else (lo, mid)
    t = (lo + hi) / 2
    misses = sum(x * math.exp(-x * t) for x in f)
    return Traffic(cache_experts, 1 - misses / total, misses, int(round(misses * expert_bytes)))


@dataclass(frozen=True)
class LlamaCppFit:
    gpu_mem: int
    n_cpu_moe: int | None        # None: even with every expert on the CPU the rest does not fit
    gpu_bytes: int               # at that setting
    cpu_expert_bytes: int
    flag: str


@dataclass(frozen=True)
class MoEServing:
    quant: str
    bytes_per_param: float
    resident_bytes: int          # weights that stay in memory (no KV cache)
    kv_cache_bytes: int
    streamed_bytes: int          # all routed experts
    expert_bytes: int            # one expert
    moe_layers: int
    experts_per_layer: int
    top_k: int
    min_budget: int              # one layer's top-k experts
    ram_budget: int | None
    cache_experts: int | None
    routing: str
    traffic: tuple[Traffic, ...]  # at the budget, and at 1/8 .. all of the experts
    gguf_qtype: str
    gguf_bytes: int
    llama_cpp: tuple[LlamaCppFit, ...]

    def as_dict(self) -> dict:
        return asdict(self)


def plan(d: Dims, quant: str = "bf16", kv_cache_bytes: int = 0, ram_budget: int | None = None,
         routing: Routing | None = None, gpu_mem: int | None = None) -> MoEServing:
    """The serving plan for an MoE model (see module doc). `quant` as `hfscale plan --quant`."""
    from .memory import QUANT_BYTES_PER_PARAM, inference_bytes

    if not any(ld.moe for ld in d.per_layer):
        raise HfscaleError("this model has no mixture-of-experts layers; the expert-streaming plan is for MoE models")
    bpp = QUANT_BYTES_PER_PARAM[quant]
    weights = inference_bytes(d, quant, 1, 1)["weights"]
    n_exp = expert_params(d)
    moe_layers = sum(1 for ld in d.per_layer if ld.moe)
    expert_bytes = int(math.ceil(3 * d.hidden * d.moe_intermediate * bpp))
    streamed = expert_bytes * d.experts * moe_layers
    resident = weights - int(n_exp * bpp)
    min_budget = d.top_k * expert_bytes
    if ram_budget is not None and ram_budget < min_budget:
        raise HfscaleError(f"--ram-budget {ram_budget:,} bytes is smaller than one layer's routed experts (top-{d.top_k} x "
                           f"{expert_bytes:,} bytes = {min_budget:,}); give at least {min_budget / 1e9:.3f}GB")
    routing = routing or uniform_routing(d)
    if len(routing.freq) != moe_layers:
        raise HfscaleError(f"routing statistics cover {len(routing.freq)} MoE layers, the model has {moe_layers}")
    total = d.experts * moe_layers
    sizes = ([ram_budget // expert_bytes] if ram_budget else []) + [max(1, total * i // 8) for i in (1, 2, 4, 8)]
    traffic = tuple(lru_traffic(routing, c, expert_bytes) for c in sizes)
    qtype = GGUF_FOR_QUANT[quant]
    gguf_bytes, layer_exp_gguf = _gguf_bytes(d, qtype)
    fits = tuple(_fit(g, gguf_bytes, layer_exp_gguf, moe_layers, kv_cache_bytes)
                 for g in ([gpu_mem] if gpu_mem else [int(x * 1e9) for x in GPU_SIZES_GB]))
    return MoEServing(quant, bpp, resident, kv_cache_bytes, streamed, expert_bytes, moe_layers, d.experts, d.top_k,
                      min_budget, ram_budget, ram_budget // expert_bytes if ram_budget else None, routing.source,
                      traffic, qtype, gguf_bytes, fits)


def _gguf_bytes(d: Dims, qtype: str) -> tuple[int, int]:
    """(file bytes of the weights, one MoE layer's experts) in hfscale's GGUF layout at `qtype`."""
    from ..compress.schemes import GGUF_BYTES, default_embed_qtype

    n_exp = expert_params(d)
    layer_exp = 3 * d.experts * d.hidden * d.moe_intermediate
    emb = d.embedding_params + d.ple_embedding_params + (0 if d.tied else d.embedding_params)
    routers = sum(d.hidden * d.experts for ld in d.per_layer if ld.moe)
    body = d.params - emb - n_exp - routers
    q = GGUF_BYTES[qtype]
    total = n_exp * q + body * q + routers * 4 + emb * GGUF_BYTES[default_embed_qtype(qtype)]
    return int(total), int(layer_exp * q)


def _fit(gpu_mem: int, gguf_bytes: int, layer_exp: int, moe_layers: int, kv: int) -> LlamaCppFit:
    for n in range(moe_layers + 1):
        gpu = gguf_bytes - n * layer_exp + kv + LLAMA_COMPUTE_BUFFER
        if gpu <= gpu_mem:
            flag = "-ngl 99" + (f" --n-cpu-moe {n}" if n else "")
            if n == moe_layers:
                flag = "-ngl 99 --cpu-moe  (= -ot exps=CPU)"
            return LlamaCppFit(gpu_mem, n, gpu, n * layer_exp, flag)
    gpu = gguf_bytes - moe_layers * layer_exp + kv + LLAMA_COMPUTE_BUFFER
    return LlamaCppFit(gpu_mem, None, gpu, moe_layers * layer_exp,
                       f"does not fit: {gpu / 1e9:.1f} GB stay on the GPU with every expert on the CPU; offload layers (-ngl)")


def lines(p: MoEServing) -> list[str]:
    """The human-readable report of `hfscale plan --inference` for an MoE model."""
    gb = 1e9
    out = [f"MoE serving ({p.quant}): resident {p.resident_bytes / gb:.2f} GB + KV cache {p.kv_cache_bytes / gb:.2f} GB; "
           f"streamed experts {p.streamed_bytes / gb:.2f} GB ({p.moe_layers} layers x {p.experts_per_layer} experts of "
           f"{p.expert_bytes / 1e6:.2f} MB, top-{p.top_k}); smallest expert budget {p.min_budget / 1e6:.1f} MB"]
    if p.ram_budget:
        out.append(f"  --ram-budget {p.ram_budget / gb:.2f} GB caches {p.cache_experts} experts "
                   f"({p.cache_experts / (p.moe_layers * p.experts_per_layer):.0%}); RSS ~ resident + KV + budget = "
                   f"{(p.resident_bytes + p.kv_cache_bytes + p.ram_budget) / gb:.2f} GB")
    out.append(f"  predicted reads per token ({p.routing} routing, LRU, Che's approximation):")
    for t in p.traffic:
        out.append(f"    cache {t.cache_experts:>6} experts: hit rate {t.hit_rate:.3f}, {t.reads_per_token:.2f} experts = "
                   f"{t.read_bytes_per_token / 1e6:.1f} MB per token")
    out.append(f"  llama.cpp ({p.gguf_qtype} GGUF, {p.gguf_bytes / gb:.2f} GB; + KV + ~{LLAMA_COMPUTE_BUFFER / 2**30:.1f} GiB "
               "compute buffer, not measured):")
    for f in p.llama_cpp:
        out.append(f"    GPU {f.gpu_mem / gb:>4.0f} GB: {f.flag}" + (f"  (GPU {f.gpu_bytes / gb:.1f} GB, CPU experts "
                                                                        f"{f.cpu_expert_bytes / gb:.1f} GB)" if f.n_cpu_moe is not None else ""))
    return out


def for_model(model: str, d: Dims, quant: str, kv_cache_bytes: int, gpu_mem: int | None, ram_budget: int | None = None,
              routing: Routing | None = None, routing_asked: bool = False) -> MoEServing | None:
    """`hfscale plan --inference`'s MoE section: None for a dense model (and its MoE-only settings refused).
    `routing`: statistics measured on the model (hfscale.experts.routing.calibration_routing); None: uniform routing."""
    if not any(ld.moe for ld in d.per_layer):
        given = [f for f, v in (("--ram-budget", ram_budget), ("--routing-blocks", routing_asked)) if v]
        if given:
            raise HfscaleError(f"{given[0]} is for mixture-of-experts models and {model} has none; drop {given[0]}")
        return None
    return plan(d, quant, kv_cache_bytes, ram_budget, routing, gpu_mem)
