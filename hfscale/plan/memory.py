"""Per-GPU memory of training (and inference) from a model's dimensions alone.

Model states (per rank, Ψ parameters, N data-parallel ranks; ZeRO paper, Rajbhandari et al. 2020):
  bf16 mixed precision: weights 2Ψ, gradients 2Ψ, optimizer = fp32 master 4Ψ + state
  fp32:                 weights 4Ψ, gradients 4Ψ, optimizer = state
  state: AdamW 8Ψ (two fp32 moments), 8-bit Adam 2Ψ, SGD with momentum 4Ψ
  ZeRO-1 divides the optimizer by N, ZeRO-2 also the gradients, ZeRO-3 also the weights.
  (bf16 AdamW, no ZeRO: 2+2+12 = 16Ψ; ZeRO-3: 16Ψ/N — the paper's K = 12.)
  DDP bf16 runs as accelerate runs it: autocast over fp32 weights and gradients (4 + 4 + 8 = 16Ψ, `runs_as`).
  Offload moves the optimizer and the fp32 gradient partition (cpu/nvme) and, at stage 3, the weights
  off the GPU (ZeRO-Offload / ZeRO-Infinity papers); ZeRO-3 keeps gathered parameters on the GPU as DeepSpeed
  ranks were measured to (`zero3_gathered`, plan/zero.py): the whole model below stage3_max_reuse_distance
  (1e9 elements), else the largest module's parameters and gradients.
This is the fast path (`hfscale plan --fast`): the terms above summed, no temporaries and no phases. The
default plan traces the step (trace.py, peak.py, zero.py); tests/test_plan_default.py compares the two.

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
fp32 log-softmax of the logits 4TV (the largest single tensor at Gemma's 262k vocabulary), plus the
T·V tanh output when final_logit_softcapping is set; rotary cos/sin 2·S·d·bytes for each rotary embedding a
non-checkpointed layer uses (Gemma 3/4: one per attention type; Llama-likes: one); ~20T of ids, labels and
loss bookkeeping.
Gemma sliding layers under sdpa once S >= sliding_window: transformers passes an explicit mask (skipped only
while kv_length < window), which sdpa saves as an additive one (e·B·S²), and without enable_gqa (needs no
mask) the keys/values reach sdpa as repeat_kv copies: + 2e·T·(q-kv)·d unless kv is 1 or q.
Where the coefficients come from: counting the tensors HF's eager Gemma3/Llama layers save (norms
in fp32 inside bf16 models, q/k norms, repeat_kv-expanded keys/values, softmax probabilities, the
GeGLU/SwiGLU MLP's three T·I tensors plus the product), confirmed by least squares over random
shapes with zero residual (benchmarks/plan_accuracy.py re-measures them on every run).

Gemma 4 (gemma4_text) layers differ from one another (head size and K/V heads by attention type, KV-shared
layers without k/v, k_eq_v, double-wide MLPs, per-layer inputs, MoE), so its activations are summed layer by
layer from the tensor-by-tensor count in `gemma4_layer_bytes` (same measurement, zero residual on small
configs of every variant); its final_logit_softcapping adds the T x V tanh output.

LoRA / DoRA / QLoRA (peft, the adapter spec's targets: q/k/v/o/gate/up/down of every decoder layer by default, as
the recipe adapts them): adapters r·(in+out) per targeted linear (+ out for DoRA's magnitude vector), trained in fp32
(4 B weights + 4 B gradients + optimizer state per adapter parameter); the frozen base costs 2 B/param in
bf16, or for QLoRA bitsandbytes' NF4 on every decoder linear (0.5 B + 1/64 B uint8 absmax + 4/16384 B of the
double-quantized absmax per weight, `nf4_base_bytes`) with embeddings, norms and the lm_head 16-bit.
Inference weights: bf16 2 B, int8 1 B + per-channel fp16 scales, int4 0.5 B + fp16 scale per group of 32.

KV cache (inference): 2 x layers x kv_heads x head_dim x bytes x batch x tokens, where a sliding-window
layer holds at most `sliding_window` tokens (Gemma 3/4 mix local and global layers; transformers'
DynamicSlidingWindowLayer keeps window - 1) and Gemma 4's KV-shared layers hold none.
Fixed overheads are stated separately, never folded in: CUDA context ~0.5 GiB, allocator
fragmentation ~10% of the peak, first-step warm-up buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..util.errors import HfscaleError
from ..scale.checkpointing import checkpointed_layers, parse_checkpointing
from ..scale.optim import ADAMW, DEFAULT_ADAMW
from ..models.dims import Dims

OPTIMIZER_STATE_BYTES = {"adamw": 8, "adamw8bit": 2, "sgd": 4}
CUDA_CONTEXT_BYTES = 512 * 2**20
LEVERS = ("none", "tiled", "tiled+offload")  # ALST's long-context levers as the planner considers them
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
    lora_rank: int = 0  # > 0: adapters of this rank (kind: `adapter`), base frozen
    base_bits: int = 16  # 16 (LoRA / DoRA) or 4 (QLoRA, NF4 base): follows `adapter`
    # none | lora | dora | qlora: hfscale.scale.adapters.AdapterSpec's kind (the recipe's adapter section); a bare
    # lora_rank means lora (qlora with base_bits 4), a kind without a rank the spec's default rank
    adapter: str = "none"
    sp: int = 1  # sequence parallel (DeepSpeed Ulysses); dp counts replicas, so world = dp x sp x tp x cp
    tp: int = 1  # tensor parallel (transformers tp_plan)
    cp: int = 1  # context parallel (torch, FSDP2)
    engine: str = "auto"  # auto: DDP at ZeRO 0, DeepSpeed at 1-3 | fsdp2: torch fully_shard through accelerate
    levers: str = "none"  # long context (ALST): none | tiled (logits + loss, MLP) | tiled+offload (+ activations to host)
    adamw: str = DEFAULT_ADAMW  # torch AdamW's implementation the step is traced with (hfscale.scale.optim)
    # rows packed with documents (hfscale.models.documents): sdpa / eager get a block-diagonal [B, 1, S, S] mask per
    # layer type, counted by the trace only (not in the analytic terms); flash varlen builds none (plan it unpacked),
    # and Ulysses rows (sp > 1) are planned with flash
    packing: bool = False

    def __post_init__(self):
        if self.zero not in (0, 1, 2, 3):
            raise HfscaleError(f"--zero must be 0, 1, 2 or 3 (got {self.zero})")
        if self.dp < 1 or self.micro_batch < 1 or self.seq_len < 1:
            raise HfscaleError("--dp, --micro-batch and --seq-len must be positive integers")
        if self.precision not in ("bf16", "fp32"):
            raise HfscaleError(f"--precision must be bf16 or fp32 (got {self.precision})")
        if self.optimizer not in OPTIMIZER_STATE_BYTES:
            raise HfscaleError(f"--optimizer must be one of {', '.join(OPTIMIZER_STATE_BYTES)}")
        if self.adamw not in ADAMW:
            raise HfscaleError(f"--adamw must be one of {', '.join(ADAMW)} (got {self.adamw!r})")
        self._settle_adapter()
        if self.attention not in ("sdpa", "eager"):
            raise HfscaleError("--attention must be sdpa or eager")
        if self.offload not in ("none", "cpu", "nvme"):
            raise HfscaleError("--offload must be none, cpu or nvme")
        if self.offload != "none" and self.zero == 0 and self.engine != "fsdp2":
            raise HfscaleError("offload needs ZeRO 1-3 or --engine fsdp2; use --zero 2 or 3")
        try:
            parse_checkpointing(self.checkpointing)
        except ValueError as e:
            raise HfscaleError(str(e)) from None
        if min(self.sp, self.tp, self.cp) < 1 or (self.sp > 1 and self.cp > 1):
            raise HfscaleError("--sp, --tp and --cp must be at least 1, and --sp and --cp exclude each other")
        if self.levers not in LEVERS:
            raise HfscaleError(f"levers must be one of {', '.join(LEVERS)} (got {self.levers!r})")
        if self.engine not in ("auto", "fsdp2"):
            raise HfscaleError(f"--engine must be auto or fsdp2 (got {self.engine!r})")
        fsdp2 = self.engine == "fsdp2"
        if self.sp > 1 and self.zero < 2:
            raise HfscaleError(f"--sp {self.sp} is DeepSpeed Ulysses: it needs --zero 2 or 3")
        if self.cp > 1 and not (self.zero == 3 or fsdp2):
            raise HfscaleError(f"--cp {self.cp} runs under FSDP2: give --zero 3 (planned as FSDP2) or --engine fsdp2")
        if self.tp > 1 and self.zero in (1, 2):
            raise HfscaleError(f"--tp {self.tp} runs under FSDP2 or DDP: give --zero 3 or --zero 0")
        if self.engine == "fsdp2" and (self.zero or self.offload == "nvme" or self.sp > 1):
            raise HfscaleError("--engine fsdp2 shards parameters, gradients and optimizer by itself: drop --zero, --sp "
                               "(DeepSpeed Ulysses) and --offload nvme (FSDP2 offloads to cpu)")

    def _settle_adapter(self):
        """adapter / lora_rank / base_bits made one consistent spec (frozen: set once, here)."""
        from ..scale.adapters import KINDS, AdapterSpec

        if self.adapter not in KINDS:
            raise HfscaleError(f"--adapter must be one of {', '.join(KINDS)} (got {self.adapter!r})")
        if self.lora_rank < 0 or self.base_bits not in (16, 4):
            raise HfscaleError("--lora-rank must be >= 0 and --base-bits 16 or 4")
        kind = self.adapter
        if kind == "none" and self.lora_rank:
            kind = "qlora" if self.base_bits == 4 else "lora"
        if kind == "none":
            if self.base_bits == 4:
                raise HfscaleError("--base-bits 4 is QLoRA: give --adapter qlora (or --lora-rank)")
            return
        if self.base_bits == 4 and kind != "qlora":
            raise HfscaleError(f"--base-bits 4 is QLoRA's NF4 base, and --adapter {kind} keeps a 16-bit one; "
                               "use --adapter qlora")
        object.__setattr__(self, "adapter", kind)
        object.__setattr__(self, "lora_rank", self.lora_rank or AdapterSpec.rank)
        object.__setattr__(self, "base_bits", KINDS[kind][0])

    @property
    def adapter_spec(self):
        """The hfscale.scale.adapters.AdapterSpec planned (kind none: full fine-tuning)."""
        from ..scale.adapters import AdapterSpec

        return AdapterSpec(self.adapter, rank=self.lora_rank or AdapterSpec.rank)

    @property
    def label(self) -> str:
        parts = ["FSDP2" if self.engine == "fsdp2" else "DDP" if self.zero == 0 else f"ZeRO-{self.zero}"]
        parts += [f"{k.upper()}{v}" for k, v in (("sp", self.sp), ("tp", self.tp), ("cp", self.cp)) if v > 1]
        if self.lora_rank:
            parts.append(f"{ {'qlora': 'QLoRA', 'dora': 'DoRA'}.get(self.adapter, 'LoRA')}-r{self.lora_rank}")
        if self.offload != "none":
            parts.append(f"+{self.offload}")
        if self.levers != "none":
            parts.append(f"+{self.levers.replace('offload', 'act-offload')}")
        if self.packing:
            parts.append("packed")
        parts.append(f"ckpt:{self.checkpointing}")
        parts.append(f"mb{self.micro_batch}")
        return " ".join(parts)


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


def _rmsnorm_bytes(rows: int, width: int, bf16: bool, input_saved: bool = True, scaled: bool = True) -> int:
    """What HF's Gemma 3/4 RMSNorm saves: x.float() (in fp32 that is x itself, so it is counted where x is
    first saved; in bf16 a fresh fp32 copy), two fp32 per-row statistics (mean square + eps, its pow -0.5),
    and with a weight the fp32 normalised x and (bf16 only) the weight's fp32 copy."""
    n = 4 * rows * width if input_saved else 0
    n += 2 * 4 * rows
    if scaled:
        n += 4 * rows * width + (4 * width if bf16 else 0)
    return n


def eager_kv_views(B: int, q: int, kv: int, cache: bool) -> bool:
    """Whether eager attention's two matmuls save the keys/values themselves (views) rather than q-head copies
    made by repeat_kv / matmul's batch folding. With checkpointing off, transformers' default use_cache=True
    builds a DynamicCache even in training, whose keys/values are contiguous (B, kv, S, d) tensors: views when
    kv = q, or kv = 1 at B = 1. Without a cache (checkpointing sets use_cache=False) the keys are transposed
    projections: views only at B = 1 with kv = 1 or kv = q."""
    if cache:
        return kv == q or (kv == 1 and B == 1)
    return B == 1 and kv in (1, q)


def sdpa_masked(d: Dims, attention_type: str, S: int) -> bool:
    """transformers gives sdpa an explicit mask on a sliding layer once the sequence reaches the window
    (masking_utils: the causal-mask skip needs kv_length < sliding_window); full layers use is_causal (no
    padding assumed: packed blocks)."""
    return attention_type == "sliding_attention" and bool(d.sliding_window) and S >= d.sliding_window


def sdpa_kv_as_is(d: Dims, ld, S: int) -> bool:
    """Whether sdpa saves the layer's keys/values un-repeated: no grouping (kv = q), one K/V head (repeat_kv
    is then a stride-0 view), or enable_gqa, which transformers' sdpa_attention_forward uses on CUDA/CPU only
    without a mask and with head_dim <= 256 (Gemma 4's 512-wide global heads get repeat_kv copies)."""
    return ld.kv_heads in (1, d.heads) or (not sdpa_masked(d, ld.attention, S) and ld.head_dim <= 256)


def gemma4_layer_bytes(d: Dims, i: int, B: int, S: int, bf16: bool, attention: str = "sdpa", cache: bool = False) -> int:
    """Bytes one non-checkpointed Gemma 4 decoder layer saves (transformers' Gemma4TextDecoderLayer, counted
    tensor by tensor; T = B·S tokens, e = 2 (bf16) / 4 (fp32) bytes, fp32 statistics inside every RMSNorm):
      input/post-attention/pre-FF/post-FF RMSNorm(h)   4 x [4Th + 8T (+4h bf16)] + 4Th (the normed x)
      q/k/v and MLP inputs (norm outputs)               2 x eTh
      q_norm(d) 8T·q·d + 8T·q; k_norm(d) 8T·kv·d + 8T·kv; v_norm (no weight) 4T·kv·d + 8T·kv
        (k_eq_v: v_norm's input is the k projection, shared with k_norm's in fp32 only: -4T·kv·d)
      fused attention (sdpa): q, out e·T·q·d each, fp32 logsumexp 4T·q, k, v e·T·kv·d each, or e·T·q·d each
        when repeat_kv copies them (see sdpa_kv_as_is), and on sliding layers with S >= window the mask eB·S²
      eager: q, o_proj input e·T·q·d each, fp32 softmax 4B·q·S² (+ bf16 copy 2B·q·S²), and repeat_kv'd k, v
        e·T·q·d each (copies), or the un-repeated k, v e·T·kv·d when saved as views (see eager_kv_views)
      GeGLU MLP: gate output (gelu input), gelu output, up, product: 4 x e·T·I
      layer_scalar buffer e
    KV-shared layers (num_kv_shared_layers) have no k/v projections or norms and their keys/values are the
    producing layer's tensors (already counted there). Per-layer inputs (p = hidden_size_per_layer_input):
      gate input eTh, gelu input / output, product e·T·p each, post_per_layer_input_norm as above.
    MoE (router + experts, the default grouped_mm experts path, k = top_k, I' = moe_intermediate_size):
      post_feedforward_layernorm_1/_2 as above; router.norm (no weight) 8T (+4Th bf16: its own fp32 copy);
      router: normed x eTh, fp32 softmax 4T·E, top-k ids 8Tk, fp32 top-k values, sum and weights 4Tk+4T+4Tk,
      gathered per_expert_scale eTk; router.proj input eTh; pre_feedforward_layernorm_2 (input shared with
      pre-FF norm in fp32); experts: sort/gather/scatter ids 3 x 8Tk, offsets 4E, gathered x and down output
      e·Tk·h each, gate_up output e·Tk·2I', gelu output and product e·Tk·I' each, fp32 routing weights 4Tk.
    """
    ld = d.per_layer[i]
    T, h, q, kv, hd, I = B * S, d.hidden, d.heads, ld.kv_heads, ld.head_dim, ld.intermediate
    e = 2 if bf16 else 4
    # layer 0's input in fp32 is the embedding output, counted once outside the layers
    n = _rmsnorm_bytes(T, h, bf16, input_saved=bf16 or i > 0)  # input_layernorm
    n += e * T * h  # q/k/v projection input
    n += _rmsnorm_bytes(T * q, hd, bf16)  # q_norm (its input: q_proj output, in fp32 the same storage)
    if not ld.kv_shared:
        n += _rmsnorm_bytes(T * kv, hd, bf16)  # k_norm
        n += _rmsnorm_bytes(T * kv, hd, bf16, input_saved=bf16 or not ld.k_eq_v, scaled=False)  # v_norm
    if attention == "sdpa":
        n += 2 * e * T * q * hd + 4 * T * q  # query, output (= o_proj input), fp32 logsumexp
        if sdpa_masked(d, ld.attention, S):
            n += e * B * S * S  # the sliding-window mask, converted to an additive one in the model dtype
        if not sdpa_kv_as_is(d, ld, S):
            n += 2 * e * T * q * hd  # repeat_kv'd copies of the keys and values
        elif not ld.kv_shared:
            n += 2 * e * T * kv * hd  # rotated keys, normed values
    else:  # q copy, o_proj input, fp32 softmax (+ its bf16 copy), keys and values for the two matmuls
        n += 2 * e * T * q * hd + 4 * B * q * S * S + (2 * B * q * S * S if bf16 else 0)
        if not eager_kv_views(B, q, kv, cache):
            n += 2 * e * T * q * hd  # repeat_kv'd copies
        elif not ld.kv_shared:
            n += 2 * e * T * kv * hd  # the keys / values themselves (stride-0 views, no copy)
    n += 3 * _rmsnorm_bytes(T, h, bf16)  # post_attention, pre_feedforward, post_feedforward
    n += e * T * h + 4 * e * T * I  # GeGLU MLP
    if ld.moe:
        k, E, Im = d.top_k, d.experts, d.moe_intermediate
        n += 2 * _rmsnorm_bytes(T, h, bf16)  # post_feedforward_layernorm_1, _2
        n += _rmsnorm_bytes(T, h, bf16, input_saved=bf16, scaled=False)  # router.norm
        n += e * T * h + 4 * T * E + 8 * T * k + 4 * T * k + 4 * T + 4 * T * k + e * T * k  # router
        n += e * T * h  # router.proj input
        n += _rmsnorm_bytes(T, h, bf16, input_saved=bf16)  # pre_feedforward_layernorm_2
        n += 3 * 8 * T * k + 4 * E + 2 * e * T * k * h + 4 * e * T * k * Im + 4 * T * k  # experts
    if d.ple_dim:
        p = d.ple_dim
        n += e * T * h + 3 * e * T * p + _rmsnorm_bytes(T, h, bf16)  # per-layer input gate, product, norm
    return n + e  # layer_scalar


def _gemma4_activation_bytes(d: Dims, B: int, S: int, precision: str, checkpointing: str, attention: str) -> dict:
    """Gemma 4: the layers one by one (they differ), then what lives outside them:
      ids 8T, target 8T (+8 at B = 1), loss 4, embed scale e; the embedding output eTh once (in fp32 it is layer 0's
      norm input; saved also by the PLE projection or by a checkpointed layer 0); final RMSNorm and lm_head
      input eTh; fp32 log-softmax 4TV, plus the tanh output eTV with final_logit_softcapping;
      rotary cos/sin 2·S·d·e once per attention type that has a non-checkpointed layer (d differs by type);
      per-layer inputs: the packed table lookup's scale e, RMSNorm(p) over T·L rows, the combined
      T x L x p input e·T·L·p (one storage, sliced by every layer);
      a checkpointed layer saves its input eTh; when a K/V producer is checkpointed, its keys and values
      (2e·T·kv·d) are saved by the first non-checkpointed layer that reuses them (fused attention, or eager
      attention where the keys/values are saved as views)."""
    T, h, V, L = B * S, d.hidden, d.vocab, d.layers
    bf16 = precision == "bf16"
    e = 2 if bf16 else 4
    ckpt = set(checkpointed_layers(checkpointing, L))
    cache = not ckpt  # transformers turns use_cache off when checkpointing in training
    per = [gemma4_layer_bytes(d, i, B, S, bf16, attention, cache) for i in range(L)]
    layers = sum(e * T * h if i in ckpt and i > 0 else (0 if i in ckpt else per[i]) for i in range(L))
    for j in {ld.kv_source for ld in d.per_layer if ld.kv_shared}:
        pj = d.per_layer[j]
        as_is = sdpa_kv_as_is(d, pj, S) if attention == "sdpa" else eager_kv_views(B, d.heads, pj.kv_heads, cache)
        if as_is and j in ckpt and any(ld.kv_source == j and c not in ckpt for c, ld in enumerate(d.per_layer)):
            layers += 2 * e * T * pj.kv_heads * pj.head_dim
    # ids, shifted labels (B = 1: a view of the (S+1)-long padded row; else a contiguous copy), loss, embed_scale
    head = 8 * T + 8 * (T + (B == 1)) + 4 + e
    if d.ple_dim or 0 in ckpt or not bf16:
        head += e * T * h  # embedding output
    head += _rmsnorm_bytes(T, h, bf16) + e * T * h  # final norm, lm_head input
    if d.ple_dim:
        head += e + _rmsnorm_bytes(T * L, d.ple_dim, bf16) + e * T * L * d.ple_dim
    rotary = 0
    for t in {ld.attention for ld in d.per_layer}:
        live = [ld for i, ld in enumerate(d.per_layer) if ld.attention == t and i not in ckpt]
        if live:
            rotary += 2 * S * live[0].head_dim * e
    logits = 4 * T * V + (e * T * V if d.final_softcap else 0)
    recompute = max(per) if ckpt else 0
    return {"layers": layers, "head": head + rotary, "logits": logits, "total": layers + head + rotary + logits,
            "recompute_working": recompute}


def activation_bytes(d: Dims, B: int, S: int, precision: str = "bf16", checkpointing: str = "off",
                     attention: str = "sdpa") -> dict:
    """Bytes saved for backward by one micro batch (B sequences of S tokens), split into parts."""
    if d.family == "gemma4":
        return _gemma4_activation_bytes(d, B, S, precision, checkpointing, attention)
    T = B * S
    elem = 2 if precision == "bf16" else 4
    ckpt = set(checkpointed_layers(checkpointing, d.layers))
    n_ckpt = len(ckpt)
    per_layer = layer_activation_bytes(d, B, S, precision, attention)
    layers = (d.layers - n_ckpt) * per_layer + n_ckpt * elem * T * d.hidden
    live = [ld for i, ld in enumerate(d.layers_dims()) if i not in ckpt]
    if d.family == "gemma" and attention == "sdpa":
        # a sliding layer at S >= window gets an explicit mask (saved as an additive one, eB·S²) and then no
        # enable_gqa: repeat_kv'd keys/values (e·T·q·d each instead of e·T·kv·d) unless kv = 1 or kv = q
        masked = sum(sdpa_masked(d, ld.attention, S) for ld in live)
        copies = 0 if d.kv_heads in (1, d.heads) else 2 * elem * T * (d.heads - d.kv_heads) * d.head_dim
        layers += masked * (elem * B * S * S + copies)
    head_h = 12 if precision == "fp32" else (10 if d.family == "gemma" else 8)
    head = head_h * T * d.hidden + 20 * T + (4 * d.hidden if d.family == "gemma" else 0)
    # rotary cos/sin, saved once per rotary embedding used by a non-checkpointed layer: Gemma 3 has one per
    # attention type (local / global bases), Llama-likes one for all layers
    ropes = len({ld.attention for ld in live}) if d.family == "gemma" else int(bool(live))
    rotary = 2 * S * d.head_dim * elem * ropes
    logits = 4 * T * d.vocab  # fp32 log-softmax of the logits, kept for the loss backward
    if d.final_softcap:
        logits += elem * T * d.vocab  # tanh output of final_logit_softcapping (Gemma 2/3)
    # recompute working memory: one checkpointed layer's activations rebuilt during backward
    recompute = per_layer if n_ckpt else 0
    return {"layers": layers, "head": head + rotary, "logits": logits, "total": layers + head + rotary + logits,
            "recompute_working": recompute}


def decoder_linears(d: Dims) -> list[tuple[str, int, int]]:
    """(leaf name, in, out) of every nn.Linear in the decoder layers and beside them (not the lm_head). Gemma 4 per
    layer: its own head size and K/V heads, no k/v on KV-shared layers, no v with k_eq_v, its MLP width, the
    per-layer-input gate h->p and projection p->h, the MoE router's h->E (experts are 3-D parameters, not Linear);
    once: the PLE model projection h->L*p."""
    h = d.hidden
    if not d.per_layer:
        q, kv, I = d.heads * d.head_dim, d.kv_heads * d.head_dim, d.intermediate
        one = [("q_proj", h, q), ("k_proj", h, kv), ("v_proj", h, kv), ("o_proj", q, h),
               ("gate_proj", h, I), ("up_proj", h, I), ("down_proj", I, h)]
        return one * d.layers
    p, out = d.ple_dim, []
    if p:
        out.append(("per_layer_model_projection", h, d.layers * p))
    for ld in d.per_layer:
        q, kv, I = d.heads * ld.head_dim, ld.kv_heads * ld.head_dim, ld.intermediate
        out += [("q_proj", h, q), ("o_proj", q, h), ("gate_proj", h, I), ("up_proj", h, I), ("down_proj", I, h)]
        if not ld.kv_shared:
            out += [("k_proj", h, kv)] + ([] if ld.k_eq_v else [("v_proj", h, kv)])
        if p:
            out += [("per_layer_input_gate", h, p), ("per_layer_projection", p, h)]
        if ld.moe:
            out.append(("proj", h, d.experts))  # router.proj
    return out


def lora_params(d: Dims, spec) -> int:
    """Trainable parameters of an adapter (hfscale.scale.adapters.AdapterSpec, or a bare rank = the default spec's
    targets) on the decoder: r x (in + out) per targeted linear, + out for DoRA's magnitude vector. The targets are
    the recipe's (q/k/v/o/gate/up/down by default), so Gemma 4's per-layer-embedding projections and router get none."""
    from ..scale.adapters import AdapterSpec

    if isinstance(spec, int):
        spec = AdapterSpec("lora", rank=spec)
    wanted, r = set(spec.targets), spec.rank
    # spec.experts: peft's target_parameters puts one A [r·E, in] and one B [out, r·E] on each fused expert tensor,
    # gate_up_proj [E, 2I', h] and down_proj [E, h, I']: r·E·(h + 2I') + r·E·(I' + h) per MoE layer
    experts = sum(r * d.experts * (2 * d.hidden + 3 * d.moe_intermediate) for ld in d.per_layer if ld.moe)
    return sum(r * (i + o) + (o if spec.dora else 0) for name, i, o in decoder_linears(d) if name in wanted) + (
        experts if getattr(spec, "experts", False) else 0)


def expert_params(d: Dims) -> int:
    """MoE expert weights (3-D parameters, not nn.Linear: bitsandbytes leaves them 16-bit, LoRA skips them)."""
    return sum(3 * d.experts * d.hidden * d.moe_intermediate for ld in d.per_layer if ld.moe)


# bitsandbytes' NF4 as QLoRA loads it (hfscale.scale.adapters.bnb_config: blocksize 64, double quantization): per
# weight 4 bits, per block of 64 one uint8 absmax code, per 256 of those blocks one fp32 absmax of the absmax codes,
# per tensor one fp32 offset (the mean subtracted before the absmax codes are quantized); the two 256-entry fp32 code
# books per tensor are not counted (2 KB a tensor: 0.01% of a 1B base). Without double quantization the block absmax
# is fp32: 0.5 + 4 / 64 per weight.
NF4_BLOCK = 64
NF4_BYTES_PER_PARAM = 0.5 + 1 / NF4_BLOCK + 4 / (NF4_BLOCK * 256)


def nf4_tensor_bytes(n: int) -> int:
    """One weight of n elements in NF4 as bitsandbytes stores it (blocks rounded up, as its kernels allocate them)."""
    blocks = -(-n // NF4_BLOCK)
    return (n + 1) // 2 + blocks + 4 * -(-blocks // 256) + 4


def nf4_base_bytes(d: Dims, elem_bytes: int = 2) -> dict:
    """A QLoRA base: every decoder nn.Linear in NF4 (transformers' bitsandbytes quantizer converts all but the
    lm_head), the rest (embeddings, Gemma 4's per-layer table, norms, MoE experts, an untied lm_head) in the
    compute dtype. {"nf4": the 4-bit weights with their quant state, "other": the rest, "total"}."""
    shapes = decoder_linears(d)
    linear = sum(i * o for _, i, o in shapes)
    nf4 = sum(nf4_tensor_bytes(i * o) for _, i, o in shapes)
    other = elem_bytes * (d.params - linear)
    return {"nf4": nf4, "other": other, "total": nf4 + other, "nf4_params": linear}


def shard(weights: int, grads: int, optim: int, zero: int, n: int) -> tuple[int, int, int]:
    """ZeRO-1 partitions the optimizer state over n ranks, ZeRO-2 also the gradients, ZeRO-3 also the weights."""
    return (weights // n if zero >= 3 else weights, grads // n if zero >= 2 else grads, optim // n if zero >= 1 else optim)


def _lora_states(d: Dims, s: Strategy) -> dict:
    """Frozen base + trainable adapters (peft keeps adapters in fp32, so no separate master copy)."""
    A, N = lora_params(d, s.adapter_spec), s.dp
    if s.base_bits == 4:  # decoder linears NF4; embeddings (Gemma 4's per-layer table too), lm_head, experts 16-bit
        base = nf4_base_bytes(d)["total"]
    else:
        base = (2 if runs_as(s.precision, s.zero) == "bf16" else 4) * d.params
    weights, grads, optim = shard(base + 4 * A, 4 * A, OPTIMIZER_STATE_BYTES[s.optimizer] * A, s.zero, N)
    return {"weights": weights, "gradients": grads, "optimizer": optim,
            "zero3_live": zero3_gathered(d, 2) if s.zero == 3 else 0, "offloaded_per_rank": 0, "trainable": A}


def runs_as(precision: str, zero: int, engine: str = "auto") -> str:
    """What a planned precision runs as, the one place this is decided (the trace and the analytic states both
    follow it): bf16 under DDP (ZeRO-0 when the engine is "auto") is accelerate's autocast over fp32 weights, as
    the written accelerate config runs it; under DeepSpeed bf16 weights with fp32 master weights, and under FSDP2
    (MixedPrecisionPolicy) bf16 copies of its fp32 shards, traced like DeepSpeed's."""
    if precision == "bf16":
        ddp = zero == 0 if engine == "auto" else engine.lower() not in ("deepspeed", "fsdp2", "fsdp")
        return "bf16-autocast" if ddp else "bf16"
    return precision


def zero3_gathered(d: Dims, elem_bytes: int) -> int:
    """ZeRO-3's gathered parameters in a steady step, as measured on DeepSpeed ranks (zero.py): every parameter
    stays gathered while the model has fewer elements than stage3_max_reuse_distance, else the largest module's
    parameters and gradients at a time."""
    from .zero import REUSE_DISTANCE

    return elem_bytes * d.params if d.params <= REUSE_DISTANCE else 2 * elem_bytes * d.largest_layer_params


def model_state_bytes(d: Dims, s: Strategy) -> dict:
    if s.lora_rank:
        return _lora_states(d, s)
    P, N = d.params, s.dp
    runs = runs_as(s.precision, s.zero)
    # bf16 under DeepSpeed: bf16 weights and gradients + an fp32 master copy; under DDP accelerate autocasts over
    # fp32 weights and gradients (no master copy); fp32: fp32 throughout. AdamW's moments are fp32 in all three.
    w_b, g_b = (2, 2) if runs == "bf16" else (4, 4)
    master = 4 if runs == "bf16" else 0
    opt_b = master + OPTIMIZER_STATE_BYTES[s.optimizer]
    weights, grads, optim = shard(w_b * P, g_b * P, opt_b * P, s.zero, N)
    off = {"optimizer": 0, "gradients": 0, "weights": 0}
    live = zero3_gathered(d, w_b) if s.zero == 3 else 0
    if s.offload != "none":
        # ZeRO-Offload: the optimizer step runs on the CPU, so per rank the optimizer partition (bf16: fp32
        # master 4Ψ/N + Adam moments 8Ψ/N) and the fp32 gradient partition 4Ψ/N live there (DeepSpeed keeps
        # that .grad allocated on the offload device); the GPU keeps only the 16-bit reduce buckets (counted as
        # zero here). ZeRO-3 with offload_param also moves the 16-bit weight partition 2Ψ/N.
        # (benchmarks/plan_accuracy.py checks each part against the elements real 2-process DeepSpeed ranks held)
        off = {"optimizer": optim, "gradients": 4 * P // N, "weights": weights if s.zero == 3 else 0}
        optim = 0
        grads = 0
        if s.zero == 3:
            weights = 0
    return {"weights": weights, "gradients": grads, "optimizer": optim, "zero3_live": live,
            "offloaded_per_rank": sum(off.values()), "offloaded": off}


def kv_cache_bytes(d: Dims, batch: int, tokens: int, bytes_per_elem: int = 2) -> int:
    """2 (K and V) x kv_heads x head_dim x bytes x batch x tokens held, summed over layers: a sliding-window layer
    holds at most `sliding_window` tokens; Gemma 4's layers have their own head size / K/V heads, and its
    KV-shared layers (num_kv_shared_layers) read an earlier layer's cache and hold none."""
    total = 0
    for ld in d.layers_dims():
        if ld.kv_shared:
            continue
        held = min(tokens, d.sliding_window) if ld.attention == "sliding_attention" and d.sliding_window else tokens
        total += 2 * ld.kv_heads * ld.head_dim * bytes_per_elem * batch * held
    return total


QUANT_BYTES_PER_PARAM = {"bf16": 2.0, "int8": 1.0 + 2 / 4096, "int4": 0.5 + 2 / 32}  # + fp16 scales (per channel / group 32)


def inference_bytes(d: Dims, quant: str, batch: int, context: int) -> dict:
    """Serving memory: decoder weights at a quantization scheme (embeddings stay bf16) + KV cache."""
    if quant not in QUANT_BYTES_PER_PARAM:
        raise HfscaleError(f"--quant must be one of {', '.join(QUANT_BYTES_PER_PARAM)}")
    emb = d.embedding_params * (1 if d.tied else 2) + d.ple_embedding_params
    weights = int((d.params - emb) * QUANT_BYTES_PER_PARAM[quant]) + 2 * emb
    kv = kv_cache_bytes(d, batch, context)
    return {"weights": weights, "kv_cache": kv, "total": weights + kv}


def predict(d: Dims, s: Strategy) -> dict:
    """Per-rank bytes (integers) for one strategy without sp / tp / cp (those: `parallel.predict_parallel`)."""
    if s.sp * s.tp * s.cp > 1:
        raise ValueError("sequence / tensor / context parallel strategies are predicted by hfscale.plan.parallel.predict_parallel")
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
        "offloaded": states.get("offloaded", {"optimizer": 0, "gradients": 0, "weights": 0}),
        "overheads_not_included": {"cuda_context": CUDA_CONTEXT_BYTES, "fragmentation": int(FRAGMENTATION * total)},
        "params": d.params,
        "trainable_params": states.get("trainable", d.params),
    }
