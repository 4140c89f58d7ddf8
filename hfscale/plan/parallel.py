"""Per-rank training memory with sequence (Ulysses), tensor and context parallelism, on top of ZeRO and
checkpointing: what each dimension divides, what it leaves replicated, and the communication buffers.

With sp x tp x cp ranks per replica and dp replicas (world = dp x sp x tp x cp):
  sequence parallel (DeepSpeed Ulysses): every rank holds T/sp tokens of each sequence outside attention; inside
    attention it holds all T tokens of heads/sp heads, the same bytes. Saved activations = activation_bytes at
    S/sp. ZeRO partitions the model states over dp x sp ranks (DeepSpeed's sequence-data-parallel group; measured:
    4 CPU ranks sp 2 -> seq_dp_world_size 4). Buffers: the all-to-all of q, k, v in and the output back,
    send + receive: 2 e (T/sp)(2q + 2kv) d, one layer at a time.
  tensor parallel (transformers tp_plan, colwise q/k/v/gate/up, rowwise o/down): those weights, their gradients
    and optimizer state are split by tp, and so is the lm_head (by vocabulary; tied: the embedding); norms are
    replicated. Saved activations:
    the per-head and MLP-width tensors divide by tp (heads/tp, kv/tp, I/tp), the hidden-size ones (T x h: norms,
    residual, the layer inputs of checkpointed layers) and the logits are replicated. ZeRO / FSDP shards over dp.
    Buffer: the rowwise outputs' all-reduce, 2 e T h.
  context parallel (torch, FSDP2): T/cp tokens per rank everywhere; FSDP shards over dp x cp; the all-gather
    strategy materialises the whole sequence's keys and values for one layer: 2 e T kv d.
Gemma's sliding-window masks are not counted under SP (Ulysses drops them; flash attention needs none).
"""

from __future__ import annotations

from dataclasses import replace

from ..models.dims import Dims
from .memory import CUDA_CONTEXT_BYTES, FRAGMENTATION, Strategy, activation_bytes, model_state_bytes


def layer_linear_params(d: Dims) -> int:
    """Parameters of the linears a transformers TP plan splits (q, k, v, o, gate, up, down), all layers."""
    if d.per_layer:
        h, total = d.hidden, 0
        for i, ld in enumerate(d.per_layer):
            total += d.layer_attn_params(i) - ld.head_dim * (1 if ld.kv_shared else 2)  # minus q_norm / k_norm
            total += 3 * h * ld.intermediate
        return total
    norms = 2 * d.head_dim if d.family == "gemma" else 0
    return d.layers * (d.attn_params - norms + d.mlp_params)


def params_per_tp_rank(d: Dims, tp: int) -> int:
    """Parameters one TP rank holds: the split linears / tp + everything replicated. The CausalLM's own plan
    splits lm_head by vocabulary ("colwise_gather_output"), which for a tied model is the embedding itself
    (measured: the tiny Gemma 3's embed_tokens holds 2,048 of 4,096 rows per rank at tp 2)."""
    split = layer_linear_params(d) + d.vocab * d.hidden
    return d.params - split + split // tp


def tp_dims(d: Dims, tp: int) -> Dims:
    """The per-rank shape of a layer's activations under TP: heads, KV heads and MLP width divided."""
    if tp == 1:
        return d
    per = tuple(replace(ld, kv_heads=max(1, ld.kv_heads // tp), intermediate=ld.intermediate // tp) for ld in d.per_layer)
    return replace(d, heads=d.heads // tp, kv_heads=max(1, d.kv_heads // tp), intermediate=d.intermediate // tp, per_layer=per)


def parallel_buffers(d: Dims, s: Strategy) -> dict[str, int]:
    """The communication buffers of sp / tp / cp per rank (module docstring), one layer at a time."""
    e = 2 if s.precision == "bf16" else 4
    sp, tp, cp = s.sp, s.tp, s.cp
    T = s.micro_batch * s.seq_len
    lds = d.layers_dims()
    kv = max(ld.kv_heads * ld.head_dim for ld in lds)
    q = max(d.heads * ld.head_dim for ld in lds)
    return {
        "sp_all_to_all": 2 * e * (T // sp) * (2 * q + 2 * kv) // tp if sp > 1 else 0,
        "tp_all_reduce": 2 * e * (T // (sp * cp)) * d.hidden if tp > 1 else 0,
        "cp_all_gather": 2 * e * T * kv // tp if cp > 1 else 0,
    }


def predict_parallel(d: Dims, s: Strategy) -> dict:
    """Per-rank bytes with s.sp / s.tp / s.cp > 1 (s.dp = data-parallel replicas); the keys of memory.predict
    plus the buffers."""
    sp, tp, cp = s.sp, s.tp, s.cp
    shard_ranks = s.dp * sp * cp  # ZeRO / FSDP partitions over these (TP splits before sharding)
    states = model_state_bytes(d, replace(s, dp=shard_ranks, sp=1, tp=1, cp=1))
    frac = params_per_tp_rank(d, tp) / d.params
    for k in ("weights", "gradients", "optimizer", "offloaded_per_rank"):
        states[k] = int(states[k] * frac)
    S_local = s.seq_len // (sp * cp)
    act = activation_bytes(tp_dims(d, tp), s.micro_batch, S_local, s.precision, s.checkpointing, s.attention)
    buffers = parallel_buffers(d, s)
    live = states["zero3_live"] if s.zero == 3 else 0
    total = (states["weights"] + states["gradients"] + states["optimizer"] + live + act["total"]
             + act["recompute_working"] + sum(buffers.values()))
    return {
        "weights": states["weights"], "gradients": states["gradients"], "optimizer": states["optimizer"],
        "activations": act["total"], "recompute_working": act["recompute_working"], "zero3_live": live,
        "parallel_buffers": buffers, "total": total,
        "offloaded_per_rank": states["offloaded_per_rank"],
        "offloaded": states.get("offloaded", {"optimizer": 0, "gradients": 0, "weights": 0}),
        "overheads_not_included": {"cuda_context": CUDA_CONTEXT_BYTES, "fragmentation": int(FRAGMENTATION * total)},
        "params": d.params, "params_per_rank": params_per_tp_rank(d, tp), "trainable_params": d.params,
        "tokens_per_rank": s.micro_batch * S_local,
    }


def analytic(d: Dims, s: Strategy) -> dict:
    """The analytic terms of any strategy: `predict_parallel` with sp / tp / cp, else `memory.predict`."""
    from .memory import predict

    return predict_parallel(d, s) if s.sp * s.tp * s.cp > 1 else predict(d, s)


def parallel_options(config, hw, seq_len: int, sp=None, tp=None, cp=None) -> list[tuple[int, int, int]]:
    """(sp, tp, cp) combinations to plan for `hw`: the sizes asked for, or every power of two within one node
    that the model allows (hfscale.scale.parallel's checks, assuming flash attention on GPUs for SP)."""
    from ..scale.parallel import model_problems
    from ..scale.spec import Parallel

    node = hw.gpus_per_node
    pow2 = [n for n in (1, 2, 4, 8, 16) if n <= node and hw.world % n == 0]
    sps = [sp] if sp else pow2
    tps = [tp] if tp else pow2
    cps = [cp] if cp else [1]  # CP (FSDP2) is planned only when asked: accelerate has not run it with Gemma's masks
    out = []
    for a in sps:
        for b in tps:
            for c in cps:
                if a * b * c > node or hw.world % (a * b * c) or (a > 1 and c > 1) or (a > 1 and b > 1):
                    continue
                try:
                    par = Parallel(sp=a, tp=b, cp=c, sp_attention="flash_attention_2")
                except Exception:  # noqa: BLE001 - an invalid combination is simply not a candidate
                    continue
                if not any(p.severity == "error" for p in model_problems(par, config, seq_len=seq_len)):
                    out.append((a, b, c))
    return out
