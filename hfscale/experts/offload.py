"""Run a transformers MoE model with its routed experts on disk and an LRU cache of them in RAM.

Every experts module (a `@use_experts_implementation` class with 3-D `gate_up_proj` / `down_proj`:
Gemma 4's `Gemma4TextExperts`, `MixtralExperts`, `Qwen2MoeExperts`, ...) is replaced by an
`OffloadedExperts` whose forward is transformers' eager expert loop, each expert's two matrices taken
from the cache instead of a slice of the 3-D parameter. Everything else (attention, the routers,
shared / dense MLPs, embeddings, norms) stays resident.

Bit-identical logits: the loop visits the hit experts in the same order and calls the same
`F.linear` on a contiguous [2I, H] / [H, I] matrix equal to the slice `gate_up_proj[e]`, so fp32
logits equal the fully loaded model's with transformers' eager experts implementation, bit for bit
(tests/test_experts.py: torch.equal, Gemma 4 MoE and Mixtral, CPU). transformers' default,
`grouped_mm`, sorts token-expert pairs and sums the top-k outputs in another order: on the tiny
Gemma 4 MoE its logits differ from eager's (and so from ours) by up to 1.9e-5 (fp32 rounding).
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass
from pathlib import Path

from ..errors import HfscaleError
from .cache import ExpertCache
from .store import ExpertSource, Reader, all_tensors, checkpoint_files, expert_keys, find_source

_LAYER = re.compile(r"layers\.(\d+)\.")


def parse_budget(ram_budget) -> int:
    """Bytes from an int or a size string ('2GB', '512MiB')."""
    from ..plan.planner import parse_size

    n = ram_budget if isinstance(ram_budget, int) and not isinstance(ram_budget, bool) else parse_size(str(ram_budget))
    if n <= 0:
        raise HfscaleError(f"ram_budget must be positive (got {ram_budget!r}); give bytes or a size such as 2GB")
    return n


def top_k(config) -> int:
    for attr in ("top_k_experts", "num_experts_per_tok"):
        if getattr(config, attr, None):
            return int(getattr(config, attr))
    raise HfscaleError(f"{type(config).__name__} names no routed top-k (top_k_experts / num_experts_per_tok); "
                       "this MoE config is not supported")


def find_experts(model) -> list[tuple[str, object]]:
    """(name, module) of every routed-experts module, in model order."""
    found = []
    for name, mod in model.named_modules():
        if isinstance(mod, OffloadedExperts):
            raise HfscaleError("this model's experts are offloaded already; use it as it is")
        gu, dn = getattr(mod, "gate_up_proj", None), getattr(mod, "down_proj", None)
        if getattr(gu, "ndim", 0) == 3 and getattr(dn, "ndim", 0) == 3:
            for flag, want in (("is_transposed", False), ("has_bias", False), ("has_gate", True),
                               ("is_concatenated", True), ("has_post_expert_norm", False)):
                if getattr(mod, flag, want) != want:
                    raise HfscaleError(f"{type(mod).__name__} has {flag}={not want}; expert offload supports the "
                                       "gate_up [E, 2I, H] / down [E, H, I] layout without biases (Gemma 4, Mixtral, Qwen-MoE)")
            found.append((name, mod))
    if not found:
        raise HfscaleError(f"{type(model).__name__} has no mixture-of-experts layers (no experts module with 3-D "
                           "gate_up_proj/down_proj); load it with transformers (hfscale eval) instead")
    return found


class OffloadedExperts:
    """Placeholder so `find_experts` can name it before the torch class below is built."""


def _build_module_class():
    import torch
    from torch import nn

    class _OffloadedExperts(nn.Module, OffloadedExperts):
        """Routed experts read through an ExpertCache; forward = transformers' eager expert loop."""

        def __init__(self, slot: int, num_experts: int, act_fn, fetch):
            super().__init__()
            self.slot, self.num_experts, self.act_fn = slot, num_experts, act_fn
            self._fetch = fetch  # (slot, expert) -> (gate_up [2I, H], down [H, I])

        def forward(self, hidden_states, top_k_index, top_k_weights):
            final = torch.zeros_like(hidden_states)
            with torch.no_grad():
                mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
                hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
            for e in hit[:, 0].tolist():
                if e == self.num_experts:
                    continue
                gate_up, down = self._fetch((self.slot, e))
                top_k_pos, token_idx = torch.where(mask[e])
                gate, up = nn.functional.linear(hidden_states[token_idx], gate_up).chunk(2, dim=-1)
                out = nn.functional.linear(self.act_fn(gate) * up, down)
                out = out * top_k_weights[token_idx, top_k_pos, None]
                final.index_add_(0, token_idx, out.to(final.dtype))
                del gate_up, down  # hold no expert past its use (an evicted one is freed here)
            return final

        def extra_repr(self) -> str:
            return f"slot={self.slot}, num_experts={self.num_experts}, weights=offloaded"

    return _OffloadedExperts


_CLASS = None


def _module_class():
    global _CLASS
    if _CLASS is None:
        _CLASS = _build_module_class()
    return _CLASS


@dataclass(frozen=True)
class Shape:
    """One experts module's shape: expert e is gate_up [2I, H] and down [H, I] in `dtype`."""
    num_experts: int
    gate_up: tuple[int, int]
    down: tuple[int, int]
    itemsize: int

    @property
    def expert_bytes(self) -> int:
        return (self.gate_up[0] * self.gate_up[1] + self.down[0] * self.down[1]) * self.itemsize


class ExpertOffload:
    """What `from_pretrained` / `offload_` attach to a model as `model.hfscale_experts`: the cache, its
    statistics, read-ahead on/off, and close() (releases files, threads and a temporary folder)."""

    def __init__(self, model, sources: dict[int, ExpertSource], shapes: dict[int, Shape], budget: int,
                 reader: str, dtype, cleanup=None):
        self.sources, self.shapes, self.budget, self.dtype = sources, shapes, budget, dtype
        self.reader = Reader(reader)
        self.top_k = top_k(model.config)
        self.cache = ExpertCache(self._load, lambda key: self.shapes[key[0]].expert_bytes, budget)
        self._cleanup = cleanup
        self._hooks: list = []
        self._layers = _decoder_layers(model)
        self._slots = sorted(sources)

    @property
    def expert_bytes(self) -> int:
        return max(s.expert_bytes for s in self.shapes.values())

    @property
    def streamed_bytes(self) -> int:
        return sum(s.expert_bytes * s.num_experts for s in self.shapes.values())

    def _load(self, key):
        slot, e = key
        gate_up_parts, (down_ref, di) = self.sources[slot].refs(e)
        parts = [self.reader.read(ref, i, self.dtype) for ref, i in gate_up_parts]
        import torch

        gate_up = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        shape = self.shapes[slot]
        down = self.reader.read(down_ref, di, self.dtype)
        if tuple(gate_up.shape) != shape.gate_up or tuple(down.shape) != shape.down:
            raise HfscaleError(f"expert {e} of layer {slot} on disk is {tuple(gate_up.shape)} / {tuple(down.shape)}, "
                               f"the model wants {shape.gate_up} / {shape.down}; the weights do not match the config")
        return gate_up, down

    # ------------------------------------------------------------------ read-ahead
    def set_prefetch(self, on: bool) -> None:
        """Read-ahead as Mixtral-offloading does it: after layer L, the next MoE layer's router is applied
        to layer L's output and its top-k experts are read on a worker thread while layer L+1 attends.
        The router's real input differs (it sees layer L+1's attention output too): a guess, scored in
        the cache's prefetch_hits / prefetched."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if not on:
            return
        for prev, nxt in zip(self._slots, self._slots[1:]):
            self._hooks.append(self._layers[prev].register_forward_hook(self._make_hook(nxt)))

    def _make_hook(self, slot: int):
        import torch

        layer = self._layers[slot]

        def hook(module, args, output):
            h = output[0] if isinstance(output, tuple) else output
            with torch.no_grad():
                flat = h.reshape(-1, h.shape[-1])
                if hasattr(layer, "router"):  # Gemma 4: the router norms its own input
                    out = layer.router(flat)
                else:  # Mixtral / Qwen-MoE: the router reads the post-attention norm
                    out = layer.mlp.gate(layer.post_attention_layernorm(flat))
                idx = out[-1] if isinstance(out, tuple) else out.topk(self.top_k, dim=-1).indices
                counts = torch.bincount(idx.reshape(-1), minlength=self.shapes[slot].num_experts)
                want = counts.topk(self.top_k).indices.tolist()
            self.cache.prefetch([(slot, e) for e in want])

        return hook

    def stats(self) -> dict:
        s = self.cache.stats.as_dict()
        s["budget_bytes"] = self.budget
        s["cached_bytes"] = self.cache.cached_bytes
        s["expert_bytes"] = self.expert_bytes
        s["streamed_bytes"] = self.streamed_bytes
        s["cache_experts"] = self.budget // self.expert_bytes
        return s

    def close(self) -> None:
        self.set_prefetch(False)
        self.cache.close()
        self.reader.close()
        if self._cleanup is not None:
            self._cleanup()


def _decoder_layers(model) -> dict[int, object]:
    out = {}
    for name, mod in model.named_modules():
        m = re.fullmatch(r"(?:.*\.)?layers\.(\d+)", name)
        if m:
            out[int(m.group(1))] = mod
    return out


def _slot(name: str) -> int:
    m = _LAYER.search(name + ".")
    if m is None:
        raise HfscaleError(f"experts module {name!r} is not inside a numbered decoder layer; not supported")
    return int(m.group(1))


def _shape(mod, dtype) -> Shape:
    import torch

    e, two_i, h = mod.gate_up_proj.shape
    return Shape(int(e), (int(two_i), int(h)), tuple(int(x) for x in mod.down_proj.shape[1:]),
                 torch.empty((), dtype=dtype).element_size())


def _check_budget(budget: int, shapes: dict[int, Shape], k: int) -> None:
    need = k * max(s.expert_bytes for s in shapes.values())
    if budget < need:
        raise HfscaleError(f"ram_budget {budget:,} bytes is smaller than one layer's routed experts (top-{k} x "
                           f"{need // k:,} bytes = {need:,}); give at least --ram-budget {need / 1e6:.1f}MB")


def _swap_in(model, experts: list[tuple[str, object]], fetch) -> None:
    cls = _module_class()
    for name, mod in experts:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, attr, cls(_slot(name), mod.num_experts, mod.act_fn, fetch))


def _attach(model, sources, shapes, experts, budget, reader, dtype, prefetch, cleanup=None) -> ExpertOffload:
    _check_budget(budget, shapes, top_k(model.config))
    off = ExpertOffload(model, sources, shapes, budget, reader, dtype, cleanup)
    _swap_in(model, experts, off.cache.get)
    model.hfscale_experts = off
    off.set_prefetch(prefetch)
    weakref.finalize(model, off.close)
    return model


def from_pretrained(path, ram_budget, dtype=None, prefetch: bool = False, reader: str = "pread"):
    """A transformers MoE model from a local safetensors directory whose routed experts are never all in
    memory, not even while loading: the model is built with parameters on the meta device, every other
    tensor is read from the files, the experts stay in them and are read on demand into an LRU cache of
    at most `ram_budget` bytes (int, or a size such as "2GB"). `dtype` (default fp32) is the compute dtype."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from ..models import load_config

    budget = parse_budget(ram_budget)
    dtype = dtype or torch.float32
    path = Path(path)
    if not path.is_dir():
        raise HfscaleError(f"{path} is not a model directory; experts are read from a local transformers "
                           "directory with safetensors (save_pretrained one first)")
    config = load_config(str(path))
    tensors = all_tensors(checkpoint_files(path))
    with init_empty_weights(include_buffers=False):  # parameters on meta; buffers (RoPE tables) computed
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    experts = find_experts(model)
    shapes = {_slot(n): _shape(m, dtype) for n, m in experts}
    _check_budget(budget, shapes, top_k(model.config))
    sources = {}
    for name, _ in experts:
        src = find_source(name, tensors)
        if src is None:
            raise HfscaleError(f"no expert weights for {name} in {path} (looked for the packed, Mixtral and Qwen-MoE "
                               "layouts); re-save the model with transformers' save_pretrained")
        sources[_slot(name)] = src
    layouts = {s.layout for s in sources.values()}
    _swap_in(model, experts, fetch=None)  # drop the meta expert parameters before loading the rest
    _load_resident(model, path, tensors, expert_keys(list(sources.values())), layouts, dtype)
    model.eval()
    return _attach(model, sources, shapes, experts, budget, reader, dtype, prefetch)


def _load_resident(model, path: Path, tensors: dict, skip: set[str], layouts, dtype) -> None:
    """Load every checkpoint tensor that is not a routed expert into the meta-initialised model."""
    from collections import defaultdict

    from safetensors import safe_open

    wanted = dict(model.state_dict(keep_vars=True))
    by_file = defaultdict(list)
    for key, ref in tensors.items():
        if key not in skip:
            by_file[ref.file].append(key)
    state, unknown = {}, []
    for file, keys in by_file.items():
        with safe_open(str(file), framework="pt") as f:  # closed (unmapped) before the experts are used
            for key in keys:
                name = key
                for lay in layouts:
                    name = lay.to_model(name)
                if name not in wanted:
                    unknown.append(key)
                    continue
                t = f.get_tensor(key)  # a view of the mapped file: copy it, so nothing resident stays mapped
                state[name] = t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t.clone()
    if unknown:
        raise HfscaleError(f"{path} holds tensors the model does not have ({unknown[0]}, {len(unknown)} in all); "
                           "the config does not match the weights")
    model.load_state_dict(state, strict=False, assign=True)
    if getattr(model.config, "tie_word_embeddings", False) or getattr(model.config.get_text_config(), "tie_word_embeddings", False):
        model.tie_weights()
    missing = [k for k, v in model.state_dict(keep_vars=True).items() if v.is_meta]
    if missing:
        raise HfscaleError(f"{path} lacks {missing[0]} ({len(missing)} tensors missing); the checkpoint is incomplete")


def offload_(model, ram_budget, folder=None, prefetch: bool = False, reader: str = "pread", force: bool = False):
    """Move the routed experts of a model already in memory to safetensors files (one per MoE layer) in
    `folder` (default: a temporary folder removed by model.hfscale_experts.close() or at exit) and free
    them; they are read back on demand into an LRU cache of at most `ram_budget` bytes."""
    import shutil
    import tempfile

    import torch
    from safetensors.torch import save_file

    from ..atomic import check_writable, staged

    budget = parse_budget(ram_budget)
    experts = find_experts(model)
    dtype = experts[0][1].gate_up_proj.dtype
    shapes = {_slot(n): _shape(m, dtype) for n, m in experts}
    _check_budget(budget, shapes, top_k(model.config))
    cleanup = None
    if folder is None:
        from ..pretrained import cache_root

        cache_root().mkdir(parents=True, exist_ok=True)
        out = Path(tempfile.mkdtemp(prefix="experts-", dir=cache_root()))
        cleanup = lambda: shutil.rmtree(out, ignore_errors=True)  # noqa: E731
        _write_experts(out, experts, save_file, torch)
    else:
        out = Path(folder)
        check_writable({str(out): "folder"}, force)
        with staged(out, directory=True) as tmp:
            _write_experts(tmp, experts, save_file, torch)
    tensors = all_tensors(sorted(out.glob("experts-*.safetensors")))
    sources = {_slot(n): find_source(n, tensors) for n, _ in experts}
    return _attach(model, sources, shapes, experts, budget, reader, dtype, prefetch, cleanup)


def _write_experts(out: Path, experts, save_file, torch) -> None:
    for name, mod in experts:  # one layer at a time: the transient copy is one layer's experts
        with torch.no_grad():
            save_file({f"{name}.gate_up_proj": mod.gate_up_proj.detach().contiguous(),
                       f"{name}.down_proj": mod.down_proj.detach().contiguous()},
                      str(out / f"experts-{_slot(name):05d}.safetensors"))
