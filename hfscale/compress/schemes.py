"""The one registry of quantization schemes: short name -> how to build it on torchao or bitsandbytes.

Every CLI choice (`hfscale quantize --scheme`, `recipes/qat_clm.py --scheme`) and the docs table come
from SCHEMES, so flags never drift from code. A scheme records what it quantizes (weights, and
activations for the dynamic ones), its granularity (per-channel or per-group of `group_size` input
columns), its mapping (symmetric/asymmetric, where the library lets you choose), the device it needs
and whether torchao can fake-quantize it for QAT. Embeddings and lm_head are skipped by default
(Gemma ties lm_head to the embedding, so quantizing one quantizes both); `include_embeddings=True`
is offered for the q4_0 QAT grid (the GGUF writer stores the token embedding at --embed-qtype).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..util.errors import ConfigError, HfscaleError


@dataclass(frozen=True)
class Scheme:
    name: str
    library: str                       # "torchao" | "bitsandbytes" | "hfscale" (own grid, see ggml_grid)
    summary: str
    weight_bits: int
    activations: str = "float"         # "float" | "int8 dynamic" | "float8 dynamic"
    granularities: tuple = ("per-group", "per-channel")
    mappings: tuple = ("symmetric",)   # the first one is the default
    device: str = "any"                # "any" | "cuda"
    cpu_alternative: str | None = None # named in the refusal when device == "cuda" and there is no GPU
    qat: bool = False                  # torchao (or hfscale) can fake-quantize it for training
    calibrated: bool = False           # needs calibration batches (GPTQ)


SCHEMES: dict[str, Scheme] = {s.name: s for s in [
    Scheme("int8wo", "torchao", "int8 weights, float activations (Int8WeightOnlyConfig)", 8,
           granularities=("per-channel",)),
    Scheme("int8dq", "torchao", "int8 dynamic activations + int8 weights (Int8DynamicActivationInt8WeightConfig)", 8,
           activations="int8 dynamic", granularities=("per-channel",)),
    Scheme("8da4w", "torchao", "int8 dynamic activations + int4 weights (Int8DynamicActivationIntxWeightConfig)", 4,
           activations="int8 dynamic", mappings=("symmetric", "asymmetric"), qat=True),
    Scheme("int4wo", "torchao", "int4 weights, float activations, CPU-capable form (IntxWeightOnlyConfig)", 4,
           mappings=("symmetric", "asymmetric"), qat=True),
    Scheme("int3wo", "torchao", "int3 weights, float activations (IntxWeightOnlyConfig; aggressive, QAT recommended)", 3,
           mappings=("symmetric", "asymmetric"), qat=True),
    Scheme("int2wo", "torchao", "int2 weights, float activations (IntxWeightOnlyConfig; PTQ breaks models, QAT needed)", 2,
           mappings=("symmetric", "asymmetric"), qat=True),
    Scheme("int4wo-cuda", "torchao", "int4 weights with the CUDA tinygemm/mslk kernel (Int4WeightOnlyConfig)", 4,
           granularities=("per-group",), mappings=("asymmetric",), device="cuda", cpu_alternative="int4wo"),
    Scheme("gptq-int4wo", "hfscale", "int4wo grid with GPTQ rounding from calibration batches (hfscale.compress.gptq)", 4,
           mappings=("symmetric", "asymmetric"), calibrated=True),
    Scheme("float8", "torchao", "float8 dynamic activations + float8 weights (Float8DynamicActivationFloat8WeightConfig)", 8,
           activations="float8 dynamic", granularities=("per-tensor",), device="cuda", cpu_alternative="int8dq"),
    Scheme("nf4", "bitsandbytes", "4-bit NormalFloat weights, blocks of 64 (BitsAndBytesConfig load_in_4bit)", 4,
           granularities=("per-block-64",)),
    Scheme("fp4", "bitsandbytes", "4-bit float weights, blocks of 64 (BitsAndBytesConfig load_in_4bit)", 4,
           granularities=("per-block-64",)),
    Scheme("llm.int8", "bitsandbytes", "LLM.int8(): int8 weights, outlier columns in 16 bit (load_in_8bit)", 8,
           granularities=("per-channel",)),
    Scheme("q4_0", "hfscale", "llama.cpp Q4_0 grid (blocks of 32, one scale each), QAT only (hfscale.compress.ggml_grid)", 4,
           granularities=("per-block-32",), qat=True),
]}

PTQ_SCHEMES = tuple(n for n, s in SCHEMES.items() if n != "q4_0")
QAT_SCHEMES = tuple(n for n, s in SCHEMES.items() if s.qat)


@dataclass(frozen=True)
class QuantSpec:
    """A scheme with its knobs, validated. group_size 0 means per-channel (one scale per output row)."""
    scheme: str
    group_size: int = 32
    mapping: str | None = None
    include_embeddings: bool = False
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise ConfigError(f"unknown scheme {self.scheme!r}; choose one of {', '.join(SCHEMES)}")
        s = SCHEMES[self.scheme]
        if self.group_size < 0 or (self.group_size and self.group_size & (self.group_size - 1)):
            raise ConfigError(f"--group-size {self.group_size} must be a power of two (16, 32, 64, 128) or 0 for per-channel")
        if self.group_size == 0 and "per-channel" not in s.granularities:
            raise ConfigError(f"{self.scheme} has no per-channel form; use --group-size 32 (or 64, 128)")
        if self.mapping is not None and self.mapping not in s.mappings:
            raise ConfigError(f"{self.scheme} offers mapping {', '.join(s.mappings)} (got {self.mapping!r})")
        if self.include_embeddings and s.library == "bitsandbytes":
            raise ConfigError(f"bitsandbytes quantizes nn.Linear only; drop --include-embeddings for {self.scheme}")
        if self.include_embeddings and self.scheme != "q4_0":
            # measured (transformers 5.24, torchao 0.18): an untied quantized embedding + lm_head saves, but
            # from_pretrained reloads it with logits off by ~10-20, so hfscale does not write such a directory
            raise ConfigError("--include-embeddings does not reload correctly through transformers for torchao schemes; "
                              "keep the embedding in float (default) or export GGUF with --embed-qtype Q8_0/Q4_0")

    @property
    def info(self) -> Scheme:
        return SCHEMES[self.scheme]

    def resolved_mapping(self) -> str:
        return self.mapping or self.info.mappings[0]


def require_device(scheme: str) -> None:
    """One-line refusal for a scheme whose kernels this machine lacks, naming what runs here."""
    import torch

    s = SCHEMES[scheme]
    if s.device == "cuda" and not torch.cuda.is_available():
        raise HfscaleError(f"scheme {scheme} needs a CUDA GPU (its kernels do not run on CPU); on CPU use --scheme {s.cpu_alternative}")
    if scheme == "float8" and torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        raise HfscaleError("float8 needs an SM 8.9+ GPU (Ada/Hopper); use --scheme int8dq")


def _granularity(spec: QuantSpec):
    from torchao.quantization import PerAxis, PerGroup

    return PerAxis(0) if spec.group_size == 0 else PerGroup(spec.group_size)


def _mapping(spec: QuantSpec):
    from torchao.quantization.quant_primitives import MappingType

    return MappingType.ASYMMETRIC if spec.resolved_mapping() == "asymmetric" else MappingType.SYMMETRIC


def torchao_linear_config(spec: QuantSpec):
    """The torchao config applied to each quantized nn.Linear (also QATConfig's base config)."""
    import torch
    from torchao import quantization as q

    name = spec.scheme
    if name == "int8wo":
        return q.Int8WeightOnlyConfig()
    if name == "int8dq":
        return q.Int8DynamicActivationInt8WeightConfig()
    if name == "8da4w":
        return q.Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=_granularity(spec),
                                                       weight_mapping_type=_mapping(spec))
    if name in ("int4wo", "gptq-int4wo", "int3wo", "int2wo"):
        bits = {"int3wo": torch.int3, "int2wo": torch.int2}.get(name, torch.int4)
        return q.IntxWeightOnlyConfig(weight_dtype=bits, granularity=_granularity(spec), mapping_type=_mapping(spec))
    if name == "int4wo-cuda":
        return q.Int4WeightOnlyConfig(group_size=spec.group_size or 128)
    if name == "float8":
        return q.Float8DynamicActivationFloat8WeightConfig()
    raise ConfigError(f"{name} is not a torchao scheme")


def transformers_config(spec: QuantSpec):
    """The `quantization_config=` for `from_pretrained` (TorchAoConfig or BitsAndBytesConfig)."""
    import torch
    from transformers import BitsAndBytesConfig, TorchAoConfig

    s = spec.info
    if s.library == "bitsandbytes":
        if spec.scheme == "llm.int8":
            return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=["lm_head"])
        compute = torch.bfloat16 if torch.cuda.is_available() else torch.float32  # CPU kernels compute in fp32
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=spec.scheme, bnb_4bit_compute_dtype=compute,
                                  llm_int8_skip_modules=["lm_head"])
    return TorchAoConfig(torchao_linear_config(spec))


def linear_filter(include_embeddings: bool = False):
    """quantize_'s filter_fn: every nn.Linear except lm_head (tied to the embeddings) unless included."""
    import torch

    def keep(module, fqn: str) -> bool:
        return isinstance(module, torch.nn.Linear) and (include_embeddings or not fqn.endswith("lm_head"))

    return keep


def table() -> str:
    """Markdown table of the registry (docs and `hfscale quantize --help`)."""
    rows = ["| scheme | library | weights | activations | granularity | mapping | device | QAT |", "|---|---|---|---|---|---|---|---|"]
    for s in SCHEMES.values():
        rows.append(f"| {s.name} | {s.library} | int{s.weight_bits} | {s.activations} | {'/'.join(s.granularities)} | "
                    f"{'/'.join(s.mappings)} | {s.device} | {'yes' if s.qat else 'no'} |")
    return "\n".join(rows)


# --- GGUF storage (llama.cpp's formats): what the GGUF writer stores and the planner counts ---------

GGUF_BYTES = {"F32": 4.0, "F16": 2.0, "BF16": 2.0, "Q8_0": 34 / 32, "Q4_0": 18 / 32}  # bytes per weight


def default_embed_qtype(qtype: str) -> str:
    """Float exports keep the embedding at their own precision; quantized ones keep it at Q8_0.

    For Gemma the token embedding is also the (tied) output head over a 262k vocabulary: llama.cpp
    measured Gemma perplexity 9.48 with Q8_0 embeddings vs 9.68 with Q6_K (ANCHORS), and it is a
    small share of the file for the real models' ratios of vocab to depth.
    """
    return qtype if qtype in ("F16", "BF16") else "Q8_0"
