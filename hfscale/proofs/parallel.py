"""Prove sequence or tensor parallelism on the real engine, from inside the ranks, against the same model run
whole in the same process (the 1-process reference: same seed, same data, no distribution).

    accelerate launch --config_file sp2.yaml -m hfscale.proofs.parallel --out proof/ --mode sp --seq-len 256
    accelerate launch --config_file tp2.yaml -m hfscale.proofs.parallel --out proof/ --mode tp

sp (DeepSpeed Ulysses through accelerate's parallelism_config): each rank reports which tokens of each sequence
  it held, its logits against the reference's logits for those positions, the SP loss against the reference
  loss, every full gradient (DeepSpeed's safe_get_full_grad) against the reference's, the bytes its forward saved
  for backward against the reference's, and tokens/s of its training steps.
tp (transformers tp_plan="auto", DTensor): each rank reports, per planned weight, its local shape against the
  full one, and the full logits / loss / gradients against the unsharded model.
Both run the tiny Gemma 3 (4 heads, 2 KV heads, sliding window 64) in fp32 with sdpa attention.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from pathlib import Path


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m hfscale.proofs.parallel", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=["sp", "tp"], required=True)
    p.add_argument("--seq-len", type=int, default=256, help="longer than the tiny model's sliding window (64)")
    p.add_argument("--sequences", type=int, default=2, help="sequences in the global batch (sp: per rank, accumulated)")
    p.add_argument("--window-sdpa", action="store_true", help="sp: hfscale.scale.ulysses.use_window_sdpa before prepare")
    p.add_argument("--gemma4", action="store_true", help="sp: then the small Gemma 4 (hfscale.models.builtin.tiny_gemma4_config: "
                   "head shapes differ by layer) over the same SP group through hfscale.scale.ulysses.per_shape_attention")
    p.add_argument("--steps", type=int, default=1, help="optimizer steps timed for tokens/s (the first is compared)")
    p.add_argument("--precision", default="fp32", help="accepted for hfscale.proofs.engine.launch; the proof runs fp32")
    return p.parse_args(argv)


def _data(seq_len: int, n: int):
    from ..data.corpus import load_text, packed_blocks
    from ..models.builtin import load_tokenizer

    blocks = packed_blocks(load_tokenizer("tiny-gemma3"), load_text()["train"]["text"][:600], seq_len)
    if len(blocks) < n:
        raise SystemExit(f"the corpus gives {len(blocks)} blocks of {seq_len} tokens, fewer than {n}")
    return blocks[:n].clone()


def _model(config_fn=None):
    import torch
    from transformers import AutoModelForCausalLM

    from ..models.builtin import tiny_config

    cfg = (config_fn or tiny_config)()
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def _reference(model, ids):
    """Loss (mean over every next-token of every sequence), logits and gradients of the whole model, one process."""
    from ..plan.measure import SavedBytes

    with SavedBytes(model) as sb:
        out = model(input_ids=ids[:1], labels=ids[:1])
    saved_one = sb.total
    out.loss.backward()
    model.zero_grad(set_to_none=True)
    logits = []
    losses = []
    for i in range(len(ids)):
        out = model(input_ids=ids[i:i + 1], labels=ids[i:i + 1])
        (out.loss / len(ids)).backward()
        logits.append(out.logits.detach())
        losses.append(float(out.loss))
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return {"logits": logits, "losses": losses, "grads": grads, "saved_bytes_one_sequence": saved_one}


def run_sp(args) -> dict:
    import torch
    import torch.distributed as dist
    from deepspeed.utils import groups, safe_get_full_grad
    from torch.utils.data import DataLoader

    from ..scale.runtime import make_accelerator
    from ..scale.ulysses import sp_loss, use_window_sdpa, with_position_ids
    from ..plan.measure import SavedBytes

    ids = _data(args.seq_len, args.sequences)
    model = _model()
    ref = _reference(copy.deepcopy(model), ids)
    if args.gemma4:  # built before prepare: ZeRO-3's prepare makes later from_config calls partition their weights
        from ..models.builtin import tiny_gemma4_config

        g4 = _model(tiny_gemma4_config)
        g4_ref = _reference(copy.deepcopy(g4), ids)
    if args.window_sdpa:
        use_window_sdpa()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    sp_on = int(os.environ.get("PARALLELISM_CONFIG_SP_SIZE", "1")) > 1
    accum = args.sequences if sp_on else args.sequences // world  # each step: `sequences` whole sequences in all
    accelerator = make_accelerator(gradient_accumulation_steps=accum)
    rows = [with_position_ids({"input_ids": ids[i:i + 1], "labels": ids[i:i + 1]}) for i in range(len(ids))]
    loader = DataLoader([{k: v[0] for k, v in r.items()} for r in rows] * args.steps, batch_size=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the comparison is of step 1's gradients
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    engine = accelerator.deepspeed_engine_wrapped.engine
    group = groups._get_sequence_parallel_group() if sp_on else None
    sp, sp_rank = (dist.get_world_size(group), dist.get_rank(group)) if sp_on else (1, 0)
    report = {"mode": "sp" if sp_on else "dp", "world": dist.get_world_size(), "rank": dist.get_rank(), "sp": sp, "sp_rank": sp_rank,
              "accelerate_num_processes": accelerator.num_processes, "zero_stage": engine.zero_optimization_stage(),
              "seq_len": args.seq_len, "window_sdpa": args.window_sdpa, "sequences": []}
    model.train()
    t0, tokens, micro = None, 0, 0
    for batch in loader:
        local = batch["input_ids"][0]
        with SavedBytes(model) as sb:  # the forward and the loss: what backward will need
            if sp_on:
                shift_labels = batch.pop("shift_labels")
                out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
                loss = sp_loss(out.logits, shift_labels, group)
            else:
                out = model(**batch)
                loss = out.loss
        # what accelerator.backward does under DeepSpeed (set the boundary, backward, step at the boundary), split
        # so that step 1's gradients are read between backward and step
        boundary = (micro + 1) % accum == 0
        engine.set_gradient_accumulation_boundary(is_boundary=boundary)
        engine.backward(loss)
        if micro < accum:  # step 1: compare with the reference
            which = next(i for i in range(len(ids)) if torch.equal(ids[i][sp_rank * len(local):(sp_rank + 1) * len(local)], local))
            lo, hi = sp_rank * len(local), (sp_rank + 1) * len(local)
            diff = (out.logits.detach()[0] - ref["logits"][which][0, lo:hi]).abs().amax(-1)
            off = (diff > 1e-4).nonzero()
            report["sequences"].append({
                "sequence": which, "tokens_held": len(local), "positions": [lo, hi],
                "positions_match": batch["position_ids"][0].tolist() == list(range(lo, hi)),
                "logits_max_abs_diff": float(diff.max()), "first_differing_position": int(lo + off[0]) if len(off) else None,
                "loss": float(loss), "reference_loss": ref["losses"][which], "saved_bytes": sb.total,
            })
        micro += 1
        if micro % accum == 0:
            if micro == accum:
                worst, scale = 0.0, 0.0
                for n, p in accelerator.unwrap_model(model).named_parameters():
                    g = safe_get_full_grad(p)
                    worst = max(worst, float((g - ref["grads"][n]).abs().max()))
                    scale = max(scale, float(ref["grads"][n].abs().max()))
                report["grad_max_abs_diff"], report["grad_max_abs"] = worst, scale
                t0 = time.perf_counter()
            else:
                tokens += args.sequences * args.seq_len
            engine.step()
    if tokens:
        report["tokens_per_s"] = tokens / (time.perf_counter() - t0)  # whole sequences per rank-group second
    report["reference_saved_bytes_one_sequence"] = ref["saved_bytes_one_sequence"]
    accelerator.wait_for_everyone()
    if args.gemma4 and sp_on:
        report["gemma4"] = _gemma4_sp(g4, g4_ref, ids, group)
    return report


def _gemma4_sp(model, ref, ids, group) -> dict:
    """The small Gemma 4 under Ulysses on this launch's SP group, without an engine (DeepSpeed's SP groups exist
    once per process), model and reference made before prepare: transformers' "sdpa" becomes the window-aware
    sdpa under hfscale.scale.ulysses' per_shape_attention, which per_layer_heads installs at accelerator.prepare. Each rank runs its slice of
    every sequence; logits and loss are compared with the whole model's, and the gradients summed over the
    group (each rank's backward carries the group's loss through sp_loss's all-reduce, hence / sp) with its."""
    import torch
    import torch.distributed as dist
    from ..scale.ulysses import install_per_shape_attention, sp_loss, use_window_sdpa

    fn = install_per_shape_attention("sdpa", use_window_sdpa(), group, 1)
    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    S = ids.shape[1]
    lo, hi = rank * S // sp, (rank + 1) * S // sp
    out = {"positions": [lo, hi], "logits_max_abs_diff": 0.0, "losses": [], "reference_losses": ref["losses"]}
    model.train()
    for i in range(len(ids)):
        labels = torch.nn.functional.pad(ids[i:i + 1], (0, 1), value=-100)[:, 1:]
        pos = torch.arange(lo, hi).unsqueeze(0)
        o = model(input_ids=ids[i:i + 1, lo:hi], position_ids=pos)
        loss = sp_loss(o.logits, labels[:, lo:hi], group)
        (loss / len(ids)).backward()
        out["logits_max_abs_diff"] = max(out["logits_max_abs_diff"],
                                         float((o.logits.detach() - ref["logits"][i][:, lo:hi]).abs().max()))
        out["losses"].append(float(loss))
    worst, scale = 0.0, 0.0
    for n, p in model.named_parameters():
        g = p.grad.detach().clone()
        dist.all_reduce(g, group=group)
        worst = max(worst, float((g / sp - ref["grads"][n]).abs().max()))
        scale = max(scale, float(ref["grads"][n].abs().max()))
    out.update(grad_max_abs_diff=worst, grad_max_abs=scale,
               head_shapes=sorted(list(k) for k in fn.instances))  # (q heads, K/V heads, head size) per instance
    return out


def run_tp(args) -> dict:
    """transformers' own TP over all launched ranks. Not through accelerate: accelerate 1.16 refuses a
    parallelism_config under MULTI_CPU (hfscale.scale.runtime.make_accelerator says so in one line), so on a
    CPU host the ranks join a gloo process group themselves and transformers builds its DTensor mesh on it."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    if not dist.is_initialized():
        dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    tp = dist.get_world_size()
    ids = _data(args.seq_len, args.sequences)
    model = _model()
    ref = _reference(copy.deepcopy(model), ids)
    path = Path(args.out) / "tiny_sdpa"
    if dist.get_rank() == 0:
        model.save_pretrained(path, safe_serialization=True)
    dist.barrier()
    tpm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                               distributed_config=DistributedConfig(tp_plan="auto", tp_size=tp))
    shards = {}
    for n, p in tpm.named_parameters():
        if hasattr(p, "to_local"):
            shards[n] = {"local": list(p.to_local().shape), "full": list(p.shape), "placements": str(p.placements)}
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in tpm.parameters())
    logits_diff, losses = 0.0, []
    for i in range(len(ids)):
        out = tpm(input_ids=ids[i:i + 1], labels=ids[i:i + 1])
        (out.loss / len(ids)).backward()
        lg = out.logits.full_tensor() if hasattr(out.logits, "full_tensor") else out.logits
        logits_diff = max(logits_diff, float((lg.detach() - ref["logits"][i]).abs().max()))
        losses.append(float(out.loss))
    worst, scale, per = 0.0, 0.0, {}
    for n, p in tpm.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        per[n] = float((g - ref["grads"][n]).abs().max()) / max(float(ref["grads"][n].abs().max()), 1e-30)
        worst = max(worst, float((g - ref["grads"][n]).abs().max()))
        scale = max(scale, float(ref["grads"][n].abs().max()))
    return {"mode": "tp", "world": dist.get_world_size(), "rank": dist.get_rank(), "tp": tp, "shards": shards, "param_numel_local": local,
            "param_numel_full": sum(p.numel() for p in model.parameters()), "logits_max_abs_diff": logits_diff,
            "losses": losses, "reference_losses": ref["losses"], "grad_max_abs_diff": worst, "grad_max_abs": scale,
            "grad_rel_diff_by_param": per}


def main(argv=None) -> int:
    args = _parse(argv)
    report = run_sp(args) if args.mode == "sp" else run_tp(args)
    from ..util.atomic import write_text_atomic

    write_text_atomic(Path(args.out) / f"rank{report['rank']}.json", json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":  # a launched rank: its report is written; skip the teardown race (exit_rank)
    from hfscale.scale.runtime import exit_rank

    exit_rank(main())
