"""A peft LoRA adapter directory (adapter_config.json + adapter_model.safetensors) as a llama.cpp adapter GGUF:
what `llama-cli --lora FILE` and llama-cpp-python's `Llama(..., lora_path=FILE)` apply on top of the base model's
GGUF (hfscale quantize MODEL --format gguf), at run time, to a base of any qtype.

The format llama.cpp's adapter loader reads (src/llama-adapter.cpp, llama_adapter_lora_init):
- `general.type` = "adapter", `adapter.type` = "lora", `general.architecture` = the base model's (checked
  against it), `adapter.lora.alpha`: llama.cpp scales each product by alpha / rank (rank = lora_a's rows).
- per adapted weight `W` (GGUF name `blk.N.attn_q.weight` ...): `W.lora_a` stored [r, in] and `W.lora_b`
  [out, r] (row-major, as peft keeps them), so that ggml's ne of a is [in, r] and of b is [r, out], the
  shapes the loader checks against W. The output is W x + scale * B (A x).
- the same layout changes as the base: for llama.cpp's `llama` arch the rows of q/k projections are
  permuted (gguf_llama.permute_qk); W's rows are B's rows, so B is permuted and A kept.
peft's scale is lora_alpha / r (lora_alpha / sqrt(r) with use_rslora); written as alpha = scale * r, so both give
the same product. Refused in one line, nothing written: other peft types, DoRA, LoRA biases, per-module
rank/alpha patterns, modules_to_save, fan_in_fan_out, adapted embeddings / output heads, non-safetensors weights.
Tensors are F32 (an adapter is small; no rounding on top of the base's).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..util.errors import HfscaleError

KEY = re.compile(r"base_model\.model\.(.+)\.lora_([AB])\.weight")
REFUSED_OPTIONS = {"use_dora": "DoRA (use_dora)", "fan_in_fan_out": "fan_in_fan_out", "lora_bias": "LoRA biases",
                   "modules_to_save": "modules_to_save", "rank_pattern": "per-module ranks (rank_pattern)",
                   "alpha_pattern": "per-module alphas (alpha_pattern)", "target_parameters": "target_parameters"}


@dataclass(frozen=True)
class LoraAdapter:
    rank: int
    alpha: float                                   # llama.cpp's: its scale alpha / rank equals peft's scaling
    pairs: dict[str, tuple[np.ndarray, np.ndarray]]  # base weight name (model.layers.0.self_attn.q_proj.weight) -> (A, B)
    config: dict


def _bad(adapter_dir, problem: str) -> HfscaleError:
    return HfscaleError(f"--adapter {adapter_dir}: {problem}")


def read_adapter(adapter_dir, config) -> LoraAdapter:
    """Read and validate a peft LoRA directory against the base model's config (shapes from a meta-device build)."""
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    d = Path(adapter_dir)
    if not (d / "adapter_config.json").is_file():
        raise _bad(d, "has no adapter_config.json; give a peft adapter directory (PeftModel.save_pretrained)")
    if not (d / "adapter_model.safetensors").is_file():
        raise _bad(d, "has no adapter_model.safetensors (pickled adapter_model.bin is not read; save with safetensors)")
    ac = json.loads((d / "adapter_config.json").read_text())
    if ac.get("peft_type") != "LORA":
        raise _bad(d, f"peft_type {ac.get('peft_type')!r} is not LORA")
    for key, what in REFUSED_OPTIONS.items():
        if ac.get(key):
            raise _bad(d, f"{what} is not supported by llama.cpp's LoRA adapters")
    if ac.get("bias", "none") != "none":
        raise _bad(d, f"bias={ac['bias']!r} is not supported by llama.cpp's LoRA adapters (use bias='none')")
    r = int(ac["r"])
    scale = float(ac["lora_alpha"]) / (math.sqrt(r) if ac.get("use_rslora") else r)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    found: dict[str, dict[str, np.ndarray]] = {}
    for k, v in load_file(str(d / "adapter_model.safetensors")).items():
        m = KEY.fullmatch(k)
        if not m:
            raise _bad(d, f"tensor {k!r} is not the lora_A / lora_B of a linear layer")
        found.setdefault(m.group(1) + ".weight", {})[m.group(2)] = v.astype(np.float32)
    pairs = {}
    for name, ab in found.items():
        if set(ab) != {"A", "B"}:
            raise _bad(d, f"{name} has lora_{''.join(ab)} only")
        if name not in shapes or name.startswith("lm_head") or "embed" in name:
            raise _bad(d, f"{name} is not a linear layer inside the decoder blocks of this model")
        out_f, in_f = shapes[name]
        a, b = ab["A"], ab["B"]
        if a.shape != (r, in_f) or b.shape != (out_f, r):
            raise _bad(d, f"{name}: lora_A {a.shape} / lora_B {b.shape} do not fit the base weight {shapes[name]} "
                          f"at r={r}; was it trained on another model?")
        pairs[name] = (a, b)
    if not pairs:
        raise _bad(d, "holds no LoRA tensors")
    return LoraAdapter(rank=r, alpha=scale * r, pairs=pairs, config=ac)


def write_adapter_gguf(lora: LoraAdapter, config, out: Path) -> int:
    """Write the adapter GGUF for a base of `config` (its architecture from gguf.ARCHS); returns the tensor count."""
    import gguf

    from .gguf import ARCHS, _gguf_name, check_supported

    check_supported(config)
    arch = ARCHS[config.model_type]
    names = gguf.TensorNameMap(gguf.MODEL_ARCH[arch.gguf_arch], config.num_hidden_layers)
    w = gguf.GGUFWriter(Path(out), arch=gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[arch.gguf_arch]])
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(lora.alpha))
    for name, (a, b) in lora.pairs.items():
        gname = _gguf_name(names, name)
        w.add_tensor(gname + ".lora_a", np.ascontiguousarray(a))
        w.add_tensor(gname + ".lora_b", np.ascontiguousarray(arch.transform(name, b, config)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    return 2 * len(lora.pairs)


def verify_adapter(path: Path, model_name: str, adapter_dir, es, progress: bool = True) -> dict:
    """In llama.cpp: an F16 GGUF of the base with this adapter applied, against transformers' merged model
    (peft merge_and_unload, fp32) on the held-out prompts; and the same base alone against the base model, which
    is the F16 rounding floor the adapter's numbers are read against. `adapter_effect` is how far the merged
    model's logits are from the base's: what a missing or mis-scaled adapter would leave."""
    import copy
    import tempfile

    import numpy as np
    from peft import PeftModel
    from tqdm.auto import tqdm

    from ..models.builtin import load_for_eval
    from . import evalset as E
    from .gguf import GGUFOptions, write_gguf
    from .verify_llama import llama_logits, open_llama

    base, tok = load_for_eval(model_name)
    merged = PeftModel.from_pretrained(copy.deepcopy(base), str(adapter_dir)).merge_and_unload().eval()
    prompts = E.prompt_ids(tok, es)
    ref_base = [E.eager_logits(base, p) for p in prompts]
    ref_merged = [E.eager_logits(merged, p) for p in prompts]
    out: dict = {"runtime": "llama.cpp (llama-cpp-python)", "base_gguf": "F16, written for the check"}
    with tempfile.TemporaryDirectory() as tmp:
        base_gguf = Path(tmp) / "base-F16.gguf"
        write_gguf(base, tok, base_gguf, GGUFOptions("F16"), progress=False)
        with open_llama(base_gguf, n_ctx=es.prompt_tokens, lora=path) as llm:
            out["vs_merged_transformers"] = E.merge([E.compare(r, llama_logits(llm, p)) for r, p in
                                                     tqdm(list(zip(ref_merged, prompts)), desc="llama.cpp + LoRA",
                                                          disable=not progress)])
        with open_llama(base_gguf, n_ctx=es.prompt_tokens) as llm:
            out["base_alone_vs_transformers"] = E.merge([E.compare(r, llama_logits(llm, p))
                                                         for r, p in zip(ref_base, prompts)])
    out["adapter_effect_max_abs_dlogit"] = float(max(np.abs(a - b).max() for a, b in zip(ref_merged, ref_base)))
    return out
