"""ExecuTorch .pte export (XNNPACK backend) with a KV-cache decode method, verified in
`executorch.runtime`.

The program has one method, forward(input_ids [1, 1], cache_position [1]) -> logits [1, 1, vocab]:
the KV cache (transformers' static hybrid cache: full-length for global layers, window-sized for
sliding ones) lives inside the program as mutable buffers, so the file generates token by token:
feed the prompt one token at a time, then each argmax back in.

8da4w = int8 dynamic per-token activations × int4 weights in groups of 32 (torchao
Int8DynamicActivationIntxWeightConfig), applied to every nn.Linear before torch.export; XNNPACK
runs those as its dynamically quantized kernels. The tied embedding stays fp32 for the lookup.
"""

from __future__ import annotations

import time
from pathlib import Path

from ..util.errors import HfscaleError
from . import evalset as E

QTYPES = ("fp32", "8da4w")
SUPPORTED_MODEL_TYPES = ("gemma3_text",)


def check_supported(config, qtype: str) -> None:
    if qtype not in QTYPES:
        raise HfscaleError(f"pte qtype {qtype!r} is not supported; choose one of {', '.join(QTYPES)}")
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise HfscaleError(f"pte export supports model types {', '.join(SUPPORTED_MODEL_TYPES)} "
                           f"(Gemma 3 text and the built-in tiny-gemma3), not {mt!r}")


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


def lower_to_pte(dec, out: Path) -> int:
    """torch.export (strict: the non-strict tracer trips on the cache's in-place updates in
    torch 2.13) -> edge -> XNNPACK delegate -> .pte bytes in the file `out` (callers that publish
    it stage it: export.artifacts)."""
    import torch
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    example = {"input_ids": torch.zeros(1, 1, dtype=torch.long), "cache_position": torch.zeros(1, dtype=torch.long)}
    with torch.no_grad():
        ep = torch.export.export(dec, (), example, strict=True)
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
