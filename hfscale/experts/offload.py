"""Run a transformers MoE model with its routed experts on disk and an LRU cache of them in RAM.

Every experts module (a `@use_experts_implementation` class with 3-D `gate_up_proj` / `down_proj`:
Gemma 4's `Gemma4TextExperts`, `MixtralExperts`, `Qwen2MoeExperts`, ...) is replaced by an
`OffloadedExperts`. Everything else (attention, the routers, shared / dense MLPs, embeddings, norms)
stays resident.

The forward groups the layer's token-expert pairs by expert once (one stable sort), gathers the hidden
states once, and asks the cache for the layer's routed experts together (`ExpertCache.get_many`): cached
ones are computed first, then the missing ones as they are read. A layer that routes to more
experts than the budget holds (a long prefill under a small budget) takes them one at a time instead, so
no more than the budget is held. Read buffers of evicted experts are reused (pread reader).

Bit-identical logits: per expert the same `F.linear` calls on the same rows (in the order
transformers' eager loop gathers them) with a contiguous [2I, H] / [H, I] matrix equal to the slice
`gate_up_proj[e]`, and the expert outputs are added to the result in ascending expert order as the
eager loop adds them, whatever order they were computed in. So fp32 logits equal the fully loaded
model's with transformers' eager experts implementation, bit for bit, when both hold their weights at the
same alignment (tests/test_experts.py: torch.equal, Gemma 4 MoE and Mixtral, both readers, prefill and decode,
CPU, also under MKL_ENABLE_INSTRUCTIONS=SSE4_2; why alignment matters: hfscale/testing/aligned.py). transformers' default,
`grouped_mm`, sums the top-k outputs in another order: on the tiny Gemma 4 MoE its logits differ from
eager's (and so from ours) by up to 1.9e-5 (fp32 rounding).
"""

from __future__ import annotations

import re
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

from ..util.errors import HfscaleError
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

    linear = nn.functional.linear

    class _OffloadedExperts(nn.Module, OffloadedExperts):
        """Routed experts read through an ExpertCache; per expert the same arithmetic as transformers'
        eager expert loop (see the module docstring for why the logits are bit-identical)."""

        def __init__(self, slot: int, num_experts: int, act_fn, fetch, fetch_many=None, capacity: int = 0):
            super().__init__()
            self.slot, self.num_experts, self.act_fn = slot, num_experts, act_fn
            self._fetch = fetch            # (slot, expert) -> (gate_up [2I, H], down [H, I])
            self._fetch_many = fetch_many  # [(slot, expert), ...] -> iterator of (key, (gate_up, down))
            self.capacity = capacity       # experts the budget holds: a layer needing more goes one at a time

        def forward(self, hidden_states, top_k_index, top_k_weights):
            tokens = hidden_states.shape[0]
            with torch.no_grad():
                # token-expert pairs grouped by expert once: pairs in top-k-position-major order (pos * tokens
                # + token), sorted stably by expert = per expert, the order torch.where(mask[e]) gives them
                flat = top_k_index.t().reshape(-1)
                order = torch.sort(flat, stable=True).indices
                counts = torch.bincount(flat, minlength=self.num_experts + 1)[: self.num_experts].tolist()
            token_idx = order % tokens
            x = hidden_states[token_idx]
            w = top_k_weights.t().reshape(-1)[order, None]
            spans, start = {}, 0
            for e, c in enumerate(counts):
                if c:
                    spans[e] = (start, start + c)
                    start += c
            outs = {}

            def run(e, gate_up, down):
                a, b = spans[e]
                gate, up = linear(x[a:b], gate_up).chunk(2, dim=-1)
                outs[e] = linear(self.act_fn(gate) * up, down) * w[a:b]

            gate_up = down = None
            if self._fetch_many is not None and len(spans) <= self.capacity:
                # a layer's experts at once: the cached ones first, then the others as they are read
                for (_, e), (gate_up, down) in self._fetch_many([(self.slot, e) for e in spans]):
                    run(e, gate_up, down)
                del gate_up, down
            else:  # more experts than the budget holds: one at a time, none held past its use
                for e in spans:
                    gate_up, down = self._fetch((self.slot, e))
                    run(e, gate_up, down)
                    del gate_up, down
            final = torch.zeros_like(hidden_states)
            for e, (a, b) in spans.items():  # summed in expert order, as the eager loop sums them
                final.index_add_(0, token_idx[a:b], outs[e].to(final.dtype))
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
                 reader: str, dtype, cleanup=None, read_timeout_s: float | None = None):
        self.sources, self.shapes, self.budget, self.dtype = sources, shapes, budget, dtype
        self.reader = Reader(reader)
        self.top_k = top_k(model.config)
        self.cache = ExpertCache(self._load, lambda key: self.shapes[key[0]].expert_bytes, budget,
                                 read_timeout_s=read_timeout_s, describe=self._describe,
                                 on_evict=self._retire if reader == "pread" else None)
        self._cleanup = cleanup
        self._hooks: list = []
        self._layers = _decoder_layers(model)
        self._slots = sorted(sources)
        self._spare_lock = threading.Lock()
        self._spare: list = []  # read buffers of evicted experts: (buffer, weakrefs to the tensors handed out)

    @property
    def expert_bytes(self) -> int:
        return max(s.expert_bytes for s in self.shapes.values())

    @property
    def streamed_bytes(self) -> int:
        return sum(s.expert_bytes * s.num_experts for s in self.shapes.values())

    def _describe(self, key) -> str:
        slot, e = key
        _, (down_ref, _) = self.sources[slot].refs(e)
        return f"expert {e} of layer {slot} from {down_ref.file}"

    # ------------------------------------------------------------------ reading, with recycled buffers
    def _retire(self, key, value) -> None:
        """An evicted expert's buffer is read into again once nothing uses its tensors (the running forward
        may still hold them: weakrefs tell). At most two wait; the others are left to be freed."""
        import torch

        with self._spare_lock:
            if len(self._spare) >= 2:
                return
            gate_up, down = value
            buf = torch.empty(0, dtype=torch.uint8).set_(gate_up.untyped_storage())
            if buf.numel() == gate_up.nbytes + down.nbytes:  # one buffer per expert, as _load reads them
                self._spare.append((buf, weakref.ref(gate_up), weakref.ref(down)))

    def _buffer(self, n: int):
        import torch

        for i, (buf, *refs) in enumerate(self._spare):
            if buf.numel() == n and all(r() is None for r in refs):
                del self._spare[i]
                return buf
        return torch.empty(n, dtype=torch.uint8)

    def _load(self, key):
        """Expert (slot, e) as (gate_up [2I, H], down [H, I]), both views of one buffer of its bytes."""
        slot, e = key
        shape = self.shapes[slot]
        gate_up_parts, (down_ref, di) = self.sources[slot].refs(e)
        for ref, i in [*gate_up_parts, (down_ref, di)]:
            got = ref.shape[1:] if i >= 0 else ref.shape
            if len(got) != 2:
                raise HfscaleError(f"expert {e} of layer {slot} on disk has shape {tuple(got)}; the weights do not "
                                   "match the config")
        rows = [ref.shape[-2] for ref, _ in gate_up_parts]
        if sum(rows) != shape.gate_up[0] or any(ref.shape[-1] != shape.gate_up[1] for ref, _ in gate_up_parts) \
                or tuple(down_ref.shape[-2:]) != shape.down:
            got_gu = (sum(rows), gate_up_parts[0][0].shape[-1])
            raise HfscaleError(f"expert {e} of layer {slot} on disk is {got_gu} / {tuple(down_ref.shape[-2:])}, the model "
                               f"wants {shape.gate_up} / {shape.down}; the weights do not match the config")
        if self.reader.kind == "mmap":  # mapped in place; Mixtral / Qwen-MoE gate and up are concatenated
            import torch

            parts = [self.reader.map(ref, i, self.dtype) for ref, i in gate_up_parts]
            gate_up = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            return gate_up, self.reader.map(down_ref, di, self.dtype)
        with self._spare_lock:
            buf = self._buffer(shape.expert_bytes)
        at, item = 0, shape.itemsize
        for (ref, i), r in zip(gate_up_parts, rows):
            n = r * shape.gate_up[1] * item
            self.reader.read(ref, i, self.dtype, out=buf[at:at + n])
            at += n
        self.reader.read(down_ref, di, self.dtype, out=buf[at:])
        gate_up = buf[:at].view(self.dtype).view(shape.gate_up)
        down = buf[at:].view(self.dtype).view(shape.down)
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
        self._spare.clear()
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


def _swap_in(model, experts: list[tuple[str, object]], off: ExpertOffload | None) -> None:
    cls = _module_class()
    for name, mod in experts:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        if off is None:  # placeholders while the resident weights load
            setattr(parent, attr, cls(_slot(name), mod.num_experts, mod.act_fn, None))
        else:
            setattr(parent, attr, cls(_slot(name), mod.num_experts, mod.act_fn, off.cache.get, off.cache.get_many,
                                       off.budget // off.expert_bytes))


def _attach(model, sources, shapes, experts, budget, reader, dtype, prefetch, cleanup=None,
            read_timeout_s=None) -> ExpertOffload:
    _check_budget(budget, shapes, top_k(model.config))
    off = ExpertOffload(model, sources, shapes, budget, reader, dtype, cleanup, read_timeout_s)
    _swap_in(model, experts, off)
    model.hfscale_experts = off
    off.set_prefetch(prefetch)
    weakref.finalize(model, off.close)
    return model


def from_pretrained(path, ram_budget, dtype=None, prefetch: bool = False, reader: str = "pread",
                    read_timeout_s: float | None = None):
    """A transformers MoE model from a local safetensors directory whose routed experts are never all in
    memory, not even while loading: the model is built with parameters on the meta device, every other
    tensor is read from the files, the experts stay in them and are read on demand into an LRU cache of
    at most `ram_budget` bytes (int, or a size such as "2GB"). `dtype` (default fp32) is the compute dtype.
    `read_timeout_s`: a read of one expert that takes longer raises HfscaleError instead of waiting on
    (None: wait as long as the storage takes)."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from ..models.builtin import load_config

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
    _swap_in(model, experts, None)  # drop the meta expert parameters before loading the rest
    _load_resident(model, path, tensors, expert_keys(list(sources.values())), layouts, dtype)
    model.eval()
    return _attach(model, sources, shapes, experts, budget, reader, dtype, prefetch, None, read_timeout_s)


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


def offload_(model, ram_budget, folder=None, prefetch: bool = False, reader: str = "pread", force: bool = False,
             read_timeout_s: float | None = None):
    """Move the routed experts of a model already in memory to safetensors files (one per MoE layer) in
    `folder` (default: a temporary folder removed by model.hfscale_experts.close() or at exit) and free
    them; they are read back on demand into an LRU cache of at most `ram_budget` bytes."""
    import shutil
    import tempfile

    import torch
    from safetensors.torch import save_file

    from ..util.atomic import check_writable, staged

    budget = parse_budget(ram_budget)
    experts = find_experts(model)
    dtype = experts[0][1].gate_up_proj.dtype
    shapes = {_slot(n): _shape(m, dtype) for n, m in experts}
    _check_budget(budget, shapes, top_k(model.config))
    cleanup = None
    if folder is None:
        from ..util.cache import cache_root

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
    return _attach(model, sources, shapes, experts, budget, reader, dtype, prefetch, cleanup, read_timeout_s)


def _write_experts(out: Path, experts, save_file, torch) -> None:
    for name, mod in experts:  # one layer at a time: the transient copy is one layer's experts
        with torch.no_grad():
            save_file({f"{name}.gate_up_proj": mod.gate_up_proj.detach().contiguous(),
                       f"{name}.down_proj": mod.down_proj.detach().contiguous()},
                      str(out / f"experts-{_slot(name):05d}.safetensors"))
