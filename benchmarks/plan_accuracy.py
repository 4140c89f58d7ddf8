"""How exact is `hfscale plan`? Writes benchmarks/results/plan_accuracy.{json,md}.

1. Activations: bytes saved for backward, measured on CPU with saved-tensors hooks (each storage once,
   parameters excluded) vs hfscale's prediction, for the tiny Gemma 3 and small Gemma 3 / Llama / Qwen2
   configs, eager and sdpa attention, fp32 and bf16, several shapes, checkpointing off / full / every:2.
2. Model states: per-rank elements the real 2-process DeepSpeed runs held
   (benchmarks/results/engine_proofs.json, from benchmarks/engine_proofs.py) vs hfscale's prediction.
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

from hfscale.atomic import write_text_atomic  # noqa: E402
from hfscale.models import build_model, load_config, tiny_config  # noqa: E402
from hfscale.plan.dims import dims_from_config  # noqa: E402
from hfscale.plan.measure import saved_activation_bytes  # noqa: E402
from hfscale.plan.memory import Strategy, activation_bytes, model_state_bytes  # noqa: E402
from test_plan import _set_checkpointing, _small  # noqa: E402


def activations() -> list[dict]:
    rows = []
    models = [("tiny-gemma3", "eager"), ("gemma3", "sdpa"), ("gemma3", "eager"), ("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa")]
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
    act, st, pe = activations(), states(), peers()
    worst = max(abs(r["error_pct"]) for r in act)
    summary = {"activation_rows": len(act), "activation_worst_error_pct": worst,
               "state_worst_error_pct": max(max(abs(r["param_error_pct"]), abs(r["moment_error_pct"])) for r in st)}
    out = ROOT / "benchmarks" / "results"
    write_text_atomic(out / "plan_accuracy.json", json.dumps({"summary": summary, "activations": act, "states": st, "peers": pe}, indent=1))
    write_text_atomic(out / "plan_accuracy.md", f"# plan accuracy\n\n{json.dumps(summary)}\n\n## activations\n\n{_md(act)}\n\n"
                      f"## model states vs 2-process DeepSpeed\n\n{_md(st)}\n\n## peers\n\n{_md(pe)}\n")
    print(json.dumps(summary))
    print(_md(st))
    print(_md(pe))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
