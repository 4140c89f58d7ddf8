"""The quality report: held-out perplexity of each model, top-1 agreement with a reference model,
and how much of post-training quantization's loss QAT won back.

    recovered = (ppl_PTQ - ppl_QAT) / (ppl_PTQ - ppl_float)         (1.0 = all of it, 0 = none)

Perplexity is exp(mean next-token NLL) over `n_blocks` packed blocks of the held-out split, every
model scored on the very same tokens. Quantized directories (torchao, bitsandbytes) load through
`from_pretrained`, so what is scored is what a user reloads, not an in-memory twin.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class EvalData:
    data: str = "builtin"          # builtin | local .txt/.jsonl/.parquet (its validation split is scored)
    validation: str | None = None
    seq_len: int = 128
    n_blocks: int = 64             # 64 x 128 = 8,192 scored positions on the tiny default
    batch_size: int = 8

    def __post_init__(self):
        from ..util.errors import ConfigError

        if min(self.seq_len, self.n_blocks, self.batch_size) < 1:
            raise ConfigError("--seq-len, --blocks and --batch-size must be >= 1")


def heldout_blocks(tokenizer, ed: EvalData):
    from ..data.corpus import load_text, packed_blocks

    return packed_blocks(tokenizer, load_text(ed.data, ed.validation)["validation"]["text"], ed.seq_len)[: ed.n_blocks]


def calibration_blocks(tokenizer, n: int = 32, seq_len: int = 128, data: str = "builtin"):
    """Calibration batches come from the *train* split, so the held-out score stays untouched."""
    from ..data.corpus import load_text, packed_blocks

    return packed_blocks(tokenizer, load_text(data)["train"]["text"], seq_len)[:n]


def score(model, blocks, batch_size: int = 8, want_top1: bool = False):
    """(summed NLL, scored tokens, top-1 predictions [n, seq-1] or None) over `blocks`: full blocks (a Long[N, S]
    tensor, every next token scored) or a list of packed batches (hfscale.models.documents: documents kept apart,
    only their trained tokens scored; `batch_size` unused)."""
    import torch

    from ..models.documents import attn_implementation, forward_kwargs
    from ..models.loss import token_nll

    total, count, top1 = 0.0, 0, []
    device = next(model.parameters()).device
    packed = not isinstance(blocks, torch.Tensor)
    batches = blocks if packed else (blocks[i : i + batch_size] for i in range(0, len(blocks), batch_size))
    model.eval()
    with torch.no_grad():
        for b in batches:
            if packed:
                b = {k: v.to(device) for k, v in b.items()}
                labels = b["labels"]
                logits = model(**forward_kwargs({k: v for k, v in b.items() if k != "labels"},
                                                attn_implementation(model))).logits
            else:
                labels = b = b.to(device)
                logits = model(input_ids=b).logits
            nll, n = token_nll(logits, labels)
            total += float(nll)
            count += int(n)
            if want_top1:
                top1.append(logits[:, :-1].argmax(-1).cpu())
    return total, count, (torch.cat(top1) if want_top1 else None)


def perplexity(model, blocks, batch_size: int = 8) -> float:
    nll, n, _ = score(model, blocks, batch_size)
    return math.exp(nll / n)


def recovered(ppl_float: float, ppl_ptq: float, ppl_qat: float) -> float | None:
    """Share of PTQ's perplexity loss that QAT recovered; None when PTQ lost nothing to recover."""
    loss = ppl_ptq - ppl_float
    return None if loss <= 0 else (ppl_ptq - ppl_qat) / loss


def model_bytes(path: str, model) -> int:
    """Bytes of the weight files when `path` is a directory, else of the in-memory tensors."""
    from pathlib import Path

    from .ptq import quantized_bytes_in_memory
    from .save import dir_bytes

    return dir_bytes(path) if Path(path).is_dir() else quantized_bytes_in_memory(model)


def evaluate_models(paths: list[str], ed: EvalData = EvalData(), progress: bool = True) -> list[dict]:
    """One row per model: perplexity, bytes and top-1 agreement with the first model (the reference)."""
    from tqdm.auto import tqdm

    from ..models.builtin import load_for_eval

    rows, ref_top1, blocks = [], None, None
    for path in tqdm(paths, desc="eval", disable=not progress):
        model, tok = load_for_eval(path, dtype=_quantized_dtype(path))  # as a user reloads it (quantized dirs too)
        if blocks is None:
            blocks = heldout_blocks(tok, ed)  # every model is scored on the first model's tokens
        nll, n, top1 = score(model, blocks, ed.batch_size, want_top1=True)
        ref_top1 = top1 if ref_top1 is None else ref_top1
        quant = getattr(model.config, "quantization_config", None)
        rows.append({"model": path, "perplexity": math.exp(nll / n), "nll": nll / n, "tokens": n,
                     "top1_vs_reference": float((top1 == ref_top1).float().mean()),
                     "bytes": model_bytes(path, model),
                     "quantization": _quant_name(quant)})
        del model
    return rows


def _quantized_dtype(path):
    """A torchao-quantized directory saved from a bf16 model keeps bf16 scales: loaded as fp32 around them,
    its linears refuse the fp32 activations (dtype mismatch), so it is scored in the dtype it was saved in."""
    import json
    from pathlib import Path

    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return None
    d = json.loads(cfg.read_text())
    if "quantization_config" not in d:
        return None
    import torch

    return getattr(torch, str(d.get("dtype") or d.get("torch_dtype") or "float32"), None)


def _quant_name(q) -> str:
    if q is None:
        return "none"
    d = q if isinstance(q, dict) else q.to_dict()
    if d.get("quant_method") == "torchao":
        qt = d.get("quant_type", {})
        inner = qt.get("default", qt) if isinstance(qt, dict) else qt
        return "torchao " + (inner.get("_type", "") if isinstance(inner, dict) else str(inner))
    method = d.get("quant_method", "quantized")
    return str(getattr(method, "value", method)) + (" 4-bit " + d.get("bnb_4bit_quant_type", "") if d.get("load_in_4bit") else "")


def rows_table(rows: list[dict]) -> str:
    head = "| model | quantization | bytes | perplexity | top-1 vs first |\n|---|---|---:|---:|---:|"
    return "\n".join([head] + [f"| {r['model']} | {r['quantization']} | {r['bytes']:,} | {r['perplexity']:.3f} | "
                               f"{r['top1_vs_reference']:.3f} |" for r in rows])


def qat_table(ppl_float: float, ppl_ptq: float, ppl_qat: float, scheme: str, label_float: str = "float") -> str:
    """bf16 / PTQ / QAT side by side, with the share of PTQ's loss that QAT recovered."""
    rec = recovered(ppl_float, ppl_ptq, ppl_qat)
    rec_s = "n/a (PTQ lost nothing)" if rec is None else f"{100 * rec:.1f}%"
    return (f"| {label_float} | PTQ {scheme} | QAT {scheme} | PTQ loss recovered by QAT |\n|---:|---:|---:|---:|\n"
            f"| {ppl_float:.3f} | {ppl_ptq:.3f} | {ppl_qat:.3f} | {rec_s} |")
