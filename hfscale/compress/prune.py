"""Structured pruning of decoder LMs: fewer layers, MLP channels, attention heads / KV groups and
hidden channels, in a new, smaller transformers model (not masks: the matrices are smaller).

    from hfscale.compress.prune import PruneTarget, prune
    small, result = prune(model, PruneTarget(params=0.5), calib_blocks)   # or layers=/intermediate_size=/heads=/hidden_size=
    small.save_pretrained(out)   # hfscale.compress.save.save_model_dir writes it atomically

Method (importance from one calibration pass, then slicing; read from the papers, own code):
- Width, Minitron (Muralidharan et al. 2024, "Compact Language Models via Pruning and Knowledge
  Distillation", arXiv 2407.14679; Sreenivas et al. 2024, arXiv 2408.11796): activation-based
  importance on calibration tokens. MLP channel = mean |input of down_proj| (the gated activation
  the channel feeds forward); attention head = mean L2 norm of the head's output (the input of
  o_proj, per head); KV group = sum of its query heads' importance; hidden (embedding) channel =
  mean |output| of every RMSNorm over the hidden size (Minitron reads the LayerNorm outputs).
  Aggregation here: mean over all calibration tokens.
- Depth, ShortGPT (Men et al. 2024, arXiv 2403.03853) "Block Influence": BI_i = 1 - mean over
  tokens of cos(x_in, x_out) of layer i; the layers with the lowest BI are dropped. Alternative
  (layer_metric="loss", Minitron's depth criterion): the calibration loss increase when layer i is
  skipped (its output replaced by its input). Both are measured on the unpruned model, one shot.
- Heads with GQA: `heads` N keeps every KV group and N / kv query heads in each (the most
  important per group) when kv divides N; else, when the group size g divides N, keeps the N / g
  most important whole KV groups; else it is refused.
- Sliding / global layer patterns (Gemma 3, Gemma 4, Qwen layer_types): each kept layer keeps its
  type; at least one full-attention layer is kept (the most important one if none would be), and
  Gemma 4's last layer, which its config forces to full attention, is always kept.
- `params` F (fraction of the parameter count): layers, heads and any given dims stay; the hidden
  size and the MLP width shrink (Minitron's width-first choice), both multiples of 32 (llama.cpp's
  Q4_0 block, so the result exports): for each hidden size the widest MLP that fits F x the
  parameters (counted on the meta device from the new config); of the candidates within 3% of the
  fullest, the one whose hidden and MLP shrink by the most similar ratio.

What changes beyond the removed channels: pruned hidden channels change each RMSNorm's mean
square and Gemma's embedding scale sqrt(hidden); removed layers change the residual stream the
later ones read. A pruned model is a starting point for distillation (recipes/distill_clm.py),
not a finished one. Runs on CPU (tested here with the tiny Gemma 3, a tiny Gemma 4 dense with
k=v global attention, tiny Llama and Qwen 3 configs); nothing in it is device-specific.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace

from ..util.errors import ConfigError, HfscaleError

# model types whose decoder layers are sliced by the rules in _slice_rule (registry: what is supported)
SUPPORTED = {
    "gemma3_text": "Gemma 3 text (sliding + global layers, q/k norms, GeGLU)",
    "gemma4_text": "Gemma 4 dense text without per-layer embeddings or KV sharing (the 31B layout; k=v global attention ok)",
    "llama": "Llama-style decoders",
    "mistral": "Mistral",
    "qwen2": "Qwen 2 / 2.5 (q/k/v biases)",
    "qwen3": "Qwen 3 dense (q/k norms)",
}
LAYER_METRICS = ("bi", "loss")


@dataclass(frozen=True)
class PruneTarget:
    """What to prune to. `params`: a fraction of the parameter count (0 < F < 1); explicit dims
    (any subset) fix those and, with `params`, the rest is chosen to meet it."""
    params: float | None = None
    layers: int | None = None
    intermediate_size: int | None = None
    heads: int | None = None
    hidden_size: int | None = None
    layer_metric: str = "bi"  # bi (ShortGPT block influence) | loss (loss increase when skipped)

    def __post_init__(self):
        if self.params is not None and not 0 < self.params < 1:
            raise ConfigError(f"--params {self.params}: give a fraction of the parameter count between 0 and 1, e.g. 0.5x")
        for name in ("layers", "intermediate_size", "heads", "hidden_size"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ConfigError(f"--{name.replace('_', '-')} {v}: must be >= 1")
        if self.layer_metric not in LAYER_METRICS:
            raise ConfigError(f"layer metric {self.layer_metric!r}: choose one of {', '.join(LAYER_METRICS)}")
        if self.params is None and all(getattr(self, n) is None for n in ("layers", "intermediate_size", "heads", "hidden_size")):
            raise ConfigError("nothing to prune to: give --params 0.5x or one of --layers/--intermediate-size/--heads/--hidden-size")


@dataclass(frozen=True)
class Dims:
    layers: int
    intermediate_size: int
    heads: int
    hidden_size: int


@dataclass(frozen=True)
class PruneResult:
    model_type: str
    before: Dims
    after: Dims
    params_before: int
    params_after: int
    kept_layers: tuple[int, ...]
    layer_types: tuple[str, ...] | None
    layer_scores: tuple[float, ...]  # per original layer: BI or loss increase (higher = more important)
    layer_metric: str
    calibration_tokens: int
    method: str = ("width: Minitron activation importance (arXiv 2407.14679); depth: ShortGPT block influence "
                   "(arXiv 2403.03853) or loss increase when skipped")
    kv_heads: dict = field(default_factory=dict)  # per kept layer: KV heads before -> after

    @property
    def fraction(self) -> float:
        return self.params_after / self.params_before

    def to_json(self) -> str:
        d = asdict(self)
        d["fraction"] = self.fraction
        return json.dumps(d, indent=1) + "\n"


# --- what a model is --------------------------------------------------------------------------


def check_supported(config) -> None:
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED:
        raise HfscaleError(f"hfscale prune supports model types {', '.join(SUPPORTED)}, not {mt!r}; "
                           "prune the text decoder of a supported family")
    if mt == "gemma4_text":
        bad = [(getattr(config, "enable_moe_block", False), "mixture-of-experts blocks"),
               (getattr(config, "hidden_size_per_layer_input", 0), "per-layer embeddings (E2B/E4B)"),
               (getattr(config, "num_kv_shared_layers", 0), "KV-shared layers (E2B/E4B)")]
        what = [w for flag, w in bad if flag]
        if what:
            raise HfscaleError(f"this Gemma 4 has {' and '.join(what)}, which hfscale prune does not slice; "
                               "it prunes Gemma 4 dense models without them (the 31B layout)")


def dims_of(config) -> Dims:
    return Dims(config.num_hidden_layers, config.intermediate_size, config.num_attention_heads, config.hidden_size)


def _layers(model):
    return model.model.layers


def _attn_shape(layer) -> tuple[int, int, int]:
    """(query heads, KV heads, head_dim) of one decoder layer, read from its modules."""
    a = layer.self_attn
    hd = a.head_dim
    return a.q_proj.out_features // hd, a.k_proj.out_features // hd, hd


def count_params(config) -> int:
    """Parameters of a model built from `config` (meta device: no memory), tied weights once."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in m.parameters())


# --- importance --------------------------------------------------------------------------------


@dataclass
class Importance:
    layer_bi: list          # [L] 1 - mean cos(x_in, x_out)
    mlp: list               # [L] tensors [I]
    heads: list             # [L] tensors [H]
    hidden: object          # tensor [hidden]
    tokens: int
    layer_loss: list | None = None  # [L] loss increase when skipped


def _first_tensor(x):
    return x[0] if isinstance(x, (tuple, list)) else x


def measure_importance(model, blocks, batch_size: int = 8, layer_metric: str = "bi") -> Importance:
    """One pass over the calibration blocks with hooks; plus one pass per layer for layer_metric='loss'."""
    import torch

    layers = _layers(model)
    hidden = model.config.hidden_size
    L = len(layers)
    cos_sum, mlp, heads = [0.0] * L, [None] * L, [None] * L
    hid = torch.zeros(hidden, dtype=torch.float64)
    ntok = 0
    hooks, inputs = [], {}

    def add(store, i, v):
        store[i] = v if store[i] is None else store[i] + v

    for i, layer in enumerate(layers):
        def pre(mod, args, kwargs, i=i):
            inputs[i] = args[0] if args else kwargs["hidden_states"]

        def post(mod, args, kwargs, out, i=i):
            x, y = inputs.pop(i).float(), _first_tensor(out).float()
            cos_sum[i] += float(torch.nn.functional.cosine_similarity(x, y, dim=-1).sum())

        def mlp_in(mod, args, i=i):
            add(mlp, i, args[0].detach().float().abs().sum(dim=(0, 1)).double())

        nq, _, hd = _attn_shape(layer)

        def o_in(mod, args, i=i, nq=nq, hd=hd):
            x = args[0].detach().float()
            add(heads, i, x.view(*x.shape[:-1], nq, hd).norm(dim=-1).sum(dim=(0, 1)).double())

        hooks += [layer.register_forward_pre_hook(pre, with_kwargs=True),
                  layer.register_forward_hook(post, with_kwargs=True),
                  layer.mlp.down_proj.register_forward_pre_hook(mlp_in),
                  layer.self_attn.o_proj.register_forward_pre_hook(o_in)]

    def norm_out(mod, args, out):
        nonlocal hid
        hid += out.detach().float().abs().sum(dim=(0, 1)).double()

    for name, mod in model.named_modules():
        w = getattr(mod, "weight", None)
        if "norm" in type(mod).__name__.lower() and w is not None and tuple(w.shape) == (hidden,):
            hooks.append(mod.register_forward_hook(norm_out))
    model.eval()
    try:
        with torch.no_grad():
            for s in range(0, len(blocks), batch_size):
                b = blocks[s : s + batch_size]
                model(input_ids=b)
                ntok += b.numel()
    finally:
        for h in hooks:
            h.remove()
    imp = Importance([1 - c / ntok for c in cos_sum], [m / ntok for m in mlp], [h / ntok for h in heads], hid / ntok, ntok)
    if layer_metric == "loss":
        imp.layer_loss = _skip_losses(model, blocks, batch_size)
    return imp


def _skip_losses(model, blocks, batch_size: int) -> list[float]:
    """Calibration loss with each layer skipped (output := input), minus the loss with none skipped."""
    from .evaluate import score

    def loss():
        nll, n, _ = score(model, blocks, batch_size)
        return nll / n

    base, out = loss(), []
    for layer in _layers(model):
        h = layer.register_forward_hook(lambda mod, args, kwargs, o: args[0] if args else kwargs["hidden_states"],
                                        with_kwargs=True)
        try:
            out.append(loss() - base)
        finally:
            h.remove()
    return out


# --- choosing what to keep -----------------------------------------------------------------------


def _top(scores, k: int) -> list[int]:
    """Indices of the k largest scores, in their original order."""
    import torch

    return sorted(torch.as_tensor(scores).double().topk(k).indices.tolist())


def choose_layers(config, scores: list[float], n: int) -> list[int]:
    L = len(scores)
    if n > L:
        raise HfscaleError(f"--layers {n}: the model has {L} decoder layers; give 1..{L}")
    keep = set(_top(scores, n))
    types = getattr(config, "layer_types", None)
    must = []
    if config.model_type == "gemma4_text":
        must.append(L - 1)  # its config forces the last layer to full attention
    if types and "full_attention" in types and not any(types[i] == "full_attention" for i in keep | set(must)):
        must.append(max((i for i in range(L) if types[i] == "full_attention"), key=lambda i: scores[i]))
    for m in must:
        if m not in keep:
            drop = min((i for i in keep if i not in must), key=lambda i: scores[i], default=None)
            if drop is None:
                raise HfscaleError(f"--layers {n} cannot keep the layers this model needs ({sorted(must)}); give --layers {len(must)} or more")
            keep.discard(drop)
            keep.add(m)
    return sorted(keep)


def choose_heads(layer_heads, nq: int, nkv: int, n: int) -> tuple[list[int], list[int]]:
    """(kept query heads, kept KV heads) of one layer for n query heads, by the rule in the module docstring."""
    g = nq // nkv
    if n > nq:
        raise HfscaleError(f"--heads {n}: the model has {nq} attention heads; give at most {nq}")
    if n % nkv == 0:  # every KV group stays, n / nkv queries in each
        per = n // nkv
        q = [k * g + j for k in range(nkv) for j in _top(layer_heads[k * g : (k + 1) * g], per)]
        return q, list(range(nkv))
    if n % g == 0:  # whole KV groups go
        groups = _top(layer_heads.view(nkv, g).sum(-1), n // g)
        return [k * g + j for k in groups for j in range(g)], groups
    raise HfscaleError(f"--heads {n} cannot be split into KV groups: {nq} query heads share {nkv} KV heads "
                       f"({g} per group); give a multiple of {nkv} (keeps every group) or of {g} (drops whole groups)")


def _round_width(x: float, orig: int) -> int:
    step = 32 if orig % 32 == 0 else 8 if orig % 8 == 0 else 1
    return max(step, int(x // step) * step)


def new_config(config, keep_layers: list[int], dims: Dims, kv_after: dict[int, int]):
    """The pruned model's config: new dims, layer_types of the kept layers, per-layer settings re-indexed."""
    d = config.to_dict()
    d.update(num_hidden_layers=dims.layers, intermediate_size=dims.intermediate_size,
             num_attention_heads=dims.heads, hidden_size=dims.hidden_size)
    if d.get("head_dim") is None:  # explicit: the hidden size may change, the head size does not
        d["head_dim"] = config.hidden_size // config.num_attention_heads
    if d.get("layer_types"):
        d["layer_types"] = [config.layer_types[i] for i in keep_layers]
    kv = sorted(set(kv_after.values()))
    plc = d.pop("per_layer_config", None)
    if plc:  # Gemma 4: full-attention layers carry their own head_dim / KV heads
        d["per_layer_config"] = {str(new): {**plc[str(old)], **({"num_key_value_heads": kv_after[old]} if
                                 "num_key_value_heads" in plc[str(old)] else {})}
                                 for new, old in enumerate(keep_layers) if str(old) in plc}
        sliding = [kv_after[o] for o in keep_layers if str(o) not in plc]
        d["num_key_value_heads"] = sliding[0] if sliding else min(kv)
    else:
        d["num_key_value_heads"] = kv[0]
    for k in ("max_window_layers",):
        if k in d and d[k] is not None:
            d[k] = min(d[k], dims.layers)
    d.pop("transformers_version", None)
    return type(config).from_dict(d)


# --- slicing -----------------------------------------------------------------------------------


def _rows(units: list[int], size: int):
    import torch

    return torch.tensor([u * size + j for u in units for j in range(size)], dtype=torch.long)


def _slice_rule(name: str):
    """(dim -> index kind) for a tensor name inside a decoder layer or the model: 'hidden', 'mlp',
    'q' (query heads), 'kv' (KV heads); dims not named stay whole."""
    leaf = name.rsplit(".", 2)
    mod, kind = (leaf[-2], leaf[-1]) if len(leaf) >= 2 else ("", leaf[-1])
    if mod in ("q_proj",):
        return {0: "q", 1: "hidden"} if kind == "weight" else {0: "q"}
    if mod in ("k_proj", "v_proj"):
        return {0: "kv", 1: "hidden"} if kind == "weight" else {0: "kv"}
    if mod == "o_proj":
        return {0: "hidden", 1: "q"} if kind == "weight" else {0: "hidden"}
    if mod in ("gate_proj", "up_proj"):
        return {0: "mlp", 1: "hidden"} if kind == "weight" else {0: "mlp"}
    if mod == "down_proj":
        return {0: "hidden", 1: "mlp"} if kind == "weight" else {0: "hidden"}
    if mod in ("embed_tokens", "lm_head"):
        return {1: "hidden"}
    if mod in ("q_norm", "k_norm", "v_norm") or kind == "layer_scalar":
        return {}
    if "norm" in mod:
        return {0: "hidden"}
    return None


def _slice_state(old_sd, new_sd, keep_layers, idx_hidden, idx_mlp, idx_q, idx_kv):
    import torch

    out = {}
    for name, new in new_sd.items():
        parts = name.split(".")
        li = None
        if "layers" in parts:
            p = parts.index("layers")
            li = keep_layers[int(parts[p + 1])]
            parts[p + 1] = str(li)
        old_name = ".".join(parts)
        if old_name not in old_sd:
            raise RuntimeError(f"pruning: the pruned model has {name}, the source has no {old_name}")
        t = old_sd[old_name]
        rule = _slice_rule(name)
        if rule is None:
            if t.shape != new.shape:
                raise RuntimeError(f"hfscale prune has no slicing rule for {name} {tuple(t.shape)} -> {tuple(new.shape)}")
            rule = {}
        for dim, kind in rule.items():
            idx = {"hidden": idx_hidden, "mlp": idx_mlp.get(li), "q": idx_q.get(li), "kv": idx_kv.get(li)}[kind]
            if idx is not None and dim < t.ndim and idx.numel() != t.shape[dim]:
                t = torch.index_select(t, dim, idx)
        if t.shape != new.shape:
            raise RuntimeError(f"pruning {name}: sliced {tuple(t.shape)} but the pruned config wants {tuple(new.shape)}")
        out[name] = t.clone()
    return out


# --- the verb ----------------------------------------------------------------------------------


def resolve_dims(config, target: PruneTarget, nkv: int) -> Dims:
    """Explicit dims as given; with `params`, hidden and MLP width shrunk together to meet it."""
    cur = dims_of(config)
    for name, v in (("layers", target.layers), ("intermediate_size", target.intermediate_size),
                    ("heads", target.heads), ("hidden_size", target.hidden_size)):
        if v is not None and v > getattr(cur, name):
            raise HfscaleError(f"--{name.replace('_', '-')} {v}: the model has {getattr(cur, name)}; give at most that to prune")
    fixed = Dims(target.layers or cur.layers, target.intermediate_size or cur.intermediate_size,
                 target.heads or cur.heads, target.hidden_size or cur.hidden_size)
    if target.params is None:
        return fixed
    total = count_params(config)
    budget = target.params * total

    def size(d):
        kv = {i: nkv if d.heads % nkv == 0 else d.heads // (cur.heads // nkv) for i in range(d.layers)}
        return count_params(new_config(config, list(range(d.layers)), d, kv))

    # P(h, i) is linear in the MLP width i for a fixed hidden size h: two meta builds per h give it
    hs = [fixed.hidden_size] if target.hidden_size else _widths(cur.hidden_size)
    pairs = []
    for h in hs:
        if target.intermediate_size:
            i = fixed.intermediate_size
        else:
            p1, p_one = size(replace(fixed, hidden_size=h, intermediate_size=cur.intermediate_size)), \
                size(replace(fixed, hidden_size=h, intermediate_size=1))
            per = (p1 - p_one) / (cur.intermediate_size - 1)
            p2 = p_one - per  # the model without MLP channels
            i = min(cur.intermediate_size, _round_width((budget - p2) / per, cur.intermediate_size)) if budget > p2 else 0
        d = replace(fixed, hidden_size=h, intermediate_size=i)
        if i >= 1 and size(d) <= budget:
            pairs.append((size(d), d))
    if not pairs:
        raise HfscaleError(f"--params {target.params}x cannot be met with {fixed.layers} layers and {fixed.heads} heads; "
                           "allow fewer --layers/--heads or a larger fraction")
    # the fullest candidates (within 3% of the largest), then the one whose hidden and MLP shrink most alike
    top = max(p for p, _ in pairs)
    near = [d for p, d in pairs if p >= 0.97 * top]
    return min(near, key=lambda d: abs(d.hidden_size / cur.hidden_size - d.intermediate_size / cur.intermediate_size))


def _widths(orig: int, most: int = 24) -> list[int]:
    """Candidate widths up to `orig`: multiples of the rounding step, at most `most` of them."""
    step = 32 if orig % 32 == 0 else 8 if orig % 8 == 0 else 1
    n = orig // step
    stride = max(1, math.ceil(n / most))
    return sorted({orig, *(k * step for k in range(n, 0, -stride))})


def prune(model, target: PruneTarget, blocks, batch_size: int = 8, progress: bool = False):
    """(pruned model, PruneResult): a new model of the smaller config holding the kept weights
    (the input model is left as it was). `blocks`: calibration token ids [n, seq]."""
    import torch
    from transformers import AutoModelForCausalLM

    config = model.config
    check_supported(config)
    layers = _layers(model)
    shapes = {i: _attn_shape(l) for i, l in enumerate(layers)}
    nq0, nkv0, _ = shapes[0]
    if target.heads is not None and target.heads <= nq0:
        choose_heads(torch.zeros(nq0), nq0, nkv0, target.heads)  # a bad --heads fails before the calibration pass
    dims = resolve_dims(config, target, nkv0)
    before = dims_of(config)
    imp = measure_importance(model, blocks, batch_size, target.layer_metric)
    scores = imp.layer_loss if target.layer_metric == "loss" else imp.layer_bi
    keep = choose_layers(config, scores, dims.layers)
    idx_hidden = torch.tensor(_top(imp.hidden, dims.hidden_size), dtype=torch.long)
    idx_mlp, idx_q, idx_kv, kv_after = {}, {}, {}, {}
    for i in keep:
        nq, nkv, hd = shapes[i]
        idx_mlp[i] = torch.tensor(_top(imp.mlp[i], dims.intermediate_size), dtype=torch.long)
        q, kv = choose_heads(imp.heads[i], nq, nkv, dims.heads)
        idx_q[i], idx_kv[i], kv_after[i] = _rows(q, hd), _rows(kv, hd), len(kv)
    cfg = new_config(config, keep, dims, kv_after)
    small = AutoModelForCausalLM.from_config(cfg, dtype=next(model.parameters()).dtype)
    state = _slice_state(model.state_dict(), small.state_dict(), keep, idx_hidden, idx_mlp, idx_q, idx_kv)
    small.load_state_dict(state, strict=True)
    small.tie_weights()
    small.config.name_or_path = getattr(config, "name_or_path", "")
    result = PruneResult(
        model_type=config.model_type, before=before, after=dims_of(cfg),
        params_before=sum(p.numel() for p in model.parameters()), params_after=sum(p.numel() for p in small.parameters()),
        kept_layers=tuple(keep), layer_types=tuple(cfg.layer_types) if getattr(cfg, "layer_types", None) else None,
        layer_scores=tuple(float(s) for s in scores), layer_metric=target.layer_metric, calibration_tokens=imp.tokens,
        kv_heads={str(i): [shapes[i][1], kv_after[i]] for i in keep})
    return small.eval(), result


def describe(r: PruneResult) -> str:
    b, a = r.before, r.after
    return (f"{r.params_before:,} -> {r.params_after:,} parameters ({r.fraction:.3f}x): layers {b.layers}->{a.layers} "
            f"(kept {list(r.kept_layers)}), intermediate {b.intermediate_size}->{a.intermediate_size}, "
            f"heads {b.heads}->{a.heads}, hidden {b.hidden_size}->{a.hidden_size}")


def parse_fraction(text: str) -> float:
    """'0.5x', '0.5' or '50%' -> 0.5."""
    t = str(text).strip().lower()
    try:
        v = float(t[:-1]) / 100 if t.endswith("%") else float(t.removesuffix("x"))
    except ValueError:
        raise ConfigError(f"--params {text!r}: give a fraction like 0.5x") from None
    if not math.isfinite(v):
        raise ConfigError(f"--params {text!r}: give a fraction like 0.5x")
    return v
