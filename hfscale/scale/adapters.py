"""Adapters (LoRA, DoRA, QLoRA through peft): the one home of how hfscale fine-tunes a frozen base.

    from hfscale.scale.adapters import AdapterSpec, apply_adapter, adapter_param_groups
    spec = AdapterSpec("lora", rank=16, lora_plus_ratio=16)     # or AdapterSpec.from_mapping(yaml["adapter"])
    model = apply_adapter(model, spec)                          # a peft PeftModel; only the adapters train
    optimizer = torch.optim.AdamW(adapter_param_groups(model, spec, lr=2e-4))
    model, optimizer = accelerator.prepare(model, optimizer)
    gather_dora_inputs_(accelerator.unwrap_model(model))        # DoRA under ZeRO-3 (else a no-op): resumes work
    ... train (plain loop, accelerate, Trainer) ...
    merged = merge_into_base(base_in_its_dtype, adapter_dir)   # never into a 4-bit base

The spec is read by recipes/train_clm.py (`adapter:` in the recipe YAML, `--adapter lora ...`) and the QAT recipe
(hfscale.compress.qat.add_lora_); it is what the planner and doctor should read (`spec.rank`, `spec.base_bits`,
`spec.targets`). It lives in scale/ (imports only util and models) so that train, compress, plan and doctor can all
import it without a cycle (tests/test_layout.py).

Targets: by default every decoder linear (q/k/v/o/gate/up/down), named one by one from the model's modules (the
adapter_config.json holds one regex of the exact names), so Gemma 4's per-layer-embedding projections
(per_layer_input_gate, per_layer_projection, per_layer_model_projection), its MoE router (router.proj) and the lm_head
never get an adapter, and the vision / audio towers only with `towers=True`; there Gemma 4's Gemma4ClippableLinear
(an nn.Module around an nn.Linear, which peft rejects: peft #3129) is adapted through its inner `.linear`, keeping
the clipping around it. Tied embeddings stay tied (peft's ensure_weight_tying; modules_to_save would untie them,
peft #1750). MoE experts (`experts=True`): LoRA on each `experts` module's fused 3-D tensors (gate_up_proj, down_proj)
through peft's target_parameters, named exactly (expert_parameters); the router never; ran by hand under DDP, ZeRO-2,
ZeRO-3 (zero.Init) and FSDP2 (tests/scripts/expert_lora_engines.py). apply_adapter checks that peft adapted exactly the modules and tensors asked (peft's MoE target
conversion rewrites Qwen3-MoE's). Ran on CPU only (docs/adapters.md: which engine and kind ran).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from dataclasses import dataclass, fields

from ..util.errors import ConfigError

# kind -> (bits of the frozen base, DoRA's magnitude vector on top of LoRA)
KINDS = {"none": (16, False), "lora": (16, False), "dora": (16, True), "qlora": (4, False)}
DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# peft's init_lora_weights values offered here: default (A Kaiming-uniform, B zero: the model starts unchanged),
# gaussian (A normal), pissa / olora (A, B from the base's SVD / QR, the base keeps the residual: the base changes)
INITS = {"default": True, "gaussian": "gaussian", "pissa": "pissa", "olora": "olora"}
NAMES = {"none": "full", "lora": "LoRA", "dora": "DoRA", "qlora": "QLoRA"}
TOWERS = ("vision_tower", "audio_tower", "embed_vision", "embed_audio", "multi_modal_projector")


TEMPLATE_TOKENS = "template"  # trainable_tokens' name for the ids the chat template writes


def _token_list(tokens) -> tuple:
    """trainable_tokens as given (ids, "template", a comma-separated string of them) -> a tuple of ints and "template";
    anything else refused in one line."""
    if isinstance(tokens, (str, int)):
        tokens = [t.strip() for t in tokens.split(",") if t.strip()] if isinstance(tokens, str) else [tokens]
    out = []
    for t in tokens:
        if t == TEMPLATE_TOKENS:
            out.append(t)
            continue
        try:
            out.append(int(t))
        except (TypeError, ValueError):
            raise ConfigError(f"trainable_tokens: {t!r} is not a token id; give ids (5,7) and / or {TEMPLATE_TOKENS!r} "
                              "(the tokens the chat template writes)") from None
    return tuple(out)


@dataclass(frozen=True)
class AdapterSpec:
    kind: str = "none"  # none | lora | dora | qlora (LoRA on an NF4 base, bitsandbytes)
    rank: int = 16
    # None -> 2 x rank: the scale alpha / r = 2 the QAT recipe's LoRA ran with (benchmarks/compress.py measured
    # it) and the common Gemma fine-tuning setting; with rslora the scale is alpha / sqrt(r)
    alpha: float | None = None
    dropout: float = 0.0  # peft's default; > 0 makes training steps depend on the dropout RNG
    targets: tuple = DECODER_LINEARS  # leaf module names adapted (decoder only unless towers)
    towers: bool = False  # also the vision / audio towers' linears (Gemma 4: through Gemma4ClippableLinear.linear)
    rslora: bool = False  # scale alpha / sqrt(r) (Kalajdzievski 2023): a rank sweep keeps one learning rate
    lora_plus_ratio: float = 1.0  # LoRA+: B's learning rate = this x A's (paper: 16); 1 = plain LoRA
    init: str = "default"  # default | gaussian | pissa | olora
    # embedding rows trained (peft trainable_token_indices), tied kept tied: token ids, and / or "template" for the ids
    # the chat template writes (a base pre-trained on plain text never learnt them; resolved by with_tokens)
    trainable_tokens: tuple = ()
    # also LoRA on the input embedding (peft's lora.Embedding) and, where the model ties its lm_head to it, on the lm_head
    # with the two adapters tied (peft's ensure_weight_tying): a low-rank move of every token's row, read and written
    # alike, which LoRA on the decoder linears cannot make (benchmarks/results/adapters.md: the chat template's tokens)
    embedding: bool = False
    # also LoRA on the MoE experts' 3-D parameters (Qwen3-MoE, Gemma 4 26B-A4B: `experts.gate_up_proj`,
    # `experts.down_proj`) through peft's target_parameters; the router never gets an adapter
    experts: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConfigError(f"adapter {self.kind!r} not understood; use one of {', '.join(KINDS)}")
        targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
        if isinstance(self.targets, str) and "," in self.targets:
            targets = tuple(t.strip() for t in self.targets.split(",") if t.strip())
        object.__setattr__(self, "targets", targets)
        object.__setattr__(self, "trainable_tokens", _token_list(self.trainable_tokens))
        if self.kind == "none":
            return
        if int(self.rank) != self.rank or self.rank < 1:
            raise ConfigError(f"lora rank must be a whole number >= 1 (got {self.rank}); use --adapter none to train "
                              "every parameter")
        alpha = 2 * self.rank if self.alpha is None else self.alpha
        if not alpha > 0:
            raise ConfigError(f"lora alpha must be > 0 (got {alpha}); leave it unset for 2 x rank = {2 * self.rank}")
        object.__setattr__(self, "alpha", float(alpha))
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora dropout must be in [0, 1) (got {self.dropout}); 0.05 is common, 0 is peft's default")
        if not targets or not all(isinstance(t, str) and t for t in targets):
            raise ConfigError(f"lora targets must be module names (got {self.targets!r}); the default is "
                              f"{','.join(DECODER_LINEARS)}")
        if not self.lora_plus_ratio >= 1.0:
            raise ConfigError(f"lora_plus_ratio must be >= 1 (got {self.lora_plus_ratio}): B's learning rate over A's "
                              "(1 = plain LoRA, 16 = the LoRA+ paper's)")
        if self.init not in INITS:
            raise ConfigError(f"adapter init {self.init!r} not understood; use one of {', '.join(INITS)}")
        if self.kind == "qlora" and self.init in ("pissa", "olora"):
            raise ConfigError(f"init {self.init} rewrites the base weights from their SVD/QR, which a 4-bit base "
                              "cannot hold exactly; use --adapter lora with init pissa, or init default with qlora")
        if self.experts and (self.dora or self.dropout or self.init in ("pissa", "olora") or self.base_bits == 4):
            what = ("DoRA" if self.dora else f"lora_dropout {self.dropout}" if self.dropout else
                    f"init {self.init}" if self.init in ("pissa", "olora") else "a 4-bit (QLoRA) base")
            raise ConfigError(f"adapter experts (peft's target_parameters) cannot run with {what} here (peft's "
                              "ParamWrapper has no DoRA, dropout or SVD init; a QLoRA expert stack has not run); use kind "
                              "lora, dropout 0, init default or gaussian with experts, or drop experts")
        if any(t != TEMPLATE_TOKENS and t < 0 for t in self.trainable_tokens):
            raise ConfigError(f"trainable_tokens must be token ids >= 0 or {TEMPLATE_TOKENS!r} (got "
                              f"{list(self.trainable_tokens)})")
        if not isinstance(self.embedding, bool):
            raise ConfigError(f"adapter embedding must be true or false (got {self.embedding!r})")
        if self.embedding and (self.trainable_tokens or self.init in ("pissa", "olora") or self.dora):
            what = ("trainable_tokens (both adapt the embedding)" if self.trainable_tokens else
                    "DoRA (the tied matrix would need the embedding's and the lm_head's magnitudes at once)" if self.dora
                    else f"init {self.init}")
            raise ConfigError(f"adapter embedding cannot run with {what} here; drop one of them")

    # --- what other modules read ---
    @property
    def enabled(self) -> bool:
        return self.kind != "none"

    @property
    def base_bits(self) -> int:
        """Bits per weight of the frozen base: 4 (NF4) for QLoRA, else 16 (the planner's --base-bits)."""
        return KINDS[self.kind][0]

    @property
    def dora(self) -> bool:
        return KINDS[self.kind][1]

    @property
    def changes_base(self) -> bool:
        """PiSSA / OLoRA move the principal part of each target's weight into the adapter: the base changes."""
        return self.init in ("pissa", "olora")

    @property
    def names_template(self) -> bool:
        """Whether trainable_tokens names the chat template's tokens (with_tokens resolves them to ids)."""
        return TEMPLATE_TOKENS in self.trainable_tokens

    def with_tokens(self, template_ids) -> AdapterSpec:
        """This spec with "template" in trainable_tokens replaced by `template_ids` (the ids the chat template
        writes: hfscale.data.formats.template_token_ids(tokenizer)); sorted, each once. Unchanged without it."""
        import dataclasses

        if not self.names_template:
            return self
        ids = {t for t in self.trainable_tokens if t != TEMPLATE_TOKENS} | {int(t) for t in template_ids}
        return dataclasses.replace(self, trainable_tokens=tuple(sorted(ids)))

    def describe(self) -> str:
        if not self.enabled:
            return "full fine-tuning"
        extras = [f"alpha {self.alpha:g}"] + (["rsLoRA"] if self.rslora else []) + (
            [f"LoRA+ x{self.lora_plus_ratio:g}"] if self.lora_plus_ratio != 1 else []) + (
            [f"init {self.init}"] if self.init != "default" else []) + (
            ["the chat template's tokens trained"] if self.names_template else
            [f"{len(self.trainable_tokens)} trainable tokens"] if self.trainable_tokens else []) + (
            ["embedding"] if self.embedding else []) + (["experts"] if self.experts else [])
        return f"{NAMES[self.kind]} r{self.rank} ({', '.join(extras)})"

    def to_dict(self) -> dict:
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v) for f in fields(self)}

    @classmethod
    def from_mapping(cls, section, where: str = "adapter") -> AdapterSpec:
        """The recipe YAML's `adapter:` section (a mapping, or just the kind): unknown keys refused by name."""
        import difflib

        if section is None:
            return cls()
        if isinstance(section, str):
            return cls(kind=section)
        if not isinstance(section, dict):
            raise ConfigError(f"{where}: must be a kind ({', '.join(KINDS)}) or a mapping of adapter settings")
        names = [f.name for f in fields(cls)]
        for key in section:
            if key not in names:
                near = difflib.get_close_matches(str(key), names, n=1)
                raise ConfigError(f"{where}: unknown setting {key!r}" + (f"; did you mean {near[0]!r}?" if near else
                                                                          f"; use {', '.join(names)}"))
        return cls(**section)


# --- applying ---------------------------------------------------------------------------------------

def target_modules(model, spec: AdapterSpec) -> list[str]:
    """The full names of the modules the adapter goes on: nn.Linear (bitsandbytes' Linear4bit is one) whose last
    name is in spec.targets, outside the towers unless spec.towers; a Gemma4ClippableLinear through its `.linear`.
    Refuses (one line naming the model's linear names) when nothing matches."""
    import torch.nn as nn

    wanted, found, leaves = set(spec.targets), [], set()
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if not spec.towers and any(t in name.split(".") for t in TOWERS):
            continue
        if isinstance(module, nn.Linear):
            leaves.add(leaf)
        if leaf not in wanted:
            continue
        if isinstance(module, nn.Linear):
            found.append(name)
        elif isinstance(getattr(module, "linear", None), nn.Linear):  # Gemma4ClippableLinear: clamp, linear, clamp
            found.append(f"{name}.linear")
    if not found:
        raise ConfigError(f"no linear named {', '.join(spec.targets)} in the model; set adapter targets to some of "
                          f"{', '.join(sorted(leaves)) or '(none)'}")
    return found


def embedding_modules(model, spec: AdapterSpec) -> list[str]:
    """The full names of the embedding modules the adapter goes on (spec.embedding): the input embedding and, where
    the model ties its output embedding (lm_head) to it, that one too (its adapter tied to the embedding's: peft's
    ensure_weight_tying), so the model stays tied and its merge stays one matrix. [] without spec.embedding."""
    if not spec.embedding:
        return []
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is emb.weight
    return [name for name, m in model.named_modules() if m is emb or (tied and m is head)]


def expert_parameters(model, spec: AdapterSpec) -> list[str]:
    """The full names of the MoE expert tensors the adapter goes on (spec.experts): the 3-D parameters of every module
    named `experts` (transformers 5 fuses each layer's experts into `gate_up_proj` [E, 2I, H] and `down_proj`
    [E, H, I]: Qwen3MoeExperts, Gemma4TextExperts), outside the towers unless spec.towers. [] without spec.experts;
    refused (one line) when the model has none. Under ZeRO-3's zero.Init the shape is read from `ds_shape`."""
    if not spec.experts:
        return []
    found = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] != "experts" or (not spec.towers and any(t in name.split(".") for t in TOWERS)):
            continue
        found += [f"{name}.{p_name}" for p_name, p in module.named_parameters(recurse=False)
                  if len(getattr(p, "ds_shape", p.shape)) == 3]
    if not found:
        raise ConfigError("adapter experts: the model has no MoE expert tensors (3-D parameters of an `experts` module); "
                          "drop experts (it is for MoE models such as Qwen3-MoE or Gemma 4 26B-A4B)")
    return found


def lora_config(model, spec: AdapterSpec):
    """peft's LoraConfig for this spec and model (targets resolved to full module names)."""
    from peft import LoraConfig

    kw = {}
    if spec.names_template:
        raise ConfigError(f"trainable_tokens {TEMPLATE_TOKENS!r} is a name: resolve it first, spec.with_tokens("
                          "hfscale.data.formats.template_token_ids(tokenizer)) (the recipe does)")
    if spec.trainable_tokens:  # tied: the lm_head's rows are the embedding's (else it keeps its own copy)
        kw["trainable_token_indices"] = list(spec.trainable_tokens)
        kw["ensure_weight_tying"] = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    if spec.embedding:  # the lm_head's adapter is the embedding's, transposed: one low-rank move of the tied matrix
        kw["ensure_weight_tying"] = len(embedding_modules(model, spec)) == 2
    # one regex of the exact names: peft matches a list's entries as suffixes, so "q_proj" would also take a tower's
    # "vision_tower.q_proj" (a Gemma4ClippableLinear peft rejects); a str target is re.fullmatch'ed
    exact = "|".join(re.escape(n) for n in target_modules(model, spec) + embedding_modules(model, spec))
    if spec.experts:  # exact names too: peft matches each as a name or a suffix of one
        kw["target_parameters"] = expert_parameters(model, spec)
    return LoraConfig(r=int(spec.rank), lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                      target_modules=f"(?:{exact})", bias="none", use_rslora=spec.rslora,
                      use_dora=spec.dora, init_lora_weights=INITS[spec.init], **kw)


def adapted(peft_model) -> tuple[set, set]:
    """(module names, parameter names) peft put a LoRA on, in the base model's own names (a ParamWrapper nests one
    wrapper per parameter, `experts` then `experts.base_layer`)."""
    from peft.tuners.lora import LoraLayer, ParamWrapper

    modules, params = set(), set()
    for name, m in peft_model.named_modules():
        if not isinstance(m, LoraLayer) or not any("default" in getattr(m, k, {}) for k in ("lora_A", "lora_embedding_A")):
            continue
        own = name.removeprefix("base_model.model.").replace(".base_layer", "")
        if isinstance(m, ParamWrapper):
            params.add(f"{own}.{m.parameter_name}")
        else:
            modules.add(own)
    return modules, params


def apply_adapter(model, spec: AdapterSpec):
    """The model with the spec's adapters (a peft PeftModel; base frozen, only adapter parameters train).
    A QLoRA spec expects its base already in 4 bits (load_quantized_base). Full fine-tuning returns `model`."""
    if not spec.enabled:
        return model
    from peft import get_peft_model

    config = lora_config(model, spec)
    want = (set(target_modules(model, spec) + embedding_modules(model, spec)), set(expert_parameters(model, spec)))
    with warnings.catch_warnings():  # "tied_target_modules ... can lead to complications": tie_head_adapter_ below
        warnings.filterwarnings("ignore", message=".*tied_target_modules.*")
        model = get_peft_model(model, config)
    # peft 0.21 rewrites the targets of some MoE models (qwen3_moe, mixtral: its transformers-v5 conversion turns a
    # regex into leaf names and maps gate_proj / up_proj / down_proj onto the fused expert tensors, router `gate` onto
    # gate.weight): what was adapted must be what was asked, or the run says so rather than train something else
    got = adapted(model)
    if got != want:
        extra = sorted((got[0] - want[0]) | (got[1] - want[1]))
        missing = sorted((want[0] - got[0]) | (want[1] - got[1]))
        kind = getattr(getattr(model, "config", None), "model_type", "model")
        raise ConfigError(f"peft adapted other tensors than asked on this {kind} (added "
                          f"{', '.join(extra[:2]) or 'none'}; left out {', '.join(missing[:2]) or 'none'}: its MoE target "
                          "conversion); set adapter targets to the attention linears (q_proj,k_proj,v_proj,o_proj) and "
                          "experts: true for the expert tensors")
    if spec.embedding:
        tie_head_adapter_(model)
    return model


def tie_head_adapter_(model) -> bool:
    """peft's ensure_weight_tying gives the tied lm_head LoRA factors of its own: new Parameters over the embedding
    factors' storage (views), so an optimizer steps that storage twice with two Adam states, and an engine that
    flattens parameters (DeepSpeed) unties them. Here the lm_head's lora_A / lora_B become the embedding's
    lora_embedding_B / lora_embedding_A themselves (transposed on read): model.parameters() holds each once. Returns
    whether the model had a tied lm_head adapter. Refuses (one line) an lm_head adapter that is not the embedding's
    transposed (one trained apart, e.g. by peft without ensure_weight_tying): merging it as tied would drop it.
    The pair's start: peft inits the embedding's (A zero, B normal), then the lm_head's reset writes its own init into
    the shared storage (B = the head's lora_A: Kaiming-uniform; A = the head's lora_B: zero), so the pair starts as the
    lm_head's LoRA would; LoRA+ (adapter_param_groups) scales the linears' lora_B only, the pair keeps the base lr."""
    import torch

    class Transposed(torch.nn.Module):
        """A factor of the lm_head's LoRA that is the embedding's factor itself, read transposed as the nn.Linear it
        replaces (`weight`, forward): one Parameter, its gradient summed over both uses, one Adam state."""

        def __init__(self, source):
            super().__init__()
            self.source = source

        @property
        def weight(self):
            return self.source.t()

        def forward(self, x):
            return torch.nn.functional.linear(x, self.source.t())

    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or "default" not in getattr(head, "lora_A", {}) or "default" not in getattr(emb, "lora_embedding_A", {}):
        return False
    a, b = emb.lora_embedding_A["default"], emb.lora_embedding_B["default"]
    if not (torch.equal(head.lora_A["default"].weight, b.t()) and torch.equal(head.lora_B["default"].weight, a.t())):
        raise ConfigError("this adapter's lm_head LoRA is not the embedding's (trained apart from it), so it cannot be "
                          "merged into a tied lm_head; load the base untied (tie_word_embeddings=False) to merge both")
    head.lora_A["default"] = Transposed(emb.lora_embedding_B["default"])
    head.lora_B["default"] = Transposed(emb.lora_embedding_A["default"])
    return True


def tied_head_factors(model, state: dict) -> dict:
    """The tied lm_head's LoRA factors in peft's file names, from the embedding's in `state` (trained tensors by
    their parameter names), for an adapter file peft reloads with no missing keys; {} without a tied head adapter."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    lora_a = getattr(head, "lora_A", None)
    if lora_a is None or "default" not in lora_a or not hasattr(lora_a["default"], "source"):
        return {}
    names = {m: n for n, m in model.named_modules() if m is emb or m is head}
    e = names[emb]
    return {f"{names[head]}.lora_A.default.weight": state[f"{e}.lora_embedding_B.default"].t().contiguous(),
            f"{names[head]}.lora_B.default.weight": state[f"{e}.lora_embedding_A.default"].t().contiguous()}


def gather_dora_inputs_(model) -> int:
    """Under ZeRO-3 (parameters carry DeepSpeed's `ds_id`): registers, on every DoRA magnitude module, the weights its
    forward reads from other modules (lora_A, lora_B, the base layer's) as DeepSpeed external parameters, so its
    pre-forward hook gathers them; returns how many modules. Why: peft's DoraLinearLayer reads `lora_A.weight.shape`
    (and the base weight) outside those modules' own forward. DeepSpeed gathers such a read only inside the engine's
    forward (ZeROOrderedDict's `_in_forward`), not in the recompute of a checkpointed layer during backward. A fresh
    run works by accident: the first forward meets the un-gathered persistent lora_A and registers it then; after
    load_checkpoint DeepSpeed has all-gathered the persistent parameters, nothing gets registered, the first
    (trace-recording) step releases lora_A after its own forward, and the recompute reads a 0-element partition:
    IndexError in get_lora_weight (measured: ZeRO-3 DoRA, checkpointing every:2, --resume on 1 rank). No-op elsewhere."""
    n = 0
    for module in model.modules():
        mags = getattr(module, "lora_magnitude_vector", None)
        if not mags or not any(hasattr(p, "ds_id") for p in module.parameters()):
            continue
        from deepspeed.runtime.zero.partition_parameters import register_external_parameter  # ZeRO-3 only

        for name, mag in mags.items():
            for param in (module.lora_A[name].weight, module.lora_B[name].weight, module.get_base_layer().weight):
                register_external_parameter(mag, param)
            n += 1
    return n


def adapter_param_groups(model, spec: AdapterSpec, lr: float, weight_decay: float = 0.0) -> list[dict]:
    """Optimizer parameter groups of the trainable parameters: LoRA+ gives every lora_B (and DoRA's magnitude
    stays with A) `lr x spec.lora_plus_ratio`; one group when the ratio is 1. Each group holds an `lr_scale`
    that a schedule setting `group["lr"]` multiplies in (hfscale.train.loop.lr_at does)."""
    a, b = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (b if ".lora_B." in name and spec.lora_plus_ratio != 1 else a).append(p)
    groups = [{"params": a, "lr": lr, "weight_decay": weight_decay, "lr_scale": 1.0}]
    if b:
        groups.append({"params": b, "lr": lr * spec.lora_plus_ratio, "weight_decay": weight_decay,
                       "lr_scale": spec.lora_plus_ratio})
    return [g for g in groups if g["params"]]


# --- QLoRA's base ------------------------------------------------------------------------------------

def bnb_config(compute_dtype, storage_dtype):
    """transformers' BitsAndBytesConfig for an NF4 base (double quantization of the scales, as QLoRA's paper).
    `storage_dtype`: the dtype the packed 4-bit bytes are stored as. ZeRO-3 and FSDP2 shard parameters of one
    dtype, so there it is the model's dtype (peft's docs: bnb_4bit_quant_storage = the compute dtype; uint8 on
    FSDP2 trains to loss 0 / NaN, accelerate #3983); DDP keeps uint8."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute_dtype, bnb_4bit_quant_storage=storage_dtype)


# the engines hfscale's recipe refuses a 4-bit base on: engine -> (what happened here, the way out). Read by
# engine_refusal: the recipe raises it before any process group (qlora_dtypes -> check_engine), hfscale doctor reports
# it from the config files before a run (adapter-engine-refused). ZeRO-3 is not here: its frozen NF4 base stays bit
# for bit in every checkpoint (tests/test_recipe.py, ZeRO-3 QLoRA). It was refused because the frozen NF4 weights
# "differed between checkpoints", which was the check's own error, twice: (1) packed 4-bit codes stored as bf16 / fp32
# are bit patterns, some of them NaN (442 of the tiny Gemma 3's 552,960 bf16 elements), so torch.equal calls each of
# the 28 NF4 weights unequal even to its own copy: compare their bytes (same_bits); (2) its reference base was
# quantized from fp32 into uint8 storage, the run quantizes from bf16 into bf16 (qlora_dtypes): other NF4 codes.
QLORA_REFUSED = {
    "fsdp2": ("a 4-bit (QLoRA) base under FSDP2 has not run here (uint8 storage trains to loss 0 / NaN, accelerate #3983)",
              "launch with accelerate_configs/ddp.yaml, zero2.yaml or zero3.yaml, or use --adapter lora under FSDP2"),
}

# the engines where trainable_tokens (peft's trainable_token_indices) failed here, tiny Gemma 3 on 2 CPU ranks
# (recipes/train_clm.py --adapter lora --lora-trainable-tokens template, by hand; DDP ran: only those rows and the LoRA
# moved, the tie kept, the adapter reloads to the merged model): engine -> (what happened, the way out)
TOKENS_REFUSED = {
    "zero3": ("trainable_tokens under ZeRO-3 failed here: peft 0.21 gathers the partitioned embedding rows onto CUDA "
              "only (TrainableTokensLayer._collect_token_weights calls torch.cuda.current_device()); not run on a GPU",
              "launch with accelerate_configs/ddp.yaml or zero2.yaml, or drop trainable_tokens"),
    "fsdp2": ("trainable_tokens under FSDP2 failed here: accelerate's fsdp2_prepare_model re-ties the embedding by name "
              "and peft's token wrapper has moved it (`model.embed_tokens.weight` is neither a parameter, buffer, nor "
              "extra state)", "launch with accelerate_configs/ddp.yaml or zero2.yaml, or drop trainable_tokens"),
}


# the engines where the embedding adapter (AdapterSpec.embedding) failed here, tiny Gemma 3 on 2 CPU ranks (recipes/
# train_clm.py --adapter lora --lora-embedding true, by hand: DDP and ZeRO-2 ran and resumed, the adapter saved whole,
# the merged model tied and equal to base + adapter): engine -> (what happened, the way out)
EMBEDDING_REFUSED = {
    "zero3": ("adapter embedding under ZeRO-3 failed here: a 2-rank run trained, its checkpoint resumed on 1 rank "
              "failed in backward (the factor the embedding and the lm_head share was released between its two uses: "
              "size 0 vs 8)", "launch with accelerate_configs/ddp.yaml or zero2.yaml, or drop embedding"),
    "fsdp2": ("adapter embedding under FSDP2 failed here: fully_shard re-registers the tied lm_head's LoRA factor, which is "
              "the embedding's (KeyError: attribute 'weight' already exists)",
              "launch with accelerate_configs/ddp.yaml or zero2.yaml, or drop embedding"),
}


def engine_of(zero_stage: int | None, fsdp: bool) -> str:
    """The engine as the adapter rules see it: fsdp2 | zero3 (both shard parameters of one dtype) | other."""
    return "fsdp2" if fsdp else "zero3" if zero_stage == 3 else "other"


def engine_refusal(kind: str, zero_stage: int | None, fsdp: bool, tokens: bool = False,
                   embedding: bool = False) -> tuple[str, str] | None:
    """(what, the way out) where hfscale refuses an adapter of `kind` (with trainable `tokens`, with the `embedding`
    adapter) on this engine (QLORA_REFUSED, TOKENS_REFUSED, EMBEDDING_REFUSED), else None. LoRA on MoE experts is
    refused nowhere: peft's target_parameters ran on DDP, ZeRO-2, ZeRO-3 (zero.Init) and FSDP2
    (tests/scripts/expert_lora_engines.py, by hand)."""
    engine = engine_of(zero_stage, fsdp)
    refused = QLORA_REFUSED.get(engine) if KINDS.get(kind, (16,))[0] == 4 else None
    adapter = kind in KINDS and kind != "none"
    return refused or (TOKENS_REFUSED.get(engine) if tokens and adapter else None) or (
        EMBEDDING_REFUSED.get(engine) if embedding and adapter else None)


def template_tokens_note(spec: AdapterSpec, data_format: str | None, zero_stage: int | None, fsdp: bool) -> str | None:
    """What to tell an adapter run on chat data ("messages") that adapts no embedding row where the engine allows it:
    the chat template's tokens keep the embedding rows pre-training gave them (tied to the lm_head), where most of full
    fine-tuning's lead over LoRA lies (benchmarks/results/adapters.md, per-token-kind split); else None."""
    if not spec.enabled or spec.trainable_tokens or spec.embedding or data_format != "messages" or \
            engine_refusal(spec.kind, zero_stage, fsdp, tokens=True, embedding=True) is not None:
        return None
    return ("the chat template's tokens keep the embedding rows pre-training gave them under this adapter; "
            "--lora-embedding true moves every row in low rank, the tied lm_head's with it, --lora-trainable-tokens "
            "template those rows in full (benchmarks/results/adapters.md, 60 steps on the built-in chat set: LoRA 70.3% "
            "of full fine-tuning's eval-loss improvement, + embedding 102.1%, + template tokens 91.3%)")


def check_engine(spec: AdapterSpec, zero_stage: int | None, fsdp: bool) -> None:
    """The launch's refusal of `spec` on this engine, one line naming the way out (ConfigError), or nothing."""
    refused = engine_refusal(spec.kind, zero_stage, fsdp, bool(spec.trainable_tokens), spec.embedding)
    if refused is not None:
        raise ConfigError("; ".join(refused))


def nf4_storage(precision: str, zero_stage: int | None, fsdp: bool) -> str:
    """The dtype (a torch name) bitsandbytes stores the packed 4-bit bytes in on an engine: ZeRO-3 and FSDP2 flatten /
    shard parameters of one dtype, so there the model's (peft's docs: bnb_4bit_quant_storage = the compute dtype; uint8
    on FSDP2 trains to loss 0 / NaN, accelerate #3983); DDP and ZeRO-1/2 keep uint8. The one home of the rule: the
    recipe (qlora_dtypes), the planner's Trainer keys (plan.adapters.quant_storage) and doctor read it."""
    if engine_of(zero_stage, fsdp) == "other":
        return "uint8"
    return {"bf16": "bfloat16", "fp16": "float16"}.get(precision, "float32")


def same_bits(a, b) -> bool:
    """Whether two tensors hold the same bytes (dtype and shape too). The way to compare NF4 weights stored in a float
    dtype (ZeRO-3 / FSDP2's bf16 / fp32 storage): their bit patterns include NaNs, which torch.equal never calls equal."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.detach().contiguous().reshape(-1).view(torch.uint8), b.detach().contiguous().reshape(-1).view(torch.uint8))


def qlora_dtypes(precision: str, zero_stage: int | None, fsdp: bool):
    """(compute dtype, storage dtype) of an NF4 base for a launch: DeepSpeed casts its module to the run's 16-bit
    dtype, so there the non-quantized weights are in it (elsewhere fp32, autocast computing in 16 bits); the storage
    is nf4_storage's. FSDP2 is refused (QLORA_REFUSED, check_engine): one line naming the way out. The base is
    quantized from weights in the compute dtype, so its NF4 codes and scales are those of these dtypes: a reference
    base for a run's checkpoints must be loaded with the same pair (ZeRO-3 bf16: bf16 / bf16; DDP: fp32 / uint8)."""
    import torch

    check_engine(AdapterSpec("qlora"), zero_stage, fsdp)
    ds16 = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision) if zero_stage is not None else None
    return ds16 or torch.float32, getattr(torch, nf4_storage(precision, zero_stage, fsdp))


def load_quantized_base(name_or_path: str, compute_dtype, storage_dtype, seed: int = 0, scratch=None, device_map=None):
    """The causal LM with NF4 decoder linears (bitsandbytes; embeddings, norms and lm_head stay in compute_dtype).
    A built-in name is written (seeded, the same weights build_model gives) to `scratch` (default: a temporary
    directory, removed after) and loaded from there: transformers quantizes on from_pretrained only. `device_map`:
    "cpu" on CPU hosts (bitsandbytes quantizes there), None under DeepSpeed / accelerate on GPUs."""
    import tempfile

    from transformers import AutoModelForCausalLM

    from ..models.builtin import build_model, is_builtin

    path = name_or_path
    if is_builtin(name_or_path):
        tmp = Path(scratch or tempfile.mkdtemp(prefix="hfscale-qlora-base-"))
        if not (tmp / "config.json").is_file():
            write_weights(build_model(name_or_path, seed=seed), tmp)
        path = str(tmp)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=bnb_config(compute_dtype, storage_dtype),
                                                     dtype=compute_dtype, device_map=device_map, use_safetensors=True,
                                                     trust_remote_code=False)
    finally:
        if is_builtin(name_or_path) and scratch is None:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    model.config.name_or_path = name_or_path
    keep_bnb_layout_(model)
    return model


def keep_bnb_layout_(model) -> int:
    """Keeps every bitsandbytes 4-bit layer of `model` in the portable layout (the kernel-free path bitsandbytes takes
    on CPUs without AVX512-BF16); returns how many layers. Measured trap (bitsandbytes 0.50, CPU with AVX512-BF16):
    Linear4bit.forward in eval mode under no_grad (the first evaluation, or the first forward of a PTQ model) repacks
    its weight in place into a [N, K/2] layout with the scales dequantized and rounded to bf16 (double quantization
    dropped), and keeps it; the inverse that save_pretrained runs does not restore it. PTQ: the saved NF4 model's logits
    were 2.46 off the float model instead of 0.19. QLoRA (tiny Gemma 3): after one evaluation its training logits
    moved by up to 0.014 and the next checkpoint held other absmax / nested absmax in all 28 linears. Read by
    load_quantized_base and hfscale.compress.ptq; idempotent."""
    n = 0
    for m in model.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False  # read only by that repack (Linear4bit.forward)
            n += 1
    return n


def write_weights(model, directory) -> Path:
    """config.json + model.safetensors of `model`, written by this process whatever its rank (transformers'
    save_pretrained writes on global rank 0 only), for a from_pretrained of this rank's own."""
    from safetensors.torch import save_model

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.config.to_json_file(directory / "config.json")
    save_model(model, str(directory / "model.safetensors"))  # tied tensors once
    return directory


def quant_state_tensors(weight) -> list:
    """The tensors a bitsandbytes 4-bit weight holds beside its packed bytes (absmax, the double quantization's
    nested absmax, the offset); [] for any other tensor. Attributes of the weight's quant_state: neither parameters
    nor buffers, so a memory tracker must be handed them (hfscale.plan.profiler)."""
    qs = getattr(weight, "quant_state", None)
    if qs is None:
        return []
    held = (qs.absmax, getattr(getattr(qs, "state2", None), "absmax", None), getattr(qs, "offset", None))
    return [t for t in held if t is not None and hasattr(t, "numel")]


def nf4_bytes(model) -> int:
    """Bytes the 4-bit weights of `model` hold (packed weights + their absmax / double-quant state)."""
    total = 0
    for m in model.modules():
        w = getattr(m, "weight", None)
        if getattr(w, "quant_state", None) is None:
            continue
        total += w.numel() * w.element_size() + sum(t.numel() * t.element_size() for t in quant_state_tensors(w))
    return total


# --- after training ----------------------------------------------------------------------------------

def merge_into_base(base, adapter_dir):
    """`base` (an unquantized model in its own dtype: merging into 4-bit weights rounds the sum to NF4 and loses
    the adapter's update, transformers #31293) with the adapter saved in `adapter_dir` folded into its weights:
    a plain transformers model (no peft modules) that PTQ, GGUF, .pte, prune and eval take unchanged."""
    from peft import PeftModel

    if getattr(getattr(base, "config", None), "quantization_config", None) is not None:
        raise ConfigError("merge the adapter into the unquantized base: reload the base in its own dtype "
                          "(hfscale.models.build_model), never the 4-bit one")
    with warnings.catch_warnings():  # the tie's merge is handled in merge_live
        warnings.filterwarnings("ignore", message=".*tied_target_modules.*")
        model = PeftModel.from_pretrained(base, str(adapter_dir))
    return merge_live(model)


def merge_live(model):
    """Fold the live adapters into the (unquantized) base they sit on and drop the peft wrapper. A tied lm_head's
    adapter (the embedding's pair: tie_head_adapter_) is dropped first: the embedding's delta merged into the one
    matrix is the lm_head's too, once (merging both added it twice: 1.36 off on a tiny Gemma 3's logits)."""
    if not hasattr(model, "merge_and_unload"):
        return model
    head = model.get_output_embeddings()
    if tie_head_adapter_(model):
        model.base_model.model.set_output_embeddings(head.get_base_layer())
        model.base_model.model.tie_weights()
    return model.merge_and_unload()
