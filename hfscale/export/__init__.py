"""Edge export: GGUF for llama.cpp and ExecuTorch .pte, each verified in its own runtime.

`export_gguf_adapter` writes a peft LoRA directory as a llama.cpp adapter GGUF (`hfscale quantize --adapter`).
FORMATS drives `hfscale quantize --format`: each entry has `.qtypes`, `.default_qtype` and
`.export(model, out, qtype, force, **options) -> dict` (the sidecar record, printed as JSON).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .artifacts import export_gguf, export_gguf_adapter, export_pte
from .gguf import QTYPES as GGUF_QTYPES
from .pte import QTYPES as PTE_QTYPES


@dataclass(frozen=True)
class Format:
    name: str
    qtypes: tuple[str, ...]
    default_qtype: str
    export: Callable[..., dict]
    runtime: str


FORMATS: dict[str, Format] = {
    "gguf": Format("gguf", GGUF_QTYPES, "Q4_0", export_gguf, "llama.cpp"),
    "pte": Format("pte", PTE_QTYPES, "8da4w", export_pte, "executorch.runtime (XNNPACK)"),
}


__all__ = ["FORMATS", "Format", "export_gguf", "export_gguf_adapter", "export_pte"]
