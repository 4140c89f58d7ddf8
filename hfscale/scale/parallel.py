"""Whether a model can be split the way a `Parallel` asks, read from its config alone: attention heads,
key/value heads per layer kind (Gemma 4's global layers have fewer), head sizes, the transformers TP plan,
sliding windows. Pure: a config in, problems out (each with the exact value to set). Used by
`hfscale config --model`, `hfscale plan`, `hfscale doctor` and the recipe's pre-flight.

What the engines do, read from the installed code (DeepSpeed 0.19.8, accelerate 1.16, transformers 5.24):
  Ulysses SP (deepspeed/runtime/sequence_parallel/ulysses_sp.py): heads % sp == 0; KV heads % sp == 0 or
    sp % KV heads == 0 (then KV heads are replicated); its shape checks use num_key_value_heads and head_dim
    for every layer; the wrapper sets attention_mask = None for sdpa / flash, so sdpa runs every layer causal
    over the whole sequence (a sliding window is lost; flash_attention_2 receives sliding_window itself).
  Transformers TP (base_model_tp_plan): q/k/v/gate/up colwise, o/down rowwise, so heads, every KV head
    count and the MLP width must divide by tp. Its "replicated_with_grad_allreduce" norms (Gemma's q_norm /
    k_norm) all-reduce param.grad in a post-accumulate-grad hook, so gradient accumulation counts earlier
    micro batches twice (measured on 2 CPU ranks; tests/test_parallel_engine.py).
  Torch CP (accelerate cp_backend="torch"): sdpa with is_causal only; no windowed or custom masks.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..util.errors import ConfigError


@dataclass(frozen=True)
class Problem:
    code: str
    severity: str  # error | warning
    what: str
    fix: str


@dataclass(frozen=True)
class Heads:
    """The numbers splitting depends on."""

    model_type: str
    q: int
    kv: dict  # layer kind -> KV heads, e.g. {"sliding_attention": 16, "full_attention": 4}
    head_dim: dict  # layer kind -> head size
    intermediate: int
    sliding_window: int | None  # set when some layers are sliding-window layers
    tp_plan: dict


def heads(config) -> Heads:
    """From hfscale.models.dims where it knows the family (Gemma 4's per-layer heads included), else from the
    config's own attributes. A `Heads` (e.g. hfscale.plan.shape's cached one) is returned as it is."""
    from ..util.errors import HfscaleError
    from ..models.dims import dims_from_config

    if isinstance(config, Heads):
        return config

    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    plan = dict(getattr(type(c), "base_model_tp_plan", None) or getattr(c, "base_model_tp_plan", None) or {})
    try:
        d = dims_from_config(config)
    except HfscaleError:
        d = None
    kv, hd = {}, {}
    if d is not None:
        for ld in d.layers_dims():
            if not ld.kv_shared:
                kv[ld.attention], hd[ld.attention] = ld.kv_heads, ld.head_dim
        sliding = "sliding_attention" in kv
        return Heads(d.model_type, d.heads, kv, hd, d.intermediate, d.sliding_window if sliding else None, plan)
    q = int(c.num_attention_heads)
    kinds = sorted(set(getattr(c, "layer_types", None) or ["full_attention"]))
    for kind in kinds:
        kv[kind] = int(getattr(c, "num_key_value_heads", None) or q)
        hd[kind] = int(getattr(c, "head_dim", None) or c.hidden_size // q)
    window = getattr(c, "sliding_window", None) if "sliding_attention" in kinds else None
    return Heads(c.model_type, q, kv, hd, int(getattr(c, "intermediate_size", 0) or 0), window, plan)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def model_problems(parallel, config, seq_len: int | None = None, window_sdpa: bool = False,
                   grad_accum: int | None = None) -> list[Problem]:
    """Every reason `parallel` cannot run `config` correctly. `window_sdpa`: the launch registers
    hfscale.scale.ulysses.use_window_sdpa (sliding windows rebuilt from position_ids under Ulysses)."""
    h = heads(config)
    out: list[Problem] = []
    sp, tp, cp = parallel.sp, parallel.tp, parallel.cp
    if sp > 1:
        if h.q % sp:
            out.append(Problem("sp-heads", "error", f"{h.q} attention heads do not divide by sp={sp} (Ulysses gives each "
                               "rank heads/sp heads)", f"set sp to one of {_divisors(h.q)}"))
        for kind, kv in h.kv.items():
            if kv % sp and sp % kv:
                out.append(Problem("sp-kv-heads", "error", f"{kv} KV heads ({kind} layers) and sp={sp}: neither divides "
                                   "the other, so Ulysses can neither split nor replicate them",
                                   f"set sp to one of {_divisors(kv)} or a multiple of {kv} that divides {h.q}"))
        if len(set(h.kv.values())) > 1 or len(set(h.head_dim.values())) > 1:
            big = max(h.head_dim.values())
            out.append(Problem("sp-mixed-heads", "warning",
                               f"layers differ in KV heads {h.kv} / head size {h.head_dim}: DeepSpeed 0.19.8 sizes its one "
                               "Ulysses attention from a single num_key_value_heads / head_dim (on Gemma 4 transformers "
                               "refuses that read: AmbiguousGlobalPerLayerAttributeError at accelerator.prepare)"
                               + (f"; flash_attention_2 takes head sizes up to 256, these layers have {big}" if big > 256 else ""),
                               "use hfscale.scale.ulysses.per_layer_heads(model) around accelerator.prepare (recipes/"
                               "train_clm.py does): one Ulysses attention per layer shape"))
        if h.sliding_window and parallel.sp_attention == "sdpa" and not window_sdpa:
            out.append(Problem("sp-sliding-window", "error",
                               f"Ulysses drops the attention mask, so under sdpa the sliding-window layers (window "
                               f"{h.sliding_window}) silently attend to the whole sequence (measured: logits differ from "
                               f"position {h.sliding_window} on)",
                               "set parallelism_config_sp_attn_implementation: flash_attention_2 (GPU; honours sliding_window), "
                               "or call hfscale.scale.ulysses.use_window_sdpa() before accelerator.prepare"))
        if seq_len and seq_len % sp:
            out.append(Problem("sp-seq-len", "error", f"sequence length {seq_len} does not divide by sp={sp}",
                               f"use a sequence length that is a multiple of {sp}, e.g. {seq_len - seq_len % sp or sp}"))
    if tp > 1:
        if not h.tp_plan:
            out.append(Problem("tp-no-plan", "error", f"transformers has no tensor-parallel plan for {h.model_type} "
                               "(config.base_model_tp_plan is empty)", "set tp 1 and shard with ZeRO-3 / FSDP2 instead"))
        if h.q % tp:
            out.append(Problem("tp-heads", "error", f"{h.q} attention heads do not divide by tp={tp}",
                               f"set tp to one of {_divisors(h.q)}"))
        for kind, kv in h.kv.items():
            if kv % tp:
                out.append(Problem("tp-kv-heads", "error", f"{kv} KV heads ({kind} layers) do not divide by tp={tp} "
                                   "(k_proj / v_proj are split by columns)", f"set tp to one of {_divisors(kv)}"))
        allreduced = sorted(k for k, v in h.tp_plan.items() if v == "replicated_with_grad_allreduce")
        if allreduced and grad_accum and grad_accum > 1:
            out.append(Problem("tp-accumulation", "error",
                               f"transformers 5.24 all-reduces the gradients of {', '.join(allreduced)} in a post-accumulate "
                               f"hook, on the accumulated gradient: with {grad_accum} accumulation steps the earlier micro "
                               "batches are summed again (measured: q_norm / k_norm gradients off by 19-39% with 2 steps, "
                               "exact with 1)", "set gradient_accumulation_steps: 1 (raise the micro batch instead)"))
        if h.intermediate and h.intermediate % tp:
            out.append(Problem("tp-mlp", "error", f"MLP width {h.intermediate} does not divide by tp={tp}",
                               f"set tp to a divisor of {h.intermediate}"))
    if cp > 1:
        if h.sliding_window:
            out.append(Problem("cp-mask", "error", f"torch context parallel runs causal sdpa only, and {h.model_type} has "
                               f"sliding-window layers (window {h.sliding_window}) that need a windowed mask",
                               "set cp 1 and use --sp (DeepSpeed Ulysses with flash_attention_2) for long sequences"))
        if seq_len and seq_len % (2 * cp):
            out.append(Problem("cp-seq-len", "error", f"sequence length {seq_len} does not split into 2 x cp={cp} "
                               "load-balanced chunks", f"use a multiple of {2 * cp}"))
    return out


def require_model_fits(parallel, config, name: str, seq_len: int | None = None, window_sdpa: bool = False) -> None:
    """Raise ConfigError (one line, exit 2 in the CLI) on the first error problem."""
    for p in model_problems(parallel, config, seq_len, window_sdpa):
        if p.severity == "error":
            raise ConfigError(f"{name}: {p.what}; {p.fix}")
