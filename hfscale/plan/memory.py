"""Per-GPU memory of training (and inference) from a model's dimensions alone.

Model states (per rank, Ψ parameters, N data-parallel ranks; ZeRO paper, Rajbhandari et al. 2020):
  bf16 mixed precision: weights 2Ψ, gradients 2Ψ, optimizer = fp32 master 4Ψ + state
  fp32:                 weights 4Ψ, gradients 4Ψ, optimizer = state
  state: AdamW 8Ψ (two fp32 moments), 8-bit Adam 2Ψ, SGD with momentum 4Ψ
  ZeRO-1 divides the optimizer by N, ZeRO-2 also the gradients, ZeRO-3 also the weights.
  (bf16 AdamW, no ZeRO: 2+2+12 = 16Ψ; ZeRO-3: 16Ψ/N — the paper's K = 12.)
  Offload moves the optimizer and the fp32 gradient partition (cpu/nvme) and, at stage 3, the weights
  off the GPU (ZeRO-Offload / ZeRO-Infinity papers); ZeRO-3 keeps a live
  working set of gathered parameters on the GPU: 4 bytes x the largest module (DeepSpeed's estimator:
  16-bit parameters + 16-bit gradients of the largest layer; for Gemma that is the 262k-row embedding).

Activations = the bytes autograd saves for backward in one micro batch's forward pass (what a
saved-tensors hook sees; each storage once; parameters excluded). Eager attention (below) saves the
B·q·S² softmax probabilities; fused attention (sdpa / flash, the default) saves instead its output and
an fp32 logsumexp, and per layer:
  gemma fp32: 40Th + 16TI + 16T·q·d + 16T·kv·d + 8T·q + 4T·kv + 16T + 16h + 8d
  gemma bf16: 36Th +  8TI + 12T·q·d + 12T·kv·d + 8T·q + 4T·kv + 16T + 16h + 8d
  llama fp32: 24Th + 16TI +  8T·q·d +  8T·kv·d + 4T·q + 8T
  llama bf16: 16Th +  8TI +  4T·q·d +  4T·kv·d + 4T·q + 8T
Eager attention:
T = micro_batch x seq tokens, h hidden, I MLP width, q/kv heads of dim d, V vocab. Per decoder layer:
  gemma fp32: 40Th + 16TI + 4·B·q·S² + 24T·q·d + 8T·kv·d + 4T(q+kv) + 16T + 16h + 8d
  gemma bf16: 36Th +  8TI + 6·B·q·S² + 16T·q·d + 8T·kv·d + 4T(q+kv) + 16T + 16h + 8d
  llama fp32: 24Th + 16TI + 4·B·q·S² + 16T·q·d + 8T          (llama, mistral, qwen2)
  llama bf16: 16Th +  8TI + 6·B·q·S² +  8T·q·d + 8T
A checkpointed layer saves only its input: 4Th (fp32) / 2Th (bf16).
Outside the layers: embedding/final norm 12Th (fp32), 10Th (gemma bf16), 8Th (llama bf16); the
fp32 log-softmax of the logits 4TV (the largest single tensor at Gemma's 262k vocabulary);
rotary cos/sin 2·S·d·bytes when no layer is checkpointed; ~20T of ids, labels and loss bookkeeping.
Where the coefficients come from: counting the tensors HF's eager Gemma3/Llama layers save (norms
in fp32 inside bf16 models, q/k norms, repeat_kv-expanded keys/values, softmax probabilities, the
GeGLU/SwiGLU MLP's three T·I tensors plus the product), confirmed by least squares over random
shapes with zero residual (benchmarks/plan_accuracy.py re-measures them on every run).

LoRA / QLoRA (peft, adapters on every decoder linear): adapters r·(in+out) per linear, trained in fp32
(4 B weights + 4 B gradients + optimizer state per adapter parameter); the frozen base costs 2 B/param in
bf16, or NF4's 0.5 B + its double-quantized block constants for QLoRA (embeddings stay 16-bit).
Inference weights: bf16 2 B, int8 1 B + per-channel fp16 scales, int4 0.5 B + fp16 scale per group of 32.

KV cache (inference): 2 x layers x kv_heads x head_dim x bytes x batch x tokens, where a sliding-window
layer holds at most `sliding_window` tokens (Gemma 3/4 mix local and global layers).
Fixed overheads are stated separately, never folded in: CUDA context ~0.5 GiB, allocator
fragmentation ~10% of the peak, first-step warm-up buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import HfscaleError
from ..scale.spec import parse_checkpointing
from .dims import Dims

OPTIMIZER_STATE_BYTES = {"adamw": 8, "adamw8bit": 2, "sgd": 4}
CUDA_CONTEXT_BYTES = 512 * 2**20
FRAGMENTATION = 0.10


@dataclass(frozen=True)
class Strategy:
    zero: int = 0
    dp: int = 1
    precision: str = "bf16"  # bf16 | fp32
    optimizer: str = "adamw"
    offload: str = "none"  # none | cpu | nvme  (optimizer, and parameters at stage 3)
    checkpointing: str = "off"  # off | full | every:K
    micro_batch: int = 1
    seq_len: int = 2048
    attention: str = "sdpa"  # sdpa / flash (fused) | eager (saves the S² probabilities)
    lora_rank: int = 0  # > 0: LoRA adapters on every decoder linear, base frozen
    base_bits: int = 16  # 16 (LoRA) or 4 (QLoRA, NF4 base)

    def __post_init__(self):
        if self.zero not in (0, 1, 2, 3):
            raise HfscaleError(f"--zero must be 0, 1, 2 or 3 (got {self.zero})")
        if self.dp < 1 or self.micro_batch < 1 or self.seq_len < 1:
            raise HfscaleError("--dp, --micro-batch and --seq-len must be positive integers")
        if self.precision not in ("bf16", "fp32"):
            raise HfscaleError(f"--precision must be bf16 or fp32 (got {self.precision})")
        if self.optimizer not in OPTIMIZER_STATE_BYTES:
            raise HfscaleError(f"--optimizer must be one of {', '.join(OPTIMIZER_STATE_BYTES)}")
        if self.lora_rank < 0 or self.base_bits not in (16, 4) or (self.base_bits == 4 and not self.lora_rank):
            raise HfscaleError("--lora-rank must be >= 0 and --base-bits 16 or 4 (4-bit needs --lora-rank, i.e. QLoRA)")
        if self.attention not in ("sdpa", "eager"):
            raise HfscaleError("--attention must be sdpa or eager")
        if self.offload not in ("none", "cpu", "nvme"):
            raise HfscaleError("--offload must be none, cpu or nvme")
        if self.offload != "none" and self.zero == 0:
            raise HfscaleError("offload needs ZeRO 1-3; use --zero 2 or 3")
        try:
            parse_checkpointing(self.checkpointing)
        except ValueError as e:
            raise HfscaleError(str(e)) from None

    @property
    def label(self) -> str:
        parts = ["DDP" if self.zero == 0 else f"ZeRO-{self.zero}"]
        if self.lora_rank:
            parts.append(f"{'QLoRA' if self.base_bits == 4 else 'LoRA'}-r{self.lora_rank}")
        if self.offload != "none":
            parts.append(f"+{self.offload}")
        parts.append(f"ckpt:{self.checkpointing}")
        parts.append(f"mb{self.micro_batch}")
        return " ".join(parts)


def checkpointed_layers(layers: int, checkpointing: str) -> int:
    mode, k = parse_checkpointing(checkpointing)
    if mode == "off":
        return 0
    if mode == "full":
        return layers
    return len(range(0, layers, k))  # every k-th layer, starting with the first


def layer_activation_bytes(d: Dims, B: int, S: int, precision: str, attention: str = "sdpa") -> int:
    T, h, I, q, kv, hd = B * S, d.hidden, d.intermediate, d.heads, d.kv_heads, d.head_dim
    bf16 = precision == "bf16"
    if attention == "sdpa":  # fused attention: output + fp32 logsumexp instead of the S² probabilities
        if d.family == "gemma":
            if bf16:
                return 36 * T * h + 8 * T * I + 12 * T * q * hd + 12 * T * kv * hd + 8 * T * q + 4 * T * kv + 16 * T + 16 * h + 8 * hd
            return 40 * T * h + 16 * T * I + 16 * T * q * hd + 16 * T * kv * hd + 8 * T * q + 4 * T * kv + 16 * T + 16 * h + 8 * hd
        if bf16:
            return 16 * T * h + 8 * T * I + 4 * T * q * hd + 4 * T * kv * hd + 4 * T * q + 8 * T
        return 24 * T * h + 16 * T * I + 8 * T * q * hd + 8 * T * kv * hd + 4 * T * q + 8 * T
    if d.family == "gemma":
        if bf16:
            return 36 * T * h + 8 * T * I + 6 * B * q * S * S + 16 * T * q * hd + 8 * T * kv * hd + 4 * T * (q + kv) + 16 * T + 16 * h + 8 * hd
        return 40 * T * h + 16 * T * I + 4 * B * q * S * S + 24 * T * q * hd + 8 * T * kv * hd + 4 * T * (q + kv) + 16 * T + 16 * h + 8 * hd
    if bf16:
        return 16 * T * h + 8 * T * I + 6 * B * q * S * S + 8 * T * q * hd + 8 * T
    return 24 * T * h + 16 * T * I + 4 * B * q * S * S + 16 * T * q * hd + 8 * T


def activation_bytes(d: Dims, B: int, S: int, precision: str = "bf16", checkpointing: str = "off",
                     attention: str = "sdpa") -> dict:
    """Bytes saved for backward by one micro batch (B sequences of S tokens), split into parts."""
    T = B * S
    elem = 2 if precision == "bf16" else 4
    n_ckpt = checkpointed_layers(d.layers, checkpointing)
    per_layer = layer_activation_bytes(d, B, S, precision, attention)
    layers = (d.layers - n_ckpt) * per_layer + n_ckpt * elem * T * d.hidden
    head_h = 12 if precision == "fp32" else (10 if d.family == "gemma" else 8)
    head = head_h * T * d.hidden + 20 * T + (4 * d.hidden if d.family == "gemma" else 0)
    rotary = 2 * S * d.head_dim * elem if n_ckpt == 0 else 0
    logits = 4 * T * d.vocab  # fp32 log-softmax of the logits, kept for the loss backward
    # recompute working memory: one checkpointed layer's activations rebuilt during backward
    recompute = per_layer if n_ckpt else 0
    return {"layers": layers, "head": head + rotary, "logits": logits, "total": layers + head + rotary + logits,
            "recompute_working": recompute}


def lora_params(d: Dims, r: int) -> int:
    """r x (in + out) for q, k, v, o, gate, up, down of every layer (peft target_modules="all-linear")."""
    h, q, kv, I = d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim, d.intermediate
    per_layer = r * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + I) + (I + h))
    return d.layers * per_layer


NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 * 1.0 / 4 + 4 / (64 * 256)  # 4-bit codes + double-quantized block absmax


def shard(weights: int, grads: int, optim: int, zero: int, n: int) -> tuple[int, int, int]:
    """ZeRO-1 partitions the optimizer state over n ranks, ZeRO-2 also the gradients, ZeRO-3 also the weights."""
    return (weights // n if zero >= 3 else weights, grads // n if zero >= 2 else grads, optim // n if zero >= 1 else optim)


def _lora_states(d: Dims, s: Strategy) -> dict:
    """Frozen base + trainable adapters (peft keeps adapters in fp32, so no separate master copy)."""
    A, N = lora_params(d, s.lora_rank), s.dp
    body = d.params - d.embedding_params - (0 if d.tied else d.embedding_params)
    if s.base_bits == 4:  # embeddings / lm_head stay 16-bit under bitsandbytes
        base = int(body * NF4_BYTES_PER_PARAM) + 2 * (d.params - body)
    else:
        base = (2 if s.precision == "bf16" else 4) * d.params
    weights, grads, optim = shard(base + 4 * A, 4 * A, OPTIMIZER_STATE_BYTES[s.optimizer] * A, s.zero, N)
    return {"weights": weights, "gradients": grads, "optimizer": optim,
            "zero3_live": 4 * d.largest_layer_params if s.zero == 3 else 0, "offloaded_per_rank": 0, "trainable": A}


def model_state_bytes(d: Dims, s: Strategy) -> dict:
    if s.lora_rank:
        return _lora_states(d, s)
    P, N = d.params, s.dp
    w_b, g_b = (2, 2) if s.precision == "bf16" else (4, 4)
    master = 4 if s.precision == "bf16" else 0
    opt_b = master + OPTIMIZER_STATE_BYTES[s.optimizer]
    weights, grads, optim = shard(w_b * P, g_b * P, opt_b * P, s.zero, N)
    cpu = 0
    live = 4 * d.largest_layer_params if s.zero == 3 else 0
    if s.offload != "none":
        # ZeRO-Offload: the optimizer step runs on the CPU, so the fp32 gradient partition lives there too;
        # the GPU keeps only the 16-bit reduce buckets (counted as zero here)
        cpu += optim + 4 * P // N
        optim = 0
        grads = 0
        if s.zero == 3:
            cpu += weights
            weights = 0
    return {"weights": weights, "gradients": grads, "optimizer": optim, "zero3_live": live, "offloaded_per_rank": cpu}


def kv_cache_bytes(d: Dims, batch: int, tokens: int, bytes_per_elem: int = 2) -> int:
    total = 0
    types = d.layer_types or ("full_attention",) * d.layers
    for t in types[: d.layers]:
        held = min(tokens, d.sliding_window) if t == "sliding_attention" and d.sliding_window else tokens
        total += 2 * d.kv_heads * d.head_dim * bytes_per_elem * batch * held
    return total


QUANT_BYTES_PER_PARAM = {"bf16": 2.0, "int8": 1.0 + 2 / 4096, "int4": 0.5 + 2 / 32}  # + fp16 scales (per channel / group 32)


def inference_bytes(d: Dims, quant: str, batch: int, context: int) -> dict:
    """Serving memory: decoder weights at a quantization scheme (embeddings stay bf16) + KV cache."""
    if quant not in QUANT_BYTES_PER_PARAM:
        raise HfscaleError(f"--quant must be one of {', '.join(QUANT_BYTES_PER_PARAM)}")
    emb = d.embedding_params * (1 if d.tied else 2)
    weights = int((d.params - emb) * QUANT_BYTES_PER_PARAM[quant]) + 2 * emb
    kv = kv_cache_bytes(d, batch, context)
    return {"weights": weights, "kv_cache": kv, "total": weights + kv}


def predict(d: Dims, s: Strategy) -> dict:
    """Per-rank bytes (integers) for one strategy: the JSON `prediction` object."""
    states = model_state_bytes(d, s)
    act = activation_bytes(d, s.micro_batch, s.seq_len, s.precision, s.checkpointing, s.attention)
    total = states["weights"] + states["gradients"] + states["optimizer"] + states["zero3_live"] + act["total"] + act["recompute_working"]
    return {
        "weights": states["weights"],
        "gradients": states["gradients"],
        "optimizer": states["optimizer"],
        "activations": act["total"],
        "recompute_working": act["recompute_working"],
        "zero3_live": states["zero3_live"],
        "total": total,
        "offloaded_per_rank": states["offloaded_per_rank"],
        "overheads_not_included": {"cuda_context": CUDA_CONTEXT_BYTES, "fragmentation": int(FRAGMENTATION * total)},
        "params": d.params,
        "trainable_params": states.get("trainable", d.params),
    }
