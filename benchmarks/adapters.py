"""Issue 37's adapter benchmark: full fine-tuning, LoRA, DoRA and QLoRA side by side.

    nice -n 19 .venv/bin/python benchmarks/adapters.py            # -> benchmarks/results/adapters.{md,json}
    nice -n 19 .venv/bin/python benchmarks/adapters.py --part eval # one part only (memory | repredict | nf4 | eval)
    nice -n 19 .venv/bin/python benchmarks/adapters.py --part memory --only ZeRO-3/none,FSDP2/lora  # rerun rows
    nice -n 19 .venv/bin/python benchmarks/adapters.py --part eval --eval-steps 285 --eval-kinds none,lora  # one epoch

1. memory: per-rank steady peak (torch's MemTracker inside each rank: `hfscale profile --adapter KIND`, the library
   path hfscale.scale.adapters.apply_adapter + hfscale.proofs.profile) and tokens/s of each adapter kind under each
   engine (hfscale's shipped DDP / ZeRO-2 / ZeRO-3 / FSDP2 accelerate configs, 2 CPU processes over gloo), on a
   Gemma 3 of >= 100M parameters (config below), beside the plan's prediction for the same run: the traced step
   (`hfscale profile`'s own comparison, i.e. `plan.peak.step_prediction`) for full / LoRA / DoRA and for QLoRA under
   DDP / ZeRO-2 / ZeRO-3 (the LoRA trace with the NF4 base: bitsandbytes has no fake kernels); QLoRA under FSDP2 is
   refused by the recipe, the profile worker and the plan (a row measured before is kept for its memory, outside the
   target). Tokens/s are measured under
   the tracker (it slows every op alike) over the steps after the first.
2. nf4: the QLoRA base as bitsandbytes stores it (transformers' quantizer, blocksize 64, double quantization) on the
   same model against `plan.memory.nf4_base_bytes` and against the flat 0.5 B/weight of "4-bit".
3. eval: starting from the built-in tiny Gemma 3 pre-trained on the built-in corpus (hfscale/models/data/trained,
   `trained_tiny()`), each kind fine-tunes the same steps on the built-in chat set's training conversations (rendered
   with the chat template, packed into blocks) at each lr of a small grid (LR_GRID, every kind, full included); per
   kind the lr with the lowest loss on a selection split carved from the training conversations (every 10th, never
   trained on) is selected, and its loss on the held-out validation conversations is reported. Every run is kept.
   The tiny model (not the >= 100M one) because this host trains it in minutes. Each loss is also split by the kind
   of the predicted token (the tokens the chat template writes vs the contents, hfscale.data.formats.template_mask):
   most of full fine-tuning's improvement is learning the template, which LoRA on the linears learns less of; the
   kind "LoRA + template tokens" trains those embedding rows too (AdapterSpec trainable_tokens "template"), the kind
   "LoRA + embedding (tied)" a low-rank adapter on the tied embedding and lm_head (AdapterSpec embedding).
   The protocol as first run is 60 steps (results["eval"]); `--eval-steps 285` (one epoch's worth of draws of the
   training blocks) is kept beside it (results["eval_285"]) and reported after it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results"
ENGINES = {"DDP": "ddp", "ZeRO-2": "zero2", "ZeRO-3": "zero3", "FSDP2": "fsdp2"}
KINDS = ("none", "lora", "dora", "qlora")
NAMES = {"none": "full", "lora": "LoRA", "dora": "DoRA", "qlora": "QLoRA", "lora+": "LoRA+ (B's lr x16)",
         "rslora": "rsLoRA (alpha / sqrt r)", "lora_tpl": "LoRA + template tokens",
         "lora+_tpl": "LoRA+ + template tokens", "lora_r64": "LoRA r64 (alpha 2r)",
         "lora_emb": "LoRA + embedding (tied)"}
# the eval part also sweeps the LoRA variants peers offer, not the recipe's default, so the target row names plain
# LoRA beside them: LoRA+ (AdapterSpec's lora_plus_ratio, the paper's 16) and rslora at the same rank and alpha; LoRA
# (and LoRA+) with the rows of the tokens the chat template writes trained (AdapterSpec trainable_tokens "template",
# peft's trainable_token_indices, the tied lm_head kept tied: the base never saw the template, see the table per token
# kind); rank 64 at the same alpha / r
# LoRA on the tied embedding too (AdapterSpec embedding: a low-rank move of every token's row, the lm_head's with it)
EVAL_KINDS = KINDS + ("lora+", "rslora", "lora_tpl", "lora+_tpl", "lora_r64", "lora_emb")
# a Gemma 3 of 101.6M parameters (12 layers of 768, vocab 32,768): >= 100M as the issue asks, small enough that a
# 2-process fp32 step of 64 tokens runs in seconds on 2 shared cores
MODEL_CONFIG = dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], vocab_size=32768, hidden_size=768,
                    intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                    head_dim=64, query_pre_attn_scalar=64, sliding_window=512, max_position_embeddings=2048,
                    layer_types=["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 5 + ["full_attention"],
                    tie_word_embeddings=True)
RANK, SEQ, MICRO, STEPS = 16, 64, 1, 3


def host() -> str:
    import torch

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    return (f"{cpu}, {os.cpu_count()} cores (shared with other jobs), torch {torch.__version__} CPU capability "
            f"{torch.backends.cpu.get_cpu_capability()}")


def ran_here() -> str:
    """Where and when a part or row ran: the host, the UTC minute and the 1-min load average (the one home of that line)."""
    return f"{host()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {os.getloadavg()[0]:.1f}"


def model_dir(work: Path) -> Path:
    """The >= 100M model as a weights directory (seeded random init, safetensors): every rank and loader reads it."""
    d = work / "gemma3-101m"
    if not (d / "model.safetensors").is_file():
        import torch
        from transformers import AutoModelForCausalLM, Gemma3TextConfig

        torch.manual_seed(0)
        cfg = Gemma3TextConfig(**{k: v for k, v in MODEL_CONFIG.items() if k not in ("model_type", "architectures")})
        AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    return d


def memory(work: Path, results: dict, only=None) -> None:
    from hfscale.plan.api import plan

    model = str(model_dir(work))
    rows = results.setdefault("memory", {})
    for engine, cfg in ENGINES.items():
        for kind in KINDS:
            key = f"{engine}/{kind}"
            if (key not in only) if only else (key in rows and "error" not in rows[key]):
                continue
            out = work / f"prof-{cfg}-{kind}"
            t0 = time.time()
            r = subprocess.run([str(Path(sys.executable).parent / "hfscale"), "profile", "--config",
                                str(ROOT / "accelerate_configs" / f"{cfg}.yaml"), "--num-processes", "2", "--model", model,
                                "--adapter", kind, "--lora-rank", str(RANK), "--steps", str(STEPS), "--seq-len", str(SEQ),
                                "--micro-batch", str(MICRO), "--precision", "fp32", "--out", str(out), "--force", "--json"],
                               capture_output=True, text=True, timeout=900)
            row = {"engine": engine, "kind": kind, "seconds": round(time.time() - t0, 1),
                   "ran": ran_here()}
            if r.returncode != 0:
                err = [ln for ln in r.stderr.splitlines() if ln.strip() and "Warning" not in ln]
                row["error"] = (err[-1] if err else f"exit {r.returncode}")[:300]
            else:
                ranks = json.loads(r.stdout)
                row["measured"] = [x["measured"]["peak"] for x in ranks]
                secs = [s for x in ranks for s in x.get("step_seconds", [])[1:]]
                row["tokens_per_s"] = round(2 * MICRO * SEQ / (sum(secs) / len(secs)), 1) if secs else None
                if all("compared_peak" in x for x in ranks):
                    row["predicted"] = [x["compared_peak"] for x in ranks]
                    row["predicted_by"] = "traced step"
                else:  # QLoRA: the plan's analytic terms for the same strategy
                    zero, eng = {"DDP": (0, "auto"), "ZeRO-2": (2, "auto"), "ZeRO-3": (3, "auto"), "FSDP2": (0, "fsdp2")}[engine]
                    p = plan(model, SEQ, MICRO, zero=zero, dp=2, precision="fp32", engine=eng, adapter=kind,
                             lora_rank=RANK).prediction
                    row["predicted"] = [p.peak if p.source == "trace" else p.terms_total] * len(ranks)
                    row["predicted_by"] = "traced step" if p.source == "trace" else "analytic terms"
                row["error_pct"] = [round(100 * (p / m - 1), 2) for p, m in zip(row["predicted"], row["measured"])]
            rows[key] = row
            print(key, row, flush=True)
            save(results)


def repredict(work: Path, results: dict) -> None:
    """The plan's prediction of every measured row again with the code as it is now (the same call `hfscale profile`
    makes, per rank: plan.peak.step_prediction), so rows measured while the planner changed (QLoRA traced, ZeRO-3's
    gathered frozen base) are compared with one planner; rows it refuses (QLoRA under ZeRO-3 / FSDP2) keep the
    analytic terms."""
    from hfscale.models.builtin import load_config
    from hfscale.plan.peak import step_prediction
    from hfscale.util.errors import HfscaleError

    from hfscale.scale.adapters import engine_refusal

    config = load_config(str(model_dir(work)))
    for key, row in results.get("memory", {}).items():
        if "measured" not in row:
            continue
        zero, eng = {"DDP": (0, "ddp"), "ZeRO-2": (2, "deepspeed"), "ZeRO-3": (3, "deepspeed"), "FSDP2": (0, "fsdp2")}[row["engine"]]
        kind = row["kind"]
        refused = engine_refusal(kind, zero if eng == "deepspeed" else None, eng == "fsdp2")
        if refused is not None:  # a run hfscale refuses has no plan to compare (and is not in the target)
            for k in ("predicted", "predicted_by", "error_pct"):
                row.pop(k, None)
            row["refused"] = refused[0]
            continue
        try:
            pred = [step_prediction(config, MICRO, SEQ, "fp32", zero=zero, dp=2, engine=eng,
                                    lora_rank=0 if kind == "none" else RANK, adapter="lora" if kind == "none" else kind,
                                    rank=r)["peak"] for r in range(len(row["measured"]))]
        except HfscaleError:
            continue
        row.update(predicted=pred, predicted_by="traced step",
                   error_pct=[round(100 * (p / m - 1), 2) for p, m in zip(pred, row["measured"])])
        print("repredicted", key, row, flush=True)
    save(results)


def nf4(work: Path, results: dict) -> None:
    import torch

    from hfscale.models.dims import dims_from_config
    from hfscale.plan.memory import decoder_linears, nf4_base_bytes
    from hfscale.scale.adapters import load_quantized_base, nf4_bytes

    model = str(model_dir(work))
    m = load_quantized_base(model, torch.bfloat16, torch.uint8, scratch=work / "nf4-base")
    d = dims_from_config(m.config)
    planned = nf4_base_bytes(d)
    flat = sum(i * o for _, i, o in decoder_linears(d)) // 2
    real = nf4_bytes(m)
    results["nf4"] = {"measured": real, "planned": planned["nf4"], "flat_half_byte": flat,
                      "quantized_params": planned["nf4_params"], "error_pct": round(100 * (planned["nf4"] / real - 1), 4),
                      "flat_error_pct": round(100 * (flat / real - 1), 2),
                      "other_measured": sum(p.numel() * p.element_size() for p in m.parameters()
                                            if getattr(p, "quant_state", None) is None),
                      "other_planned": planned["other"]}
    print("nf4", results["nf4"], flush=True)
    save(results)


SELECT_EVERY = 10  # every 10th training conversation is the selection split (lr chosen there, never on held-out)
# a small lr grid per kind around its usual setting (full fine-tuning ~1e-4..1e-3; LoRA-family ~10x higher: the LoRA
# paper and peft / TRL examples); the selected lr has the lowest selection-split loss; when it is the grid's largest,
# one more point 3x above is run (once), so no kind is held at the edge of its grid. DoRA and QLoRA get two points
# (bounded run time: ~5 min per run on the loaded 2-core host); LoRA, the target's kind, and full three
LR_GRID = {"none": (1e-4, 3e-4, 1e-3), "lora": (1e-3, 3e-3, 1e-2), "dora": (3e-3, 1e-2), "qlora": (3e-3, 1e-2),
           "lora+": (3e-4, 1e-3, 3e-3), "rslora": (1e-3, 3e-3), "lora_tpl": (3e-3, 1e-2), "lora+_tpl": (3e-4, 1e-3, 3e-3),
           "lora_r64": (1e-3, 3e-3, 1e-2), "lora_emb": (1e-3, 3e-3, 1e-2)}
EVAL_SPECS = {"lora+": {"lora_plus_ratio": 16.0}, "rslora": {"rslora": True}, "lora_tpl": {"trainable_tokens": "template"},
              "lora+_tpl": {"lora_plus_ratio": 16.0, "trainable_tokens": "template"}, "lora_r64": {"rank": 64},
              "lora_emb": {"embedding": True}}


def eval_spec(kind: str, template_ids=()):
    """The AdapterSpec an eval kind trains (EVAL_KINDS); "template" tokens resolved to `template_ids`."""
    from hfscale.scale.adapters import AdapterSpec

    extra = {"rank": RANK, **EVAL_SPECS.get(kind, {})}
    return AdapterSpec("lora" if kind in EVAL_SPECS else kind, **extra).with_tokens(template_ids)


def chat_splits(tok, seq_len: int) -> dict:
    """{train, select, heldout}: packed blocks of the built-in chat set's training conversations less every
    SELECT_EVERY-th (train), those (select: where the lr is chosen), and its validation conversations (heldout:
    reported only). Each split is packed on its own, so no block mixes two splits. {select, heldout}_template: per
    token, whether the chat template wrote it (hfscale.data.formats.template_mask; the packing's BOS / EOS count as
    template), for the losses per token kind."""
    import gzip

    import torch

    from hfscale.data.corpus import packed_blocks
    from hfscale.data.formats import template_mask
    from hfscale.data.sources import BUILTIN_CHAT, builtin_files
    from hfscale.models.builtin import builtin_chat_template

    template = builtin_chat_template()
    rows = {split: [json.loads(x)["messages"] for x in gzip.open(path, "rt")]
            for split, path in builtin_files(BUILTIN_CHAT).items()}
    convs = {"train": [c for i, c in enumerate(rows["train"]) if i % SELECT_EVERY != SELECT_EVERY - 1],
             "select": rows["train"][SELECT_EVERY - 1::SELECT_EVERY], "heldout": rows["validation"]}
    out = {}
    for split, cs in convs.items():
        out[split] = packed_blocks(tok, [tok.apply_chat_template(c, tokenize=False, chat_template=template) for c in cs],
                                   seq_len)
        if split == "train":
            continue
        enc = [template_mask(tok, c, template) for c in cs]
        n = out[split].numel()  # packed_blocks: each conversation BOS ... EOS, concatenated, cut into blocks
        ids = [t for i, _ in enc for t in [tok.bos_token_id, *i, tok.eos_token_id]][:n]
        assert ids == out[split].flatten().tolist(), "template_mask tokenized other ids than packed_blocks"
        out[f"{split}_template"] = torch.tensor([m for _, ms in enc for m in [True, *ms, True]][:n]).view_as(out[split])
    return out


# where the 60-step runs made before each run recorded its time ran (as the report stated them then)
EVAL_HOSTS_BEFORE_AT = {"eval": "AMD EPYC, 2 cores (shared with other jobs), torch 2.13.0+cpu CPU capability AVX512: full, "
                        "LoRA, DoRA, QLoRA, LoRA+, rsLoRA 2026-12-07 11:53-12:57 UTC, load 2.2-8.3; the template-token "
                        "and r64 kinds and the per-token-kind reruns of full 1e-3 / 3e-3 and LoRA 1e-2 (their select / "
                        "held-out losses equal the stored runs') 14:56-15:57 UTC, load 1.3-11.3 (a run took 7-1,158 s as "
                        "the other jobs came and went)"}
EVAL_STEPS = 60  # the first protocol (results["eval"]); another step count is kept beside it (eval_key)


def eval_key(steps: int) -> str:
    """Where the eval part of `steps` steps lives in the results: "eval" for the 60-step protocol as first run,
    "eval_285" (one epoch's worth of draws) etc. beside it."""
    return "eval" if steps == EVAL_STEPS else f"eval_{steps}"


def eval_keys(results: dict) -> list:
    """The eval protocols in the results, the 60-step one first, then by step count."""
    return sorted((k for k in results if k == "eval" or k.startswith("eval_")), key=lambda k: results[k]["steps"])


def evaluate(work: Path, results: dict, steps: int, grid: dict, kinds=EVAL_KINDS) -> None:
    """Every (kind, lr) of `grid` trained the same steps on the same data order; per kind the lr with the lowest
    selection-split loss is selected and its held-out loss reported (all runs are kept in
    results[eval_key(steps)]["runs"]). Runs already in the results with the same steps are not rerun."""
    import torch

    from hfscale.data.formats import template_token_ids
    from hfscale.models.builtin import TINY, build_model, builtin_chat_template, load_tokenizer
    from hfscale.models.loss import lm_loss, token_nll
    from hfscale.scale.adapters import adapter_param_groups, apply_adapter, load_quantized_base
    from hfscale.testing.trained import trained_tiny

    base_dir = trained_tiny(progress=False)
    tok = load_tokenizer(TINY)
    seq, batch = 128, 8
    data = chat_splits(tok, seq)
    train = data["train"]
    template_ids = template_token_ids(tok, builtin_chat_template())

    def losses(model):
        model.eval()
        out = {}
        with torch.no_grad():
            for split in ("select", "heldout"):
                blocks, kinds = data[split], data[f"{split}_template"]
                vals, sums = [], {"template": [0.0, 0], "content": [0.0, 0]}
                for i in range(0, len(blocks), 16):  # the split's loss: the mean of 16-block means (lm_loss's, as before)
                    ids, tm = blocks[i:i + 16], kinds[i:i + 16]
                    logits = model(input_ids=ids).logits
                    nll, n = token_nll(logits, ids)
                    vals.append(nll.item() / int(n))
                    for name, keep in (("template", tm), ("content", ~tm)):  # token-weighted, per kind of next token
                        nll, n = token_nll(logits, torch.where(keep, ids, -100))
                        sums[name][0] += nll.item()
                        sums[name][1] += int(n)
                out[split] = round(sum(vals) / len(vals), 4)
                out[f"{split}_by_kind"] = {k: round(v[0] / v[1], 4) for k, v in sums.items()}
                out[f"{split}_tokens"] = {k: v[1] for k, v in sums.items()}
        return out

    key = eval_key(steps)
    old = results.get(key, {})
    e = {"steps": steps, "batch": batch, "seq_len": seq, "train_blocks": len(train), "select_blocks": len(data["select"]),
         "heldout_blocks": len(data["heldout"]), "select_every": SELECT_EVERY, "template_tokens": list(template_ids),
         "grid": {k: list(v) for k, v in grid.items()}, "rows": {},
         "runs": old.get("runs", {}) if old.get("steps") == steps and "select_blocks" in old else {}}
    if e["runs"]:  # kinds not swept now keep the grid they ran (with its extension)
        e["grid"].update({k: v for k, v in old.get("grid", {}).items() if k not in kinds})
    results[key] = e

    def run(kind: str, lr: float, start: dict | None) -> dict:
        spec = eval_spec(kind, template_ids)
        torch.manual_seed(0)
        model = (load_quantized_base(str(base_dir), torch.float32, torch.uint8, scratch=work / "tiny-nf4")
                 if spec.base_bits == 4 else build_model(str(base_dir), dtype=torch.float32))
        start = start or losses(model)
        model = apply_adapter(model, spec)
        groups = adapter_param_groups(model, spec, lr) if spec.enabled else \
            [{"params": [p for p in model.parameters() if p.requires_grad], "lr": lr}]
        opt = torch.optim.AdamW(groups, weight_decay=0.0)
        g = torch.Generator().manual_seed(1)  # the same data order for every kind and lr
        model.train()
        t0 = time.time()
        for _ in range(steps):
            idx = torch.randint(0, len(train), (batch,), generator=g)
            loss = lm_loss(model, train[idx])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        secs = time.time() - t0
        return {"kind": kind, "lr": lr, "start": start, "end": losses(model), "seconds": round(secs, 1),
                "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad), "load": os.getloadavg()[0],
                "at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}

    for kind in kinds:
        lrs = list(grid[kind])
        up = down = False  # each edge of the grid extended once at most
        while True:
            for lr in lrs:
                run_key = f"{kind}@{lr:g}"
                if run_key not in e["runs"]:
                    start = next((r["start"] for r in e["runs"].values() if r["kind"] == kind), None)
                    e["runs"][run_key] = run(kind, lr, start)
                    print("eval", run_key, e["runs"][run_key], flush=True)
                    save(results)
            best = min((e["runs"][f"{kind}@{lr:g}"] for lr in lrs), key=lambda r: r["end"]["select"])["lr"]
            if best == max(lrs) and not up:  # the best was the grid's largest: one more point 3x above it
                lrs, up = lrs + [3 * max(lrs)], True
            elif best == min(lrs) and not down:  # the smallest: one 3x below (one significant digit: 1e-4 -> 3e-5)
                lrs, down = [float(f"{min(lrs) / 3:.1g}")] + lrs, True
            else:
                break
        e["grid"][kind] = lrs
        save(results)  # the kind's grid as run (its extensions) before the next kind's first run
    select_rows(e)
    save(results)


def select_rows(e: dict) -> None:
    """Per kind, the run of the lowest selection-split loss among those run (`complete`: its whole grid ran), and its
    held-out improvement against full fine-tuning's selected run."""
    e["rows"] = {}
    for kind in EVAL_KINDS:
        runs = [r for r in e["runs"].values() if r["kind"] == kind]
        if not runs:
            continue
        best = min(runs, key=lambda r: r["end"]["select"])
        e["rows"][kind] = {"lr": best["lr"], "trainable": best["trainable"], "start": best["start"]["heldout"],
                           "end": best["end"]["heldout"], "seconds": best["seconds"],
                           "improvement": round(best["start"]["heldout"] - best["end"]["heldout"], 4),
                           "complete": all(f"{kind}@{lr:g}" in e["runs"] for lr in e["grid"][kind])}
        if "heldout_by_kind" in best["end"]:  # measured since the per-token-kind split
            e["rows"][kind]["by_kind"] = {k: [best["start"]["heldout_by_kind"][k], v]
                                          for k, v in best["end"]["heldout_by_kind"].items()}
            e["rows"][kind]["tokens"] = best["end"]["heldout_tokens"]
    if "none" in e["rows"]:
        full = e["rows"]["none"]["improvement"]
        for r in e["rows"].values():
            r["of_full"] = round(r["improvement"] / full, 3)
        e["base_loss"] = e["rows"]["none"]["start"]


RESULTS = OUT / "adapters.json"


def save(results: dict) -> None:
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")


def epoch_steps(e: dict) -> int:
    """The steps of one epoch's worth of draws: the training blocks over the batch, rounded up (2,277 / 8 -> 285)."""
    return -(-e["train_blocks"] // e["batch"])


def protocol(e: dict) -> str:
    return f"one epoch ({e['steps']} steps)" if e["steps"] == epoch_steps(e) else f"{e['steps']} steps"


def eval_section(e: dict) -> list:
    """The eval part's tables for one protocol (results["eval"] or results[eval_key(steps)])."""
    epoch = e["steps"] == epoch_steps(e)
    grid = {k: v for k, v in e["grid"].items() if k in e["rows"]}  # the kinds this protocol ran
    if epoch:
        note = (f"This protocol was added after the {EVAL_STEPS}-step result above was known (plain LoRA below 80% "
                f"there): {EVAL_STEPS} steps are {100 * EVAL_STEPS * e['batch'] / e['train_blocks']:.0f}% of one "
                "pass over the training blocks, an arbitrary point, and a supervised fine-tune is counted in epochs. "
                f"{e['steps']} steps x {e['batch']} = {e['steps'] * e['batch']:,} draws, uniform with replacement as "
                f"in the {EVAL_STEPS}-step protocol (the sampling is unchanged, only the steps): one epoch's worth of "
                "samples, not every block once (about 1 - 1/e = 63% of the blocks are drawn at least once). Fewer "
                "kinds than above. Seconds: the training steps under the load beside each run in the sweep table, on "
                "a host shared with other jobs, not a speed comparison.")
    else:
        note = ("Before the sweep this table held one lr per kind (full 3e-4, the others 3e-3, "
                "trained on every training conversation): LoRA 79.2% of full; full's 3e-4 is its grid's second best "
                "here (1.4154 against 1.6581 at 1e-3), so with each kind's lr chosen alike the gap is wider. Seconds: "
                "the training steps under the load beside each run in the sweep table (the other jobs came and "
                "went: 7 to 390 s for the same work), not a speed comparison.")
    lines = [f"## Eval loss on held-out chat data after {protocol(e) if epoch else 'the same steps'}", "",
             f"The built-in tiny Gemma 3 pre-trained on the built-in corpus (hfscale/models/data/trained) fine-tuned "
             f"{e['steps']} steps of {e['batch']} x {e['seq_len']} tokens on the built-in chat set's training "
             f"conversations less every {e['select_every']}th ({e['train_blocks']} blocks), same data order for "
             "every kind and lr, AdamW without decay, constant lr, rank "
             f"{RANK} (alpha 2r) on q/k/v/o/gate/up/down. The lr: a grid per kind, every kind, full included ("
             + "; ".join(f"{NAMES[k]} {', '.join(f'{x:g}' for x in v)}" for k, v in grid.items())
             + "; a point 3x above the largest is added when the largest won"
             + (", one 3x below the smallest when the smallest won: a rule added with this protocol, lr optima can "
                "move lower with more steps; no kind of the 60-step protocol selected its smallest point"
                if epoch else "") + "), the one with the lowest loss on "
             "the selection split (every "
             f"{e['select_every']}th training conversation, {e['select_blocks']} blocks, never trained on) "
             f"selected; reported: its loss on all {e['heldout_blocks']} blocks of the held-out validation "
             "conversations, which chose nothing. QLoRA starts from its own NF4 base (its start loss is the "
             "quantized model's). " + note, "",
             "| kind | selected lr | trainable | start loss | end loss | improvement | of full's | seconds |",
             "|---|---|---|---|---|---|---|---|"]
    for kind, r in e["rows"].items():
        lines.append(f"| {NAMES[kind]} | {r['lr']:g}{'' if r.get('complete', True) else ' (grid not finished)'} | "
                     f"{r['trainable']:,} | {r['start']:.4f} | {r['end']:.4f} | "
                     f"{r['improvement']:.4f} | {100 * r['of_full']:.1f}% | {r['seconds']} |")
    edge = [f"{NAMES[k]} ({r['lr']:g})" for k, r in e["rows"].items()
            if len(e["grid"][k]) > len(LR_GRID[k]) and r["lr"] in (min(e["grid"][k]), max(e["grid"][k]))]
    if edge:
        lines += ["", f"Selected at an end of its grid after the one extension there: {', '.join(edge)}; no point "
                  "beyond it was run."]
    full = [r for r in e["runs"].values() if r["kind"] == "none"]
    best = max(full, key=lambda r: r["start"]["heldout"] - r["end"]["heldout"]) if full else None
    if best and "none" in e["rows"] and best["lr"] != e["rows"]["none"]["lr"]:  # selection and held-out disagree
        gain = best["start"]["heldout"] - best["end"]["heldout"]
        lines += ["", f"Full fine-tuning's selected lr is not its best on the held-out data: {best['lr']:g} improves "
                  f"it {gain:.4f} (against {e['rows']['none']['improvement']:.4f}); against that run "
                  + "; ".join(f"{NAMES[k]} {100 * r['improvement'] / gain:.1f}%" for k, r in e["rows"].items()
                              if k != "none") + " (held-out choosing nothing: shown, not used)."]
    split = {k: r for k, r in e["rows"].items() if "by_kind" in r}
    if split:
        tpl = e.get("template_tokens", [])
        lines += ["", "Where the improvement comes from: the held-out loss per kind of predicted token, the tokens the "
                  f"chat template writes ({len(tpl)} ids: the pieces of `<start_of_turn>`, `<end_of_turn>`, the role "
                  "names, newline, BOS; hfscale.data.formats.template_mask, the packing's BOS / EOS counted with them) "
                  "and the contents. The built-in tokenizer has no ids for the turn markers: each is 7 ordinary "
                  "pieces, and every one of those ids occurs in the pre-training corpus (`turn` twice, `start` 48 "
                  "times), so no embedding row is untrained, but the corpus never shows the template's sequences. "
                  "Share: the template tokens' part of the token-weighted improvement.", "",
                  "| kind | template tokens: start / end | content: start / end | template share of the "
                  "improvement |", "|---|---|---|---|"]
        for kind, r in split.items():
            (t0, t1), (c0, c1), n = r["by_kind"]["template"], r["by_kind"]["content"], r["tokens"]
            dt, dc = n["template"] * (t0 - t1), n["content"] * (c0 - c1)
            lines.append(f"| {NAMES[kind]} | {t0:.4f} / {t1:.4f} | {c0:.4f} / {c1:.4f} | "
                         f"{100 * dt / (dt + dc):.0f}% |")
        if "none" in split and "lora" in split:  # full's lead over plain LoRA, token-weighted, by kind
            gap = {k: split["none"]["tokens"][k] * (split["lora"]["by_kind"][k][1] - split["none"]["by_kind"][k][1])
                   for k in ("template", "content")}
            lines += ["", f"Of full fine-tuning's lead over plain LoRA, {100 * gap['template'] / sum(gap.values()):.0f}% "
                      "is on the template's tokens (whose embedding rows, tied to the lm_head, LoRA on the linears "
                      "leaves as pre-training made them) and the rest on the contents."]
    lines += ["", "Every run of the sweep (selection-split loss chose the lr; held-out shown for all, used for none; "
              "seconds on a loaded 2-core host, 1-min load average beside each):", "",
              "| kind | lr | select: start / end | held-out: start / end | held-out improvement | selected | "
              "seconds (load) |", "|---|---|---|---|---|---|---|"]
    for r in e["runs"].values():
        chosen = e["rows"].get(r["kind"], {}).get("lr") == r["lr"]
        lines.append(f"| {NAMES[r['kind']]} | {r['lr']:g} | {r['start']['select']:.4f} / {r['end']['select']:.4f} | "
                     f"{r['start']['heldout']:.4f} / {r['end']['heldout']:.4f} | "
                     f"{r['start']['heldout'] - r['end']['heldout']:.4f} | {'yes' if chosen else ''} | "
                     f"{r['seconds']} ({r['load']:.1f}) |")
    lines.append("")
    return lines


def report(results: dict) -> str:
    gib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    lines = ["# Adapters: full fine-tuning, LoRA, DoRA, QLoRA (issue 37)", "",
             "Every run here in fp32. Run: `nice -n 10 .venv/bin/python benchmarks/adapters.py` (parts run "
             f"separately, last write {results.get('date', '')}). Hosts, per part as last run:", "",
             *(f"- {part}: {h}" for part, h in sorted(results.get("hosts", {"all": results["host"]}).items())), ""]
    mem = results.get("memory", {})
    lines += ["## Targets (issue 37)", "", "| target | result | met |", "|---|---|---|"]
    done = [r for r in mem.values() if "measured" in r and "refused" not in r]
    refused = [f"{r['engine']} {NAMES[r['kind']]}" for r in mem.values() if "refused" in r]
    if done:
        worst = max(done, key=lambda r: max(abs(e) for e in r["error_pct"]))
        bad = [f"{r['engine']} {NAMES[r['kind']]}" for r in done if max(abs(e) for e in r["error_pct"]) > 3]
        lines.append(f"| plan within +-3% of every measured peak | {len(done) - len(bad)} of {len(done)} runs within; worst "
                     f"{worst['engine']} {NAMES[worst['kind']]} {max(worst['error_pct'], key=abs):+.2f}%"
                     f"{'; outside: ' + ', '.join(bad) if bad else ''}"
                     f"{'; not in the target: ' + ', '.join(refused) + ' (the recipe refuses it: no run to plan)' if refused else ''}"
                     f" | {'yes' if not bad else 'no'} |")
    ddp_full, ddp_lora = mem.get("DDP/none", {}).get("measured"), mem.get("DDP/lora", {}).get("measured")
    if ddp_full and ddp_lora:
        x = max(ddp_lora) / max(ddp_full)
        lines.append(f"| LoRA's per-rank peak <= 0.5x full under DDP | {x:.3f}x | {'yes' if x <= 0.5 else 'no'} |")
    n = results.get("nf4")
    if n:
        lines.append(f"| QLoRA's 4-bit base within 5% of its analytic NF4 size | {n['error_pct']:+.4f}% | "
                     f"{'yes' if abs(n['error_pct']) <= 5 else 'no'} |")
    done_eval = [results[k] for k in eval_keys(results) if "of_full" in results[k].get("rows", {}).get("lora", {})]
    if done_eval:  # one line per protocol, the 60-step one first
        res, met = [], []
        for ev in done_eval:
            e = ev["rows"]
            variants = [k for k in EVAL_KINDS[len(KINDS):] if k in e]
            yes = [NAMES[k] for k in variants if e[k]["of_full"] >= 0.8]
            pct = lambda k: f"{100 * e[k]['of_full']:.1f}%" + ("" if e[k]["complete"] else " (grid not finished)")  # noqa: E731
            res.append(f"{protocol(ev)}: plain LoRA {pct('lora')} ("
                       + "; ".join(f"{NAMES[k]} {pct(k)}" for k in variants) + ")")
            met.append(f"{protocol(ev)}: " + ("yes" if e["lora"]["of_full"] >= 0.8 else "plain LoRA: no" + (
                f"; {', '.join(yes)}: yes" if yes else "")))
        lines.append("| LoRA >= 80% of full fine-tuning's eval-loss improvement | each kind's lr selected on a split of "
                     "the training conversations; " + "; ".join(res) + " | " + ". ".join(m[0].upper() + m[1:] for m in met)
                     + " |")
    lines.append("")
    if mem:
        lines += ["## Per-rank peak and tokens/s under each engine", "",
                  f"A Gemma 3 of 101.6M parameters (12 x 768, vocab 32,768, tied; config in the script), 2 CPU processes "
                  f"over gloo, fp32, micro batch {MICRO} x {SEQ} tokens, rank {RANK} on q/k/v/o/gate/up/down, "
                  f"{STEPS} steps (the last is the steady one), AdamW fused. Measured: MemTracker inside each rank "
                  "(`hfscale profile --adapter KIND`: hfscale.scale.adapters.apply_adapter + the profile worker; the "
                  "recipe's own adapter runs are not in this table). Planned (recomputed with the final planner, `--part "
                  "repredict`): the traced step (full / LoRA / DoRA on every engine, FSDP2 adapters included: its units "
                  "hold the frozen base, only the adapter has gradients; QLoRA under DDP, ZeRO-2 and ZeRO-3: the LoRA trace "
                  "with its decoder linears as NF4). ZeRO-3 full was +17.6% and "
                  "FSDP2 full +3.2% before the planner walked their backward over the gradient arrivals (ZeRO-3: a "
                  "module's parameters released after its backward, a gradient alive from its arrival to its bucket's "
                  "reduction; FSDP2: a layer whose gradients all arrived is finished, resharded and reduce-scattered), "
                  "FSDP2 LoRA peaks at the start of forward (the tail's and the first layer's all-gather outputs beside "
                  "their parameters, now planned). DoRA's rows measured garbage before hfscale's tracker stopped torch's ModTracker "
                  "hooking module inputs (hfscale/plan/tracker.py): its multi-grad hook on a module's inputs holds their "
                  "grad_fns on those same nodes, a reference cycle only Python's cyclic GC frees, and every DoRA layer's "
                  "forward builds a graph nothing runs backward through (peft's delta weight lora_B(lora_A(eye(in))), used "
                  "detached) with its saved in x in identity (16.8 MB for a 2048-wide down_proj): alive until the GC ran, so "
                  "ranks and reruns differed (FSDP2: 515.1 / 558.8 MB in one run; DDP 590.1 MiB measured, 565.5 planned). "
                  "Now a tracked DoRA step of two DoRA Linears 768 -> 2048 -> 768 peaks at the allocator's peak of the "
                  "untracked step (torch's profiler memory events, +8 B; tests/test_tracker.py). One ZeRO-2 DoRA run after "
                  "the fix still held one layer's identities from step 1 on (597.8 / 595.4 MB, hash seed random); two "
                  "reruns with PYTHONHASHSEED 0 and 1 and the row below measured 557,938,268 B on both ranks: the cause "
                  "of that one run is not found. FSDP2 DoRA peaks inside the last layer (its weight-norm temporaries), "
                  "where the running layer is gathered beside its all-gather output: planned since (hfscale/plan/fsdp.py). "
                  "QLoRA under ZeRO-3 (fp32 storage in an fp32 run) is the LoRA trace with the gathered decoder linears "
                  "as NF4, as under DDP / ZeRO-2; its old measurement (326.3 MB) grew 37.3 MB a step under the same "
                  "ModTracker cycle (steady over 5 steps since). The QLoRA measurements count bitsandbytes' quant state "
                  "(absmax, nested absmax, offsets: 1,198,416 B here) since: MemTracker does not see it (attributes of "
                  "the NF4 weights, neither parameters nor buffers), which made the QLoRA plans +0.47-0.56%. The "
                  "recipe refuses QLoRA under FSDP2 (uint8 storage trains to NaN, "
                  "accelerate #3983; its ZeRO-3 refusal was a wrong check, docs/adapters.md), and the profile worker "
                  "and the plan follow it: the FSDP2 QLoRA row ran before that, with fp32 storage, and is shown for its "
                  "memory only, not planned and not in the target. tokens/s: both ranks' tokens over the mean step after the first, under the "
                  "tracker, on a host shared with other jobs (compare within a column with care).", "",
                  "| engine | kind | measured peak MiB (rank 0 / 1) | planned MiB | plan error | x full | tokens/s |",
                  "|---|---|---|---|---|---|---|"]
        for engine in ENGINES:
            full = mem.get(f"{engine}/none", {}).get("measured")
            for kind in KINDS:
                r = mem.get(f"{engine}/{kind}")
                if r is None:
                    lines.append(f"| {engine} | {NAMES[kind]} | not run | | | | |")
                    continue
                if "error" in r:
                    lines.append(f"| {engine} | {NAMES[kind]} | failed: {r['error'].replace('|', '/')} | | | | |")
                    continue
                m = r["measured"]
                ratio = f"{max(m) / max(full):.2f}" if full else ""
                if "refused" in r:
                    lines.append(f"| {engine} | {NAMES[kind]} | {' / '.join(gib(x) for x in m)} | refused, not planned "
                                 f"| | {ratio} | {r['tokens_per_s']} |")
                    continue
                p = r["predicted"]
                lines.append(f"| {engine} | {NAMES[kind]} | {' / '.join(gib(x) for x in m)} | "
                             f"{' / '.join(gib(x) for x in p)} ({r['predicted_by']}) | "
                             f"{' / '.join(f'{e:+.2f}%' for e in r['error_pct'])} | {ratio} | {r['tokens_per_s']} |")
        ran: dict = {}
        for key, r in mem.items():
            ran.setdefault(r.get("ran", results.get("memory_host_before", "?")), []).append(key)
        lines += ["", "Where each row was measured:", "",
                  *(f"- {', '.join(keys)}: {where}" for where, keys in ran.items())]
        lines.append("")
    n = results.get("nf4")
    if n:
        lines += ["## QLoRA's 4-bit base against its analytic NF4 size", "",
                  f"The same 101.6M model loaded by hfscale.scale.adapters.load_quantized_base (transformers' "
                  f"bitsandbytes quantizer, NF4, blocksize 64, double quantization): {n['quantized_params']:,} decoder "
                  "linear weights in 4 bits.", "",
                  "| | bytes | vs measured |", "|---|---|---|",
                  f"| measured (packed weights + absmax + nested absmax + offsets) | {n['measured']:,} | |",
                  f"| plan (memory.nf4_base_bytes) | {n['planned']:,} | {n['error_pct']:+.4f}% |",
                  f"| a flat 0.5 byte per weight | {n['flat_half_byte']:,} | {n['flat_error_pct']:+.2f}% |",
                  f"| the rest in bf16: measured / planned | {n['other_measured']:,} / {n['other_planned']:,} | |", ""]
    for key in eval_keys(results):
        if "base_loss" in results[key] and "runs" in results[key]:
            lines += eval_section(results[key])
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=["memory", "repredict", "nf4", "eval", "report"], action="append")
    ap.add_argument("--only", help="memory rows to (re)run, e.g. DDP/lora,ZeRO-3/none")
    ap.add_argument("--eval-steps", type=int, default=EVAL_STEPS,
                    help="steps of each eval run; other than 60 (e.g. 285, one epoch) kept beside it: results['eval_285']")
    ap.add_argument("--eval-kinds", default=",".join(EVAL_KINDS), help="kinds the eval part sweeps, e.g. qlora")
    ap.add_argument("--work", default=None)
    ap.add_argument("--results", default=None, help="JSON to read and update (default benchmarks/results/adapters.json)")
    args = ap.parse_args(argv)
    global RESULTS
    RESULTS = Path(args.results) if args.results else RESULTS
    parts = args.part or ["nf4", "eval", "memory"]
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results["host"], results["date"] = host(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for part in set(parts) - {"report"}:  # rows of one table can come from different hosts: each part says where it ran
        results.setdefault("hosts", {})[eval_key(args.eval_steps) if part == "eval" else part] = ran_here()
    work = Path(args.work or tempfile.mkdtemp(prefix="hfscale-adapters-"))
    if "nf4" in parts:
        nf4(work, results)
    if "eval" in parts:
        evaluate(work, results, args.eval_steps, LR_GRID, tuple(args.eval_kinds.split(",")))
    if "memory" in parts:
        results["hosts"]["memory"] = "per row, under the engine table"
        memory(work, results, set(args.only.split(",")) if args.only else None)
    if "repredict" in parts:
        repredict(work, results)
    for key in eval_keys(results):
        if "report" in parts and results[key].get("runs"):  # a sweep stopped early: select from what ran
            select_rows(results[key])
        runs = [r for r in results[key].get("runs", {}).values() if "at" in r]
        if runs and ("eval" in parts or "report" in parts):  # a sweep spans the load as it came and went
            loads = [r["load"] for r in runs]
            line = (f"{host()}: {', '.join(dict.fromkeys(NAMES[r['kind']] for r in runs))}, runs ended "
                    f"{runs[0]['at']} - {runs[-1]['at']}, load {min(loads):.1f}-{max(loads):.1f} (per run in the sweep "
                    "table)")
            # runs from before "at" was recorded keep the line written for them (EVAL_HOSTS_BEFORE_AT), this added
            dated = len(runs) == len(results[key]["runs"])
            results["hosts"][key] = line if dated else f"{EVAL_HOSTS_BEFORE_AT.get(key, '')}; then {line}"
    save(results)
    (OUT / "adapters.md").write_text(report(results))
    print(f"wrote {OUT / 'adapters.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
