"""ExecuTorch .pte export (XNNPACK backend) with a KV-cache decode method, verified in
`executorch.runtime`.

The program has one method, forward(input_ids [1, 1], cache_position [1]) -> logits [1, 1, vocab]:
the KV cache (transformers' exportable static cache: max_seq_len long for every attention layer,
sliding ones included, whose window the mask applies; empty for Gemma 4's KV-sharing layers, which
read an earlier layer's) lives inside the program as mutable buffers, so the file generates token
by token: feed the prompt one token at a time, then each argmax back in.

Architectures: ARCHS (model_type -> its refusals, the configs ExecuTorch cannot export, each
refused in one line before anything is built). Gemma 3, dense Gemma 4 (per-layer embeddings,
KV-shared layers, sliding / full layers with different head sizes) and Llama 3.x run through the
same decode module and lowering; tests/test_export_pte.py checks each in executorch.runtime.

8da4w = int8 dynamic per-token activations × int4 weights in groups of 32 (torchao
Int8DynamicActivationIntxWeightConfig), applied to every nn.Linear before torch.export; XNNPACK
runs those as its dynamically quantized kernels. The tied embedding stays fp32 for the lookup.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..util.errors import HfscaleError
from . import evalset as E

QTYPES = ("fp32", "8da4w")


def _static_rope(cfg) -> str | None:
    """RoPE kinds whose frequencies are fixed at init export as constants; "dynamic" and "longrope" recompute them
    from the largest position seen (transformers' dynamic_rope_update), a data-dependent branch: torch.export
    refuses it ("Data-dependent branching", measured for "dynamic"; "longrope" takes the same branch, read)."""
    params = getattr(cfg, "rope_parameters", None) or {}
    per_kind = params.values() if params and all(isinstance(v, dict) for v in params.values()) else [params]
    for p in per_kind:
        kind = p.get("rope_type", "default")
        if kind in ("dynamic", "longrope"):
            return f"rope_type {kind!r} is not supported (it recomputes its frequencies per call); use static RoPE"
    return None


def _dense(cfg) -> str | None:
    """Gemma 4's MoE block routes tokens with aten.histc, which is outside the core ATen op set ExecuTorch lowers
    (measured: to_edge's verifier stops on it)."""
    if getattr(cfg, "enable_moe_block", False):
        return "enable_moe_block=True (MoE) is not supported: its router's aten.histc has no ExecuTorch kernel"
    return None


@dataclass(frozen=True)
class PteArch:
    """An architecture the .pte export covers; each of `refusals` returns the one-line reason ExecuTorch
    cannot export a given config of it, or None."""
    label: str
    refusals: tuple[Callable[[object], str | None], ...] = (_static_rope,)


# model_type -> the architectures exported and run in executorch.runtime by tests/test_export_pte.py
ARCHS: dict[str, PteArch] = {
    "gemma3_text": PteArch("Gemma 3 text, the built-in tiny-gemma3"),
    "gemma4_text": PteArch("Gemma 4 text, dense", (_static_rope, _dense)),
    "llama": PteArch("Llama 3.x"),
}


def check_supported(config, qtype: str) -> None:
    if qtype not in QTYPES:
        raise HfscaleError(f"pte qtype {qtype!r} is not supported; choose one of {', '.join(QTYPES)}")
    mt = getattr(config, "model_type", None)
    if mt not in ARCHS:
        raise HfscaleError(f"pte export supports model types {', '.join(ARCHS)} "
                           f"({'; '.join(a.label for a in ARCHS.values())}), not {mt!r}")
    for refusal in ARCHS[mt].refusals:
        reason = refusal(config)
        if reason:
            raise HfscaleError(f"pte export of this {mt} model: {reason}")


def quantize_8da4w_(model) -> None:
    import torch
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, PerGroup, quantize_

    quantize_(model, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32)))


def decode_module(model, max_seq_len: int):
    """forward(input_ids[1,1], cache_position[1]) with the KV cache held as module buffers."""
    from transformers.integrations.executorch import TorchExportableModuleWithHybridCache

    # a model saved from training with checkpointing carries use_cache=False; decoding needs the cache
    model.config.use_cache = True
    return TorchExportableModuleWithHybridCache(model, batch_size=1, max_cache_len=max_seq_len).eval()


def spell_out_tanh_gelu(ep):
    """XNNPACK's GELU computes the erf form even when the graph asks for approximate="tanh" (Gemma's
    gelu_pytorch_tanh): 4.7e-4 off the tanh form on [-6, 6] in executorch 1.5.1 (measured), which left every
    Gemma .pte ~1e-3 off eager in its logits. The tanh form is decomposed here into the mul / add / tanh ops
    XNNPACK runs as written (then 1e-6 off); a graph without it is returned as it is."""
    import torch
    from torch._decomp import get_decompositions

    gelu = torch.ops.aten.gelu.default
    tanh_form = any(n.target is gelu and n.kwargs.get("approximate", n.args[1] if len(n.args) > 1 else "none") == "tanh"
                    for n in ep.graph.nodes)
    return ep.run_decompositions(get_decompositions([torch.ops.aten.gelu])) if tanh_form else ep


def lower_to_pte(dec, out: Path) -> int:
    """torch.export (strict: the non-strict tracer trips on the cache's in-place updates in
    torch 2.13) -> edge -> XNNPACK delegate -> .pte bytes in the file `out` (callers that publish
    it stage it: export.artifacts)."""
    import torch
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    example = {"input_ids": torch.zeros(1, 1, dtype=torch.long), "cache_position": torch.zeros(1, dtype=torch.long)}
    with torch.no_grad():
        ep = spell_out_tanh_gelu(torch.export.export(dec, (), example, strict=True))
    prog = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()]).to_executorch()
    with open(out, "wb") as f:
        prog.write_to_file(f)
    return Path(out).stat().st_size


class PteRunner:
    """The .pte in executorch.runtime, stepped one token at a time."""

    def __init__(self, path: Path):
        from executorch.runtime import Runtime

        from ..util.quiet import native_noise_dropped

        with native_noise_dropped():  # XNNPACK's cpuinfo lines, written by C++ straight to stderr
            self.method = Runtime.get().load_program(str(path)).load_method("forward")
        self.step_seconds: list[float] = []

    def step(self, token: int, pos: int):
        import torch

        t = time.perf_counter()
        out = self.method.execute([torch.tensor([[token]], dtype=torch.long), torch.tensor([pos], dtype=torch.long)])
        self.step_seconds.append(time.perf_counter() - t)
        return out[0][0, -1].float().numpy()

    def logits(self, ids):
        import numpy as np

        return np.stack([self.step(t, i) for i, t in enumerate(ids)])

    def greedy(self, ids, n: int) -> list[int]:
        last = self.logits(ids)[-1]
        gen = []
        for i in range(n):
            gen.append(int(last.argmax()))
            if i + 1 < n:
                last = self.step(gen[-1], len(ids) + i)
        return gen


def eager_greedy(model, ids, n: int) -> list[int]:
    """Greedy tokens from the eager model, recomputing the full sequence each step (no cache)."""
    seq = list(ids)
    for _ in range(n):
        seq.append(int(E.eager_logits(model, seq)[-1].argmax()))
    return seq[len(ids):]


def verify_pte(path: Path, eager_same, eager_fp32, tokenizer, es: E.EvalSet, n_generate: int,
               progress: bool = True) -> dict:
    """Compare the .pte with the eager module it was exported from (`eager_same`, quantized the
    same way) and with the fp32 source; greedy generation must match eager token for token."""
    from tqdm.auto import tqdm

    rt = PteRunner(path)
    prompts = E.prompt_ids(tokenizer, es)
    same, fp32 = [], []
    for p in tqdm(prompts, desc="executorch logits", disable=not progress):
        got = rt.logits(p)
        same.append(E.compare(E.eager_logits(eager_same, p), got))
        fp32.append(E.compare(E.eager_logits(eager_fp32, p), got))
    per_token, timed = sorted(rt.step_seconds)[len(rt.step_seconds) // 2], len(rt.step_seconds)
    nll = nll_ref = 0.0
    n = 0
    for b in tqdm(E.ppl_blocks(tokenizer, es).tolist(), desc="executorch perplexity", disable=not progress):
        a, k = E.nll_from_logits(rt.logits(b), b)
        r, _ = E.nll_from_logits(E.eager_logits(eager_fp32, b), b)
        nll, nll_ref, n = nll + a, nll_ref + r, n + k
    prompt = prompts[0][:16]
    gen_pte = rt.greedy(prompt, n_generate)
    gen_eager = eager_greedy(eager_same, prompt, n_generate)
    return {"runtime": "executorch.runtime (XNNPACK)", "vs_eager_same_quantization": E.merge(same),
            "vs_transformers_fp32": E.merge(fp32), "perplexity": E.ppl(nll, n),
            "perplexity_transformers_fp32": E.ppl(nll_ref, n), "perplexity_tokens": n,
            "greedy": {"prompt_tokens": len(prompt), "generated": n_generate, "pte": gen_pte, "eager": gen_eager,
                       "identical": gen_pte == gen_eager},
            "median_seconds_per_token": per_token, "timed_decode_steps": timed}
