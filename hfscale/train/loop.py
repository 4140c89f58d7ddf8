"""The pieces every recipe (train_clm.py, qat_clm.py, distill_clm.py) runs: pre-flight, launch, the step loop, and
evaluation (their `main` is hfscale.train.recipe's, their model builder hfscale.train.prepare). The recipes stay readable scripts that say *what* happens in which order; this module
holds *how*, once.

The step loop: every optimizer step reads `accum` micro batches per rank, chosen as a pure function
of (seed, step, micro, rank) so a resumed run reads exactly what an uninterrupted one would; loss and
peak memory travel in one collective per step; checkpoints are complete-or-absent (train.state).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

# the one next-token loss (full blocks' mean, or a packed batch's trained-token sum / the step's count), re-exported
# as train_steps' default loss_fn and for the recipes (no torch at import)
from ..models.loss import lm_loss, own_loss, trained_tokens


def lr_at(step: int, cfg) -> float:
    """Linear warm-up over warmup_steps, then cosine from lr down to lr x min_lr_ratio at max_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@dataclass(frozen=True)
class Preflight:
    """Everything checked before a process group or a model exists, handed to the rest of the recipe."""
    model_config: object
    plan: object  # data.sampler.BatchPlan
    data: object  # data.recipe.RunData: the store this run reads (its key goes into every checkpoint)
    ckpts: object  # state.Checkpoints
    resume: object | None  # state.Resume
    launch: object  # scale.runtime.LaunchView
    precision: object  # hosts.PrecisionChoice: what runs, and the line to print if it is not the launch's


# what a run writes under OUTPUT_DIR (QAT adds the last two); --force replaces them
RUN_OUTPUTS = ("checkpoints", "model", "adapter", "metrics.jsonl", "recipe.json", "memory", "quantized", "quality.json")


def check_run_outputs(cfg) -> None:
    """Refuse an OUTPUT_DIR whose outputs would replace (or sit inside) the model or data it reads,
    or that cannot be created, before anything is loaded (hfscale.util.atomic)."""
    from ..util.atomic import check_overlap, check_parents

    outputs = {Path(cfg.output_dir) / name: "--output-dir" for name in RUN_OUTPUTS}
    check_overlap(outputs, {cfg.model: "--model", cfg.data: "--data", cfg.validation: "--validation"})
    check_parents(outputs)


def preflight(cfg, force: bool, source: str | None = None) -> Preflight:
    """Every check that can fail on the user's input, before a process group or a model exists.
    `source`: the recipe YAML the settings came from (named in doctor's findings)."""
    from ..data.recipe import check_data
    from ..util.cache import cache_root
    from ..util.errors import HfscaleError
    from ..util.hosts import bf16_support, resolve_precision
    from ..models.builtin import load_config
    from ..scale.runtime import read_launch
    from ..data.sampler import plan_batch
    from .reshape import check_reshape
    from .state import Checkpoints, model_fingerprint
    from .adapter_ckpt import check_source, source_key

    launch = read_launch(os.environ)  # the recipe's edge: the launcher's environment is read here, once
    check_run_outputs(cfg)
    model_config = load_config(cfg.model)
    limit = getattr(getattr(model_config, "text_config", None) or model_config, "max_position_embeddings", None)
    if limit and cfg.seq_len > limit:
        raise HfscaleError(f"seq_len {cfg.seq_len} is longer than {cfg.model} supports ({limit}); use --seq-len {limit} or less")
    plan = plan_batch(cfg.global_batch_tokens, cfg.seq_len, launch.world, cfg.micro_batch)
    ckpts = Checkpoints(cfg.output_dir, cfg.keep_last)
    # a resume of another model is refused first: the data check below loads the model's tokenizer
    resume = ckpts.resolve(cfg.resume, model_fingerprint(model_config, cfg.adapter_spec), plan.tokens_per_step)
    data = check_data(cfg.data, cfg.model, cfg.data_options, cache_root())  # missing files, bad options fail here
    if resume is not None and resume.meta.get("data_key", data.key) != data.key:
        raise HfscaleError(f"{resume.path} was trained on other data (token store key {resume.meta['data_key']}, this run's "
                           f"is {data.key}: other files, tokenizer or data options); resume with the run's data, or start "
                           "a new --output-dir")
    if resume is not None:
        check_reshape(resume.path, resume.meta, launch.world, launch.deepspeed)
        check_source(resume.path, resume.meta.get("base"), source_key(cfg.model, cfg.seed))  # adapter-only: its base
    out = Path(cfg.output_dir)
    if resume is None and not force and (ckpts.complete() or (out / "model").exists()):
        raise HfscaleError(f"{out} already holds a run; pass --resume latest to continue it, --force to start over, "
                           "or another --output-dir")
    from ..scale.checkpointing import resolve, with_launch

    n_layers = getattr(getattr(model_config, "text_config", None) or model_config, "num_hidden_layers", 1)
    with_launch(resolve(cfg.checkpointing, n_layers), launch.fsdp_checkpoints_all)  # refused here, before any process group
    support = bf16_support("cpu" if launch.on_cpu else "cuda")
    precision = resolve_precision(cfg.precision, launch.precision, support, what=cfg.model)
    if cfg.doctor:
        run_doctor(cfg, plan, launch, precision, support, source)
    return Preflight(model_config, plan, data, ckpts, resume, launch, precision)


# doctor speaks TrainingArguments; a finding about the recipe names the recipe's own setting
RECIPE_KEYS = {"per_device_train_batch_size": "micro_batch", "gradient_accumulation_steps": "global_batch_tokens",
               "bf16": "precision", "fp16": "precision", "gradient_checkpointing": "checkpointing"}


def run_doctor(cfg, plan, launch, precision, support, source: str | None) -> None:
    """hfscale doctor on what this launch will really do: the user's DeepSpeed JSON (with the precision
    the recipe runs, where it overrides the JSON's), the model, and the recipe's batch shape and
    precision, passed as data. A finding names only the user's files and the recipe's settings."""
    from ..doctor import check
    from ..util.errors import HfscaleError
    from ..scale.runtime import set_deepspeed_precision

    label = source or "recipe settings"
    ds, ds_label = launch.deepspeed, launch.deepspeed_file
    if ds is not None and precision.overridden:  # the engine will run the recipe's precision, not the JSON's
        ds = set_deepspeed_precision(json.loads(json.dumps(ds)), precision.precision)
        ds_label = f"{launch.deepspeed_file} (precision {precision.precision} by the recipe's precision: {cfg.precision})"
    args = {
        "per_device_train_batch_size": plan.micro_batch,
        "gradient_accumulation_steps": plan.accum,
        "bf16": precision.precision == "bf16",
        "fp16": precision.precision == "fp16",
        "gradient_checkpointing": cfg.checkpointing != "off",
        **_doctor_adapter_keys(getattr(cfg, "adapter_spec", None), launch, precision.precision),
    }
    findings = check(deepspeed=ds, args=args, model=cfg.model, num_processes=launch.world,
                     labels={"deepspeed": ds_label, "args": label}, host_bf16=support, cpu_launch=launch.on_cpu)
    errors = [f for f in findings if f.severity == "error"]
    if errors:
        f = errors[0]
        where = f.where
        if where.startswith(label + ":"):
            key = where.split(":")[-1]
            where = f"{label}:{RECIPE_KEYS.get(key, key)}"
        what = f.what.replace("per_device_train_batch_size", f"{label}'s micro_batch")
        raise HfscaleError(f"hfscale doctor: {where}: {what}; {f.fix} (run `hfscale doctor` for all findings)")


def _doctor_adapter_keys(adapter, launch, precision: str) -> dict:
    """The recipe's adapter as doctor reads it (hfscale/doctor/adapters.py): the adapter section, the 4-bit storage the
    NF4 base is loaded with on this engine, and the recipe's non-reentrant checkpointing (hfscale.scale.checkpointing)."""
    from ..scale.adapters import AdapterSpec

    spec = AdapterSpec.from_mapping(adapter) if adapter is None or isinstance(adapter, (str, dict)) else adapter
    if not spec.enabled:
        return {}
    out = {"adapter": spec.to_dict(), "gradient_checkpointing_kwargs": {"use_reentrant": False}}
    if spec.base_bits == 4:  # the storage the recipe loads its NF4 base with (scale.adapters.qlora_dtypes, which
        # refuses FSDP2 in one line itself: then doctor gets no storage key)
        from ..scale.adapters import qlora_dtypes
        from ..util.errors import ConfigError

        ds = launch.deepspeed
        stage = ((ds or {}).get("zero_optimization") or {}).get("stage", 0) if ds is not None else None
        try:
            out["bnb_4bit_quant_storage"] = str(qlora_dtypes(precision, stage, getattr(launch, "fsdp", False))[1]).replace("torch.", "")
        except ConfigError:
            pass
    return out


def start_run(cfg, force: bool, pre: Preflight, tag: str):
    """Accelerator (right on CPU hosts too) in the precision chosen, a clean OUTPUT_DIR on the main rank,
    the batch arithmetic and (if it differs from the launch config) the precision said in one line."""
    from ..util.atomic import write_text_atomic
    from ..scale.runtime import make_accelerator, set_deepspeed_micro_batch

    plan, ckpts, resume, choice = pre.plan, pre.ckpts, pre.resume, pre.precision
    accelerator = make_accelerator(precision=choice.precision if choice.overridden else None,
                                   gradient_accumulation_steps=plan.accum)
    out = Path(cfg.output_dir)
    if accelerator.is_main_process:
        if force and resume is None:
            for old in (out / "checkpoints", out / "model", out / "adapter", out / "metrics.jsonl", out / "memory"):
                shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)
        gone = ckpts.clean_partial()
        out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out / "recipe.json", json.dumps({k: v for k, v in vars(cfg).items() if k != "extra"}, indent=1))
        print(f"[{tag}] {accelerator.distributed_type} world {accelerator.num_processes}: {plan.arithmetic()}, "
              f"{choice.precision}")
        if choice.note:
            print(f"[{tag}] {choice.note}")
        for g in gone:
            print(f"[{tag}] removed the interrupted save {g.name}")
    accelerator.wait_for_everyone()
    set_deepspeed_micro_batch(accelerator, plan.micro_batch)
    return accelerator


def prepare_data(pre: Preflight, rank: int, tag: str):
    """The token store of every recipe (train_clm, qat_clm, distill_clm), before any process group: every rank
    tokenizes a share, rank 0 merges (no rank waits alone behind a barrier for the whole corpus); a store already
    there (same key) is reused at any world size. Rank 0 prints its counts (examples, tokens, trained tokens)."""
    from ..data.recipe import ready_store

    store = ready_store(pre.data, rank, pre.launch.world)
    if rank == 0:
        for line in store.lines():
            print(f"[{tag}] data: {line.strip()}", flush=True)
    return store


def evaluate(model, accelerator, val, micro_batch: int) -> float:
    """Mean next-token loss per trained token over the held-out data; every rank scores an equal share.
    `val`: full blocks (a Long[N, S] tensor, every next token trained: rows-weighted, which for blocks of one
    length is token-weighted; `micro_batch` rows a forward) or a sequence of packed micro batches (a list, or
    hfscale.data.dataset.MicroBatches over a token store's rows; `micro_batch` unused): the sum over their trained
    tokens / their count, so a batch of short answers weighs what its tokens weigh."""
    import torch

    world, rank = accelerator.num_processes, accelerator.process_index
    share = len(val) // world
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    model.eval()
    with torch.no_grad():
        if isinstance(val, torch.Tensor):
            mine = val[rank * share : (rank + 1) * share]
            for i in range(0, share, micro_batch):
                batch = mine[i : i + micro_batch].to(accelerator.device)
                loss = lm_loss(model, batch)
                total += torch.tensor([loss.item() * len(batch), len(batch)], dtype=torch.float64, device=total.device)
        else:
            for j in range(rank * share, (rank + 1) * share):
                batch = {k: v.to(accelerator.device) for k, v in val[j].items()}
                n = trained_tokens(batch["labels"])
                # the summed loss (divided by 1); a micro batch that trains nothing still runs its forward (0.0):
                # under ZeRO-3 / FSDP2 every rank must take part in each forward's gathers
                total += torch.stack([lm_loss(model, batch, 1).double(), n.double()]).to(total.device)
    model.train()
    total = accelerator.reduce(total, reduction="sum")
    return float(total[0] / total[1].clamp(min=1))


def resume_from(accelerator, resume, tag: str, model=None, base: dict | None = None) -> int:
    """Collective. Load the checkpoint preflight chose (state.Resume) and return its step. Every rank checked it
    against its manifest; here they agree on it. Saved on another rank count: DeepSpeed's universal checkpoint
    (hfscale.train.reshape), said in one line. An adapter-only checkpoint (its marker's `base`,
    hfscale.train.adapter_ckpt) loads over `model`'s base, built from the source, whose digest (`base`) must match."""
    import contextlib

    from accelerate.utils import gather_object

    from ..util.errors import HfscaleError
    from .adapter_ckpt import adapter_only, check_digest
    from .reshape import saved_facts

    if resume is None:
        return 0
    if accelerator.num_processes > 1:
        seen = gather_object([str(resume.path)])
        if len(set(seen)) > 1:
            raise HfscaleError(f"the ranks chose different checkpoints to resume ({', '.join(sorted(set(seen)))}): "
                               "OUTPUT_DIR must be one file system every rank sees the same")
    if accelerator.is_main_process and resume.note():
        print(f"[{tag}] {resume.note()}", flush=True)
    saved = saved_facts(resume.path, resume.meta)["ranks"]
    now = accelerator.num_processes
    scope = contextlib.nullcontext()
    if resume.meta.get("base"):  # adapter-only: the base is this run's, built from the source; it must be the same
        check_digest(resume.path, resume.meta["base"], (base or {}).get("digest"))
        scope = adapter_only(accelerator, model)
    with scope:
        return _load(accelerator, resume, tag, saved, now)


def _load(accelerator, resume, tag: str, saved: int, now: int) -> int:
    from .step import deepspeed_engine
    from .reshape import load_universal

    if saved != now and deepspeed_engine(accelerator) is not None:
        target, how = load_universal(accelerator, resume.path)
        if accelerator.is_main_process:
            print(f"[{tag}] resuming step {resume.step} saved by {saved} ranks on {now} rank{'s' if now > 1 else ''}: "
                  f"universal checkpoint {target} ({how})", flush=True)
    else:
        accelerator.load_state(str(resume.path))
        if accelerator.is_main_process:
            how = ("torch.distributed.checkpoint reshards it" if "FSDP" in str(accelerator.distributed_type)
                   else "DDP state is whole on every rank")
            moved = f" (saved by {saved} ranks, now {now}: {how})" if saved != now else ""
            print(f"[{tag}] resumed from {resume.path} at step {resume.step}{moved}", flush=True)
    return resume.step


def setup_failed(e: BaseException, tag: str, rank: int, wait_s: float = 60.0) -> int:
    """The exit status of a run refused before training (bad settings or data: HfscaleError), after its one line.
    Rank 0 says it. The other ranks met the same check (same settings, same data, and prepare hands a rank's failure
    to the others) but must not leave first: torchrun SIGTERMs the rest as soon as one rank exits, and rank 0 then
    died before its line (seen: a 2-rank launch on a chat file whose tokenizer has no chat template ended with no
    message at all). So they wait up to `wait_s` for that SIGTERM, sent once rank 0 has printed and left, and only
    then say it themselves (an error rank 0 did not meet). Under launchers that do not end the other ranks (srun
    starting every rank itself, mpirun) a refused run ends `wait_s` later; hfscale's SLURM path runs torchrun
    (accelerate launch) per node, which does."""
    import sys
    import time

    if rank != 0:
        time.sleep(wait_s)
    print(f"{tag}: error: {e}", file=sys.stderr, flush=True)
    return getattr(e, "status", 2)  # 74: the disk filled while the token store was written


def stopped(e: BaseException, tag: str, rank: int) -> int:
    """The exit status of a run that ended early on every rank together: preempted (a checkpoint was saved;
    EXIT_PREEMPTED), a failed save (EXIT_SAVE_FAILED) or another user error (2), after one line from rank 0
    and an orderly end of the process group. Anything else is a bug and is raised on."""
    import sys

    import contextlib
    import signal

    from ..util.errors import HfscaleError
    from ..scale.runtime import end_process_group
    from .preempt import STOP_SIGNALS, Preempted

    if not isinstance(e, (HfscaleError, Preempted)):
        raise e
    if rank == 0 and not isinstance(e, Preempted):  # the step loop said why it stopped
        print(f"{tag}: error: {e}", file=sys.stderr, flush=True)
    # the first rank out makes torchrun SIGTERM the rest: they are leaving with this status anyway, so a stop
    # request now must not turn it into "killed by SIGTERM" (measured: 1 run in 3 lost rank 1's 74 that way)
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    with contextlib.suppress(RuntimeError):  # a rank already gone: the barrier fails at once, the status stands
        end_process_group()  # every rank ends here together (they agreed on the stop in a collective)
    return getattr(e, "status", 2)


def write_memory_profile(accelerator, prof, optimizer, cfg, plan) -> None:
    """OUTPUT_DIR/memory: every rank's timeline, then (main rank) the report against the plan's prediction."""
    from ..util.atomic import write_text_atomic
    from ..models.builtin import load_config
    from ..plan.profiler import write_report

    out = Path(cfg.output_dir) / "memory"
    res = prof.result(accelerator, optimizer, cfg.model, plan.micro_batch, cfg.seq_len, cfg.checkpointing,
                      run_precision(accelerator), snapshot_dir=out, grad_accum=plan.accum)
    write_text_atomic(out / f"rank{res.rank}.json", json.dumps(res.to_dict()))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(res.world)]
        rows = write_report(out, reports, load_config(cfg.model),
                            f"{cfg.model}, {res.engine} zero {res.zero} x {res.world}, micro batch {plan.micro_batch} x "
                            f"{cfg.seq_len}, {res.precision}, checkpointing {cfg.checkpointing}")
        err = rows[0].get("error", {}).get("peak")
        print(f"[memory] steady peak {rows[0]['measured']['peak'] / 2**20:.1f} MiB per rank"
              + (f", plan {err:+.2%}" if err is not None else "") + f"; wrote {out}/profile.json and timeline.png", flush=True)


def run_precision(accelerator) -> str:
    """The precision the prepared run computes in (DeepSpeed's bf16/fp16 blocks, else accelerate's mixed precision)."""
    engine = getattr(getattr(accelerator, "deepspeed_engine_wrapped", None), "engine", None)
    if engine is not None:
        return "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"
    return {"no": "fp32"}.get(accelerator.mixed_precision, accelerator.mixed_precision)


def train_steps(accelerator, model, optimizer, cfg, plan, train_blocks, val_blocks, ckpts, log, start: int,
                meta: dict, loss_fn=lm_loss, tag: str = "train_clm", data_rank: int | None = None, stop=None,
                read_batch=None, step_tokens=None) -> None:
    """Steps start..max_steps: accumulate, clip (DeepSpeed clips per its JSON), log, evaluate, checkpoint.
    SIGTERM / SIGUSR1 (`stop`, a preempt.StopRequest; installed here when not given) end the run at the next
    step boundary on every rank: a checkpoint, then preempt.Preempted.
    `data_rank`: the rank whose sequences this process reads (default its own; under sequence parallelism the
    ranks of one SP group read the same ones, and `plan.world` counts the groups).
    Data: full blocks (`train_blocks`, a Long[N, S] tensor; each micro batch's mean loss, averaged) or packed
    batches: `read_batch(step, micro, rank)` -> a packed micro batch (hfscale.models.documents) and
    `step_tokens(step)` -> the step's trained-token count over every micro batch and rank (from the data layer,
    no communication); then `loss_fn(model, batch, step_tokens(step))` is this micro batch's share of the step's
    sum / count, backward runs on share x accum x plan.world (hfscale.models.loss.backward_scale) and the logged
    loss is the step's sum / count. `tokens_per_s` counts token slots (rows x seq_len, padding included);
    packed runs also log the trained tokens (`trained_tokens`, `trained_tokens_per_s`).
    Progress: a tqdm bar, or with progress off (logs, the demo) a `[tag] step N/M` line every tenth of the run."""
    import contextlib

    import torch
    from tqdm.auto import tqdm

    from ..plan.profiler import MemoryProfiler
    from .step import backward, deepspeed_engine, optimizer_step
    from ..models.loss import backward_scale
    from ..data.sampler import rank_indices
    from .metrics import peak_memory_bytes
    from .preempt import Preempted, StopRequest
    from .state import fault

    from ..scale.runtime import hold_process_groups

    hold_process_groups()  # the groups `prepare` made (DeepSpeed's) live until exit_rank: none is destroyed in-process
    own = stop is None
    stop = stop or StopRequest().install()
    deepspeed = getattr(accelerator.state, "deepspeed_plugin", None) is not None
    model.train()
    prof = MemoryProfiler(model, optimizer, deepspeed_engine(accelerator)) if cfg.profile_memory else None
    if cfg.save_every and accelerator.is_main_process and (note := ckpts.space_note(model, accelerator, bool(meta.get("base")))):
        print(f"[{tag}] warning: {note}", flush=True)
    bar = tqdm(total=cfg.max_steps, initial=start, desc="train", disable=not (accelerator.is_main_process and cfg.progress))
    for step in range(start, cfg.max_steps):
        t0, c0 = time.perf_counter(), time.process_time()
        for group in optimizer.param_groups:  # lr_scale: LoRA+'s B groups (hfscale.scale.adapters)
            group["lr"] = lr_at(step, cfg) * group.get("lr_scale", 1.0)
        step_loss = torch.zeros((), dtype=torch.float64, device=accelerator.device)
        profiled = prof is not None and step - start < cfg.profile_memory
        phase = (lambda name: prof.phase(name, step - start + 1)) if profiled else (lambda name: contextlib.nullcontext())
        reader = accelerator.process_index if data_rank is None else data_rank
        # the head runs at the trained positions (hfscale.models.loss) but under SP (data_rank: sp_lm_loss, every
        # position of the rank's slice) and where the model's own loss is taken
        head_cut = data_rank is None and not own_loss(model)
        trained = None if read_batch is None else step_tokens(step)
        for micro in range(plan.accum):
            if read_batch is None:
                batch = train_blocks[rank_indices(plan, len(train_blocks), cfg.seed, step, micro, reader)].to(accelerator.device)
            else:
                batch = {k: v.to(accelerator.device) for k, v in read_batch(step, micro, reader).items()}
                if profiled and head_cut:  # the head's rows: the plan traces the most a micro batch trains
                    prof.saw_trained(trained_tokens(batch["labels"]))
            with accelerator.accumulate(model):
                with phase("forward"):
                    loss = loss_fn(model, batch) if trained is None else loss_fn(model, batch, trained)
                with phase("backward"):  # accelerator.backward, but DeepSpeed's step comes in optimizer_step
                    backward(accelerator, loss if trained is None else loss * backward_scale(plan.accum, plan.world))
                if accelerator.sync_gradients and not deepspeed:
                    accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                with phase("optimizer"):
                    optimizer_step(accelerator, optimizer)
            step_loss += loss.detach().double() / (plan.accum if trained is None else 1)
        if profiled and step - start + 1 == cfg.profile_memory:
            write_memory_profile(accelerator, prof, optimizer, cfg, plan)
        # one collective per step: every rank's mean loss (-> the global-batch loss), its peak memory, and whether
        # it was asked to stop (then all stop here, together)
        peak, kind = peak_memory_bytes()
        mine = torch.tensor([0.0, float(peak), float(stop.signal is not None)], dtype=torch.float64, device=step_loss.device)
        mine[0] = step_loss
        every = accelerator.gather(mine.unsqueeze(0))
        step_loss, peak, stopping = float(every[:, 0].mean()), int(every[:, 1].max()), bool(every[:, 2].max() > 0)
        if trained is not None:  # shares of sum / count: the groups' shares add up (an SP group's ranks hold one each)
            step_loss *= plan.world
        done = step + 1
        if done % cfg.log_every == 0 or done == cfg.max_steps:
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            record = {"kind": "train", "step": done, "loss": step_loss, "lr": lr_at(step, cfg),
                      "tokens_per_s": plan.tokens_per_step / dt, "step_s": dt, "cpu_s": cpu, "peak_mem_bytes": peak, "mem": kind,
                      "tokens_seen": done * plan.tokens_per_step}
            if trained is not None:
                record.update(trained_tokens=trained, trained_tokens_per_s=trained / dt)
            log.write(record)
        bar.update(1)
        bar.set_postfix(loss=f"{step_loss:.3f}")
        if not cfg.progress and accelerator.is_main_process and (done % max(1, cfg.max_steps // 10) == 0 or done == cfg.max_steps):
            print(f"[{tag}] step {done}/{cfg.max_steps}: loss {step_loss:.3f}, "
                  f"{plan.tokens_per_step / (time.perf_counter() - t0):,.0f} tokens/s", flush=True)
        fault("step", done, accelerator.process_index)
        if cfg.eval_every and done % cfg.eval_every == 0 and done < cfg.max_steps:
            ev = evaluate(model, accelerator, val_blocks, plan.micro_batch)
            log.write({"kind": "eval", "step": done, "loss": ev, "ppl": math.exp(ev)})
        saved = cfg.save_every and (done % cfg.save_every == 0 or done == cfg.max_steps)
        if saved:
            ckpts.save(accelerator, done, meta, model)
        if stopping and done < cfg.max_steps:
            if not saved:
                ckpts.save(accelerator, done, meta, model)
            bar.close()
            if own:
                stop.uninstall()
            if accelerator.is_main_process:
                print(f"[{tag}] {stop.name}: stopped after step {done}, checkpoint {ckpts.root}/step_{done:08d} saved; "
                      "rerun with --resume latest", flush=True)
            raise Preempted(done, stop.name)
    bar.close()
    if own:
        stop.uninstall()
