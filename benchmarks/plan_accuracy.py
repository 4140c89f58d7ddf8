"""How exact is `hfscale plan`? Writes benchmarks/results/plan_accuracy.{json,md}.

1. Activations: bytes saved for backward, measured on CPU with saved-tensors hooks (each storage once,
   parameters excluded) vs hfscale's prediction, for the tiny Gemma 3 and small Gemma 3 / Gemma 4 / Llama /
   Qwen2 configs, eager and sdpa attention, fp32 and bf16, several shapes, checkpointing off / full / every:2.
   Gemma 4: "gemma4" (per-layer inputs, shared K/V, double-wide MLP) and "gemma4moe" (k_eq_v, 288-wide global
   heads, MoE); "gemma3sw": Gemma 3 with a sliding window (40) shorter than most shapes.
2. Model states: per-rank elements the real 2-process DeepSpeed runs held
   (benchmarks/results/engine_proofs.json, from benchmarks/engine_proofs.py) vs hfscale's prediction;
   for the CPU-offload configs also where they live: the fp32 master / Adam moments / fp32 gradient partitions
   and (ZeRO-3) the 16-bit weight partition on the offload path vs hfscale's offloaded bytes, and the 16-bit
   weights left on the accelerator vs its GPU-resident states.
3. Peers on the same rows: accelerate `estimate-memory`'s training estimate and DeepSpeed's
   estimate_zero2/3_model_states_mem_needs for the Gemma 3 shapes, beside hfscale's model states.

    .venv/bin/python benchmarks/plan_accuracy.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from hfscale.util.atomic import write_text_atomic  # noqa: E402
from hfscale.models import build_model, load_config, tiny_config  # noqa: E402
from hfscale.models.dims import dims_from_config  # noqa: E402
from hfscale.plan.measure import saved_activation_bytes  # noqa: E402
from hfscale.plan.memory import Strategy, activation_bytes, model_state_bytes  # noqa: E402
from test_plan import _set_checkpointing, _small  # noqa: E402


def activations() -> list[dict]:
    rows = []
    models = [("tiny-gemma3", "eager"), ("gemma3", "sdpa"), ("gemma3", "eager"), ("gemma3sw", "sdpa"), ("gemma4", "sdpa"),
              ("gemma4", "eager"), ("gemma4moe", "sdpa"), ("gemma4moe", "eager"), ("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa")]
    for (family, attn) in tqdm(models, desc="activations"):
        for precision in ("fp32", "bf16"):
            m = build_model("tiny-gemma3") if family == "tiny-gemma3" else _small(family, attn)
            m = m.to(torch.bfloat16) if precision == "bf16" else m
            m.train()
            d = dims_from_config(m.config)
            for ckpt in ("off", "full", "every:2"):
                _set_checkpointing(m, ckpt)
                for B, S in ((1, 64), (2, 128), (4, 256)):
                    ids = torch.randint(4, d.vocab, (B, S))
                    meas = saved_activation_bytes(m, ids)
                    pred = activation_bytes(d, B, S, precision, ckpt, attn)["total"]
                    rows.append({"model": family, "attention": attn, "precision": precision, "checkpointing": ckpt,
                                 "batch": B, "seq": S, "measured_bytes": meas, "predicted_bytes": pred,
                                 "error_pct": round(100 * (pred - meas) / meas, 3)})
    return rows


def states() -> list[dict]:
    proofs = {r["config"]: r for r in json.loads((ROOT / "benchmarks/results/engine_proofs.json").read_text())}
    d = dims_from_config(tiny_config())
    rows = []
    for name, stage in (("ddp", 0), ("zero1", 1), ("zero2", 2), ("zero3", 3)):
        pred = model_state_bytes(d, Strategy(zero=stage, dp=2, micro_batch=1, seq_len=8))
        r = proofs[name]
        pred_params = pred["weights"] // 2
        pred_moment = (pred["optimizer"] - (4 * d.params // (2 if stage else 1))) // 8 if stage else d.params
        rows.append({"config": name, "param_elems_measured": r["param elems/rank"], "param_elems_predicted": pred_params,
                     "adam_moment_elems_measured": r["adam exp_avg elems/rank (memory)"], "adam_moment_elems_predicted": pred_moment,
                     "param_error_pct": round(100 * (pred_params - r["param elems/rank"]) / r["param elems/rank"], 3),
                     "moment_error_pct": round(100 * (pred_moment - r["adam exp_avg elems/rank (memory)"]) / r["adam exp_avg elems/rank (memory)"], 3)})
    return rows


def offload() -> list[dict]:
    """Where the model states of the CPU-offload configs live, per rank, in bytes: measured = elements the
    DeepSpeed ranks held x their dtype size (fp32 master, Adam exp_avg + exp_avg_sq, the fp32 gradient partition
    DeepSpeed keeps on the offload device; 16-bit weight partition where offload_param), predicted = hfscale's
    `offloaded` split; GPU-resident = the 16-bit weights not offloaded vs hfscale's weights + gradients +
    optimizer. On this CPU-only host the accelerator and the offload device are both `cpu`: which tensors are on
    the offload path is what the engine reports (its offload switches, DeepSpeedCPUAdam stepping them)."""
    proofs = {r["config"]: r for r in json.loads((ROOT / "benchmarks/results/engine_proofs.json").read_text())}
    d = dims_from_config(tiny_config())
    rows = []
    for name, stage in (("zero2_offload", 2), ("zero3_offload", 3)):
        r = proofs[name]
        if "fp32 master elems/rank" not in r:
            raise SystemExit(f"{name} in engine_proofs.json lacks the fp32 partitions; run "
                             f"benchmarks/engine_proofs.py --only zero2_offload,zero3_offload first")
        pred = model_state_bytes(d, Strategy(zero=stage, dp=2, micro_batch=1, seq_len=8, offload="cpu"))
        off_opt, off_param = (x == "True" for x in r["offload optimizer / param (engine)"].split("/"))
        m_opt = 4 * (r["fp32 master elems/rank"] + r["adam exp_avg elems/rank (memory)"] + r["adam exp_avg_sq elems/rank"]) if off_opt else 0
        m_grad = 4 * r["fp32 grad elems/rank (kept)"] if off_opt else 0
        m_w = 2 * r["param elems/rank"] if off_param else 0
        m_off = m_opt + m_grad + m_w
        m_res = 0 if off_param else 2 * r["param elems/rank"]
        p_res = pred["weights"] + pred["gradients"] + pred["optimizer"]
        rows.append({
            "config": name, "optimizer": r["optimizer"], "engine offload optimizer/param": r["offload optimizer / param (engine)"],
            "offloaded optimizer B (measured)": m_opt, "offloaded optimizer B (predicted)": pred["offloaded"]["optimizer"],
            "offloaded fp32 grads B (measured)": m_grad, "offloaded fp32 grads B (predicted)": pred["offloaded"]["gradients"],
            "offloaded 16-bit weights B (measured)": m_w, "offloaded 16-bit weights B (predicted)": pred["offloaded"]["weights"],
            "offloaded B/rank (measured)": m_off, "offloaded B/rank (predicted)": pred["offloaded_per_rank"],
            "offloaded error_pct": round(100 * (pred["offloaded_per_rank"] - m_off) / m_off, 3),
            "GPU-resident states B (measured)": m_res, "GPU-resident states B (predicted)": p_res,
            "resident error_pct": round(100 * (p_res - m_res) / m_res, 3) if m_res else (0.0 if p_res == 0 else None),
            "devices seen (params / fp32)": f"{r.get('param devices') or '-'} / {r['fp32 devices']}",
        })
    return rows


def peers() -> list[dict]:
    from accelerate.commands.estimate import estimate_training_usage
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    rows = []
    for name in ("gemma-3-1b", "gemma-3-4b", "gemma-3-12b", "gemma-3-27b"):
        d = dims_from_config(load_config(name))
        P, G = d.params, 8
        acc = estimate_training_usage(4 * P, "bfloat16")
        z2_cpu, z2_gpu = estimate_zero2_model_states_mem_needs(P, G, 1, cpu_offload=False)
        z3_cpu, z3_gpu, _ = estimate_zero3_model_states_mem_needs(P, d.largest_layer_params, G, 1, cpu_offload=False)
        h2 = model_state_bytes(d, Strategy(zero=2, dp=G, micro_batch=1, seq_len=8))
        h3 = model_state_bytes(d, Strategy(zero=3, dp=G, micro_batch=1, seq_len=8))
        rows.append({
            "model": name, "params": P,
            "accelerate estimate-memory (max component, 1 GPU) GB": round(max(acc.values()) / 1e9, 2),
            "accelerate sum of components GB": round(sum(acc.values()) / 1e9, 2),
            "DeepSpeed ZeRO-2 8 GPUs GB/GPU": round(z2_gpu / 1e9, 2),
            "hfscale ZeRO-2 8 GPUs states GB/GPU": round(sum(h2[k] for k in ("weights", "gradients", "optimizer")) / 1e9, 2),
            "DeepSpeed ZeRO-3 8 GPUs GB/GPU": round(z3_gpu / 1e9, 2),
            "hfscale ZeRO-3 8 GPUs states+live GB/GPU": round(sum(h3[k] for k in ("weights", "gradients", "optimizer", "zero3_live")) / 1e9, 2),
            "note": "peers count model states only; hfscale adds activations per micro batch (see hfscale plan)",
        })
    return rows


def _md(rows: list[dict]) -> str:
    keys = list(rows[0])
    return "\n".join(["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)] + ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows])


def main() -> int:
    act, st, off, pe = activations(), states(), offload(), peers()
    worst = max(abs(r["error_pct"]) for r in act)
    by_family: dict[str, float] = {}
    for r in act:
        by_family[r["model"]] = max(by_family.get(r["model"], 0.0), abs(r["error_pct"]))
    summary = {"activation_rows": len(act), "activation_worst_error_pct": worst, "activation_worst_error_pct_by_model": by_family,
               "state_worst_error_pct": max(max(abs(r["param_error_pct"]), abs(r["moment_error_pct"])) for r in st),
               "offload_worst_error_pct": max(max(abs(r["offloaded error_pct"]), abs(r["resident error_pct"] or 0)) for r in off)}
    out = ROOT / "benchmarks" / "results"
    write_text_atomic(out / "plan_accuracy.json", json.dumps({"summary": summary, "activations": act, "states": st, "offload": off,
                                                              "peers": pe}, indent=1))
    write_text_atomic(out / "plan_accuracy.md", f"# plan accuracy\n\n{json.dumps(summary)}\n\n## activations\n\n{_md(act)}\n\n"
                      f"## model states vs 2-process DeepSpeed\n\n{_md(st)}\n\n"
                      f"## CPU offload: where the states live (bytes per rank; accelerator and offload device are both "
                      f"`cpu` on this host, the engine's offload switches say which tensors are on the offload path)\n\n{_md(off)}\n\n"
                      f"## peers\n\n{_md(pe)}\n")
    print(json.dumps(summary))
    print(_md(st))
    print(_md(off))
    print(_md(pe))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
