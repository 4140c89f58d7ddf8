"""The training recipe's configuration: a validated dataclass, read from a recipe YAML and
overridden from the command line (`--key value`, same names with dashes)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from ..util.errors import ConfigError, HfscaleError, first_line


LORA_DEFAULTS = {"lora_rank": None, "lora_alpha": None, "lora_dropout": 0.0, "lora_targets": None, "lora_rslora": False,
                 "lora_plus_ratio": 1.0, "lora_init": "default", "lora_experts": False, "lora_trainable_tokens": None,
                 "lora_embedding": False}


@dataclass(frozen=True)
class TrainConfig:
    recipe: ClassVar[str] = "train_clm"  # the recipe this config runs (hfscale.train.recipe: what it cannot honour)
    model: str = "tiny-gemma3"  # built-in name, local transformers dir, or hub name (online)
    # builtin | files, globs, directories (.jsonl / .json / .parquet / .arrow / .txt) | 'a.jsonl:0.7,b/*.parquet:0.3'
    # (mixture weights) | a store made by `hfscale data prepare`. In a recipe YAML also a mapping:
    # data: {sources: [{path: a.jsonl, weight: 0.7}, ...], format: messages, train_on: assistant, packing: bfd, ...}
    data: str = "builtin"
    validation: str | None = None  # separate held-out file; default: `heldout` of the examples (builtin has its own split)
    heldout: float = 0.05
    format: str | None = None  # text | messages | prompt_completion | tokenized; default: detected (hfscale.data.formats)
    train_on: str | None = None  # all | completion | assistant | last; default: the format's
    packing: str | None = None  # bfd | wrapped | none; default: wrapped for text, bfd otherwise
    overflow: str | None = None  # truncate | drop | split; default: split for text, truncate otherwise
    # the attention kernel: unset = the model's own (the tiny models: eager); varlen = hfscale.models.varlen (packed
    # documents attend within themselves without an L x L mask, any device) | sdpa | eager | flash_attention_2 | _3
    attention: str | None = None
    # each micro batch as ONE row of its real tokens, no padding (hfscale.data.dataset's padding-free layout,
    # DataCollatorWithFlattening / TRL's padding_free): only with attention varlen or flash_attention_2 / _3
    padding_free: bool = False
    seq_len: int = 128
    global_batch_tokens: int = 8192  # tokens per optimizer step over all ranks
    micro_batch: int = 4  # sequences per rank per forward pass
    max_steps: int = 100
    lr: float = 3e-4
    min_lr_ratio: float = 0.1  # cosine decays to lr x this
    warmup_steps: int = 10
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0  # plain loops; DeepSpeed takes gradient_clipping from its JSON
    checkpointing: str = "off"  # off | full | every:K | auto (every ~sqrt(layers)-th layer)
    adamw: str = "fused"  # torch AdamW's implementation: fused | foreach | forloop (hfscale.scale.optim; the plan's too)
    # launch: what the DeepSpeed JSON / accelerate config says; auto: the same, but fp32 where it says
    # bf16 on a host that emulates bf16 (hfscale.util.hosts); bf16 | fp16 | fp32: this, whatever the launch says
    precision: str = "launch"
    eval_every: int = 50
    eval_blocks: int = 64  # held-out sequences per evaluation
    save_every: int = 50  # 0 = no intermediate checkpoints
    keep_last: int = 2
    output_dir: str = "runs/train_clm"
    resume: str | None = None  # "latest" or a checkpoint directory
    seed: int = 0
    log_every: int = 1
    doctor: bool = True  # run hfscale doctor's checks on the launch config first
    max_train_blocks: int = 0  # 0 = all packed training sequences
    progress: bool = True
    # > 0: record the memory timeline of the first N steps (hfscale.proofs.profile) into OUTPUT_DIR/memory:
    # rank{R}.json per rank, profile.json (measured vs the plan's prediction) and timeline.png
    profile_memory: int = 0
    # ALST's long-context levers (hfscale.scale.long_context; docs/long_context.md): the logits + loss and the
    # decoder MLPs / RMSNorms computed in this many slices of each sequence (0 = off), saved activations in host
    # memory
    tiled_loss: int = 0
    tiled_mlp: int = 0
    offload_activations: bool = False
    tiled_norm: int = 0
    # adapters (hfscale.scale.adapters; docs/adapters.md): none trains every parameter; lora | dora | qlora (NF4 base)
    # train low-rank adapters on a frozen base. In a recipe YAML also a mapping: adapter: {kind: lora, rank: 16, ...}
    adapter: str = "none"
    lora_rank: int | None = None  # default 16
    lora_alpha: float | None = None  # default 2 x rank
    lora_dropout: float = 0.0
    lora_targets: str | None = None  # comma-separated leaf names; default every decoder linear (q/k/v/o/gate/up/down)
    lora_rslora: bool = False
    lora_plus_ratio: float = 1.0
    lora_init: str = "default"  # default | gaussian | pissa | olora
    lora_experts: bool = False  # also the MoE experts' fused 3-D tensors (peft target_parameters; Qwen3-MoE, Gemma 4 MoE)
    # embedding rows trained beside the adapter (peft trainable_token_indices, a tied lm_head kept tied): "template"
    # (the ids the chat template writes, resolved from the run's tokenizer) and / or token ids, comma-separated
    lora_trainable_tokens: str | None = None
    # also LoRA on the input embedding and its tied lm_head (AdapterSpec.embedding)
    lora_embedding: bool = False
    extra: dict = field(default_factory=dict, compare=False)  # recipe YAML notes (ignored)

    def __post_init__(self):
        for name in ("seq_len", "global_batch_tokens", "micro_batch", "max_steps", "eval_blocks", "keep_last", "log_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1 (got {getattr(self, name)})")
        for name in ("eval_every", "save_every", "warmup_steps", "max_train_blocks", "profile_memory"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 (got {getattr(self, name)})")
        if not self.lr > 0:
            raise ConfigError(f"lr must be > 0 (got {self.lr})")
        if self.global_batch_tokens % self.seq_len:
            raise ConfigError(
                f"global_batch_tokens {self.global_batch_tokens:,} is not a multiple of seq_len {self.seq_len}; "
                f"use {max(1, self.global_batch_tokens // self.seq_len) * self.seq_len:,} or another multiple"
            )
        if self.checkpointing != "auto":
            from ..scale.checkpointing import parse_checkpointing

            parse_checkpointing(self.checkpointing)
        from ..scale.optim import check_adamw
        from ..util.hosts import PRECISION_CHOICES

        check_adamw(self.adamw)

        if self.precision not in PRECISION_CHOICES:
            raise ConfigError(f"precision {self.precision!r} not understood; use one of {', '.join(PRECISION_CHOICES)}")
        from ..models.varlen import ATTENTION

        if self.attention is not None and self.attention not in ATTENTION:
            raise ConfigError(f"attention {self.attention!r} not understood; use one of {', '.join(ATTENTION)} "
                              "(or leave it unset for the model's own kernel)")
        from .recipe import refuse_unsupported

        refuse_unsupported(self)  # what qat_clm / distill_clm cannot honour, before the checks that assume train_clm
        from ..data.dataset import check_padding_free

        check_padding_free(self.padding_free, self.attention)
        self.levers.check(self.seq_len, self.checkpointing)
        self.adapter_spec  # noqa: B018 - validated here, with the rest
        self.data_options  # noqa: B018 - validated here, with the rest

    @property
    def data_options(self):
        """The options that decide the token store's content (hfscale.data.store.DataOptions)."""
        from ..data.store import DataOptions

        return DataOptions(self.seq_len, self.format, self.train_on, self.packing, self.overflow, self.validation,
                           self.heldout)

    @property
    def adapter_spec(self):
        """The adapter settings as one validated hfscale.scale.adapters.AdapterSpec."""
        from ..scale.adapters import DECODER_LINEARS, AdapterSpec

        targets = self.lora_targets if self.lora_targets else DECODER_LINEARS
        if self.adapter == "none":
            given = [f"--{k.replace('_', '-')}" for k, default in LORA_DEFAULTS.items() if getattr(self, k) != default]
            if given:
                raise ConfigError(f"{', '.join(given)} set without an adapter; add --adapter lora (or dora, qlora), or "
                                  "drop them to train every parameter")
            return AdapterSpec()
        return AdapterSpec(self.adapter, 16 if self.lora_rank is None else self.lora_rank, self.lora_alpha, self.lora_dropout, targets,
                           rslora=self.lora_rslora, lora_plus_ratio=self.lora_plus_ratio, init=self.lora_init,
                           experts=self.lora_experts, trainable_tokens=self.lora_trainable_tokens or (),
                           embedding=self.lora_embedding)

    @property
    def levers(self):
        """The long-context switches as one validated hfscale.scale.long_context.Levers."""
        from ..scale.long_context import Levers

        return Levers(self.tiled_loss, self.tiled_mlp, self.offload_activations, self.tiled_norm)


@dataclass(frozen=True)
class QATRecipeConfig(TrainConfig):
    """recipes/qat_clm.py: fine-tune a trained checkpoint (`model`) against a quantization grid."""
    recipe: ClassVar[str] = "qat_clm"
    scheme: str = "8da4w"  # a QAT scheme of hfscale.compress.schemes (8da4w, int4wo, q4_0)
    group_size: int = 32  # input columns per scale; 0 = per-channel (torchao schemes)
    include_embeddings: bool = False  # q4_0: the tied embedding / head on the grid too (GGUF --embed-qtype Q4_0)
    lora_rank: int = 0  # > 0: train LoRA adapters on the fake-quantized base (peft), merged before convert
    distill: float = 0.0  # weight of KL to the unquantized model's probabilities (1 = teacher only)
    temperature: float = 1.0
    ptq_baseline: bool = True  # also score PTQ of the starting checkpoint for the quality table
    # QAT decays to zero: weights still moving at the end jitter across rounding boundaries
    # (benchmarks/compress.py: constant lr recovered -3.5% / 24% of PTQ's loss, cosine to 0 61% / 70%)
    min_lr_ratio: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        from ..compress.qat import as_spec
        from ..compress.schemes import QuantSpec

        as_spec(QuantSpec(self.scheme, group_size=self.group_size, include_embeddings=self.include_embeddings))
        if not 0.0 <= self.distill <= 1.0:
            raise ConfigError(f"distill must be in [0, 1] (got {self.distill}): the weight of the teacher's KL term")
        if self.lora_rank < 0 or not self.temperature > 0:
            raise ConfigError("lora_rank must be >= 0 and temperature > 0")

    @property
    def adapter_spec(self):
        """None here: qat_clm applies its own LoRA (--lora-rank: compress.qat.lora_spec, through hfscale.train.prepare)."""
        from ..scale.adapters import AdapterSpec

        return AdapterSpec()


def fields_of(cls=TrainConfig) -> dict:
    return {f.name: f for f in dataclasses.fields(cls) if f.name != "extra"}


FIELDS = fields_of(TrainConfig)


def _coerce(name: str, value, fields=FIELDS):
    f = fields[name]
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null") and "None" in kind):
        return None
    try:
        if kind.startswith("bool"):
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("true", "1", "yes"):
                return True
            if str(value).lower() in ("false", "0", "no"):
                return False
            raise ValueError
        if kind.startswith("int"):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(float(value)) if isinstance(value, str) and "e" in value.lower() else int(value)
        if kind.startswith("float"):
            return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: {value!r} is not a valid {kind.split(' ')[0]}") from None
    return str(value)


def load_recipe(path: str | None, overrides: dict | None = None, cls=TrainConfig) -> TrainConfig:
    """A TrainConfig (or `cls`) from a recipe YAML (unknown keys refused, with a suggestion) plus overrides."""
    import difflib

    import yaml

    values: dict = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise HfscaleError(f"recipe config {path} not found; pass an existing YAML (see recipes/*/)")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise HfscaleError(f"{path} is not valid YAML ({first_line(e)})") from None
        if not isinstance(loaded, dict):
            raise HfscaleError(f"{path} must hold a mapping of recipe settings")
        values.update(loaded)
    if isinstance(values.get("data"), (dict, list)):
        values.update(data_section(values["data"], path))
    if isinstance(values.get("adapter"), dict):
        values.update(adapter_section(values["adapter"], path))
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    fields = fields_of(cls)
    for key in values:
        if key not in fields and key != "extra":
            near = difflib.get_close_matches(key, fields, n=1)
            raise ConfigError(f"unknown recipe setting {key!r}" + (f"; did you mean {near[0]!r}?" if near else ""))
    return cls(**{k: (_coerce(k, v, fields) if k in fields else v) for k, v in values.items()})


DATA_KEYS = ("format", "train_on", "packing", "overflow", "validation", "heldout")


def data_section(section, path) -> dict:
    """A YAML `data:` mapping (or list of sources) -> the flat settings: sources as 'path:weight,...'."""
    if isinstance(section, list):
        section = {"sources": section}
    unknown = set(section) - {"sources", *DATA_KEYS}
    if unknown or "sources" not in section:
        raise ConfigError(f"{path}: data: takes sources (a path, or a list of {{path, weight}}) and "
                          f"{', '.join(DATA_KEYS)} (got {sorted(section)})")
    from ..data.sources import parse_sources

    sources = parse_sources(section["sources"])
    out = {k: section[k] for k in DATA_KEYS if k in section}
    out["data"] = ",".join(f"{s.path}:{s.weight:g}" if s.weight != 1 else s.path for s in sources)
    return out


# the YAML's adapter: keys -> the flat settings (--lora-rank ... on the command line)
ADAPTER_KEYS = {"kind": "adapter", "rank": "lora_rank", "alpha": "lora_alpha", "dropout": "lora_dropout",
                "targets": "lora_targets", "rslora": "lora_rslora", "lora_plus_ratio": "lora_plus_ratio", "init": "lora_init",
                "experts": "lora_experts", "trainable_tokens": "lora_trainable_tokens",
                "embedding": "lora_embedding"}


def adapter_section(section: dict, path) -> dict:
    """A YAML `adapter:` mapping -> the flat settings; names checked by AdapterSpec.from_mapping's rules."""
    unknown = sorted(set(section) - set(ADAPTER_KEYS))
    if unknown:
        import difflib

        near = difflib.get_close_matches(str(unknown[0]), ADAPTER_KEYS, n=1)
        raise ConfigError(f"{path}: adapter: unknown setting {unknown[0]!r}; "
                          + (f"did you mean {near[0]!r}?" if near else f"use {', '.join(ADAPTER_KEYS)}"))
    out = {ADAPTER_KEYS[k]: v for k, v in section.items()}
    for key in ("lora_targets", "lora_trainable_tokens"):
        if isinstance(out.get(key), (list, tuple)):
            out[key] = ",".join(str(x) for x in out[key])
    return out


def parse_recipe_args(argv, doc: str, config_help: str, cls=TrainConfig) -> tuple[str | None, dict, bool]:
    """A recipe's command line: --config YAML, --force, and a `--key value` override per field of `cls`.
    Returns (config path, overrides, force)."""
    import argparse

    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--config", help=config_help)
    p.add_argument("--force", action="store_true", help="start over in an OUTPUT_DIR that already holds a run")
    p.add_argument("--verbose", action="store_true", help="also show the third-party notices hidden by default "
                   "(hfscale/util/quiet.py lists them)")
    add_override_args(p, cls)
    args = p.parse_args(argv)
    from ..util.quiet import quiet_unless_verbose

    quiet_unless_verbose(args.verbose)  # each rank parses its arguments before torch is imported
    return args.config, {k: v for k, v in vars(args).items() if k not in ("config", "force", "verbose")}, args.force


def add_override_args(parser, cls=TrainConfig) -> None:
    """`--seq-len 256`-style overrides for every field of `cls` (strings, coerced by load_recipe)."""
    for name in fields_of(cls):
        parser.add_argument("--" + name.replace("_", "-"), dest=name, default=None, metavar="V")
