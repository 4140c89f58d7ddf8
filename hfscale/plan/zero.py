"""Per-rank bytes of a training step under DeepSpeed ZeRO 1-3, from a one-rank step trace (`trace.py`).

The trace gives what the model's own code keeps alive (activations, temporaries, parameters, gradients);
this module lays DeepSpeed's own buffers over it, as DeepSpeed 0.19 allocates them per rank (N ranks,
P trainable elements, d bytes per parameter element: 4 fp32, 2 bf16; A = 8P, AdamW's two fp32 moments):

  all stages    fp32 master partition 4P/N (also in fp32 runs: DeepSpeed steps a flat fp32 copy);
                AdamW moments A/N from the end of step 1 on
  optimizer     the fp32 gradient partition 4P/N; the base optimizer runs on one flat partition, so
  phase         torch AdamW's forloop / foreach temporaries are 2 x 4P/N (fused and DeepSpeed's own
                optimizers: none); stages 1-2 hold the whole d*P parameters, stage 3 none gathered
  stage 1-2     whole parameters d*P; gradients in backward whole at stage 1. Stage 2, per rank, walked over
                the traced gradient arrivals (`stage2_walk`; one flat group in optimizer order, as hfscale's
                recipes build it): two reduce buffers (overlap_comm) and the bucket being filled (3 x
                reduce_bucket_size elements) once gradients arrive, an oversized gradient until the next
                reduction, the rank's gradient-partition buffer from the first reduction of one of its own
                parameters (early on the last rank, which owns the last layers; late on rank 0, which owns
                the embeddings and first layers), and with accumulation the previous micro batch's buffer
                (kept by all_grad_tensors). The buffer holds whole parameters: d x the elements of every
                parameter overlapping the rank's partition of the flat group (padded to 2 x N elements).
                Traces scaled in depth keep no arrivals: there the partition counts from the first gradient
                on (the last rank's case)
  stage 3       the parameter partition d*P/N and the flat gradient-partition buffer 4P/N (fp32 runs; bf16: 2P/N)
                from the start, plus the reduce bucket (reduce_bucket_size elements, accelerate's "auto" = hidden^2);
                in steady forward every parameter stays gathered while the model has fewer elements than
                stage3_max_reuse_distance (1e9 by default: DeepSpeed keeps a parameter it will use again within
                that many; backward uses each again), else the largest module's parameters and gradients (2x) are
                gathered at a time. Backward is walked over the traced gradient arrivals (`_stage3_backward`): a
                module's parameters are released once its backward is done (nothing later in the step uses them),
                and a gradient lives outside DeepSpeed's buffers only from its arrival to its bucket's reduction
                (the one arriving, and one larger than the bucket until the next arrival)

On a 101.6M Gemma 3 (2 ranks, fp32, micro 1 x 64; benchmarks/results/adapters.md), where the model states outweigh
the activations, the backward peak is at the first MLP gradients (two 768 x 2048 gradients alive, one module released):
full fine-tuning +0.03% (+17.6% while every gradient was taken as alive 1/N and every parameter as gathered to the end).
Measured on CPU against `hfscale profile` inside 2 ranks (tiny Gemma 3, fp32 and bf16, forloop AdamW):
within 0.003% on the steady peaks of ZeRO-1, 2 and 3 and with offload without checkpointing, and on ZeRO-3
every:2; ZeRO-2 with checkpointing or gradient accumulation per rank as well (before the per-rank walk,
rank 1 was under-predicted by up to 7.5%); all in benchmarks/results/step_peak.md.
Step 1 of ZeRO-3 releases parameters after use (nothing is traced yet): none gathered at the peaks.
CPU offload (DeepSpeedCPUAdam, in place): AdamW's moments, the master and fp32 gradient partitions
(and at stage 3 the parameter partition, at stages 1-2 an fp32 staging buffer of the largest parameter)
move to the host (`offloaded_bytes`); stages 1-2 keep a d*P/N gradient partition and a d-byte staging
buffer of the largest parameter on the device. On a CPU host both sides are one memory: measured there
against device + offloaded bytes. What is not measured: GPUs (allocator, CUDA kernels), models large
enough for stage3_max_reuse_distance to release parameters, foreach AdamW under DeepSpeed.
Fused AdamW (the recipes' since issue 39) under ZeRO-3, 2 ranks, fp32: steady peak within 0.002%, the step-1
optimizer step exact; step 1's backward, its peak with fused, is 5.07% under the measured one: DeepSpeed gathers
the tied lm_head (3,145,728 B on the tiny Gemma 3) at its start, which the rule above takes as released
(not modelled yet; tests/test_profile.py holds the gap).
"""

from __future__ import annotations

from .trace import StepTrace

REUSE_DISTANCE = 10**9  # DeepSpeed's stage3_max_reuse_distance default (hfscale's shipped configs keep it)


def _phase_kinds(tr: StepTrace, phase: str, steady: bool, grad_accum: int) -> dict:
    return dict(tr.phases(steady, grad_accum)[phase].breakdown)


HOST = "host_"  # kinds with this prefix live in host memory (CPU offload): not in a device peak


def owned(numels: list[int], ranks: int, rank: int) -> set[int]:
    """Indices of the parameters (optimizer order, one flat group padded to a multiple of 2 x ranks, as
    DeepSpeed's nccl_start_alignment_factor aligns it) whose elements overlap `rank`'s partition."""
    part = -(-sum(numels) // (2 * ranks)) * 2
    lo, hi, out, off = rank * part, (rank + 1) * part, set(), 0
    for i, n in enumerate(numels):
        if off < hi and off + n > lo:
            out.add(i)
        off += n
    return out


def stage2_walk(arrivals: list, mine: set[int], bucket: int) -> list[tuple[bool, int]]:
    """DeepSpeed stage 2's gradient buckets (contiguous_gradients; stage_1_and_2.py,
    reduce_independent_p_g_buckets_and_remove_grads / reduce_ipg_grads) walked over the traced gradient
    arrivals, for the rank owning the parameters `mine`. Per segment (0: before the first arrival, k: after
    arrival k - 1): (whether the rank's gradient partition is allocated, elements of a gradient alive outside
    DeepSpeed's buffers). A gradient that does not fit the bucket (`bucket` elements) first reduces it; the
    reduction copies the rank's own gradients into its partition (allocated then) and drops the others. A
    gradient that fits is copied into the bucket as it arrives; an oversized one stays alive until reduced."""
    out = [(False, 0)]
    held, elems, alloc, big = [], 0, False, 0
    for i, n, *_ in arrivals:
        if held and elems + n > bucket:
            alloc = alloc or any(x in mine for x in held)
            held, elems, big = [], 0, 0
        held.append(i)
        elems += n
        big = n if n > bucket else big
        out.append((alloc, big))
    return out


def _stage2_backward(tr: StepTrace, dp: int, rank: int, d: int, bucket: int,
                     grad_accum: int) -> dict[str, int]:
    """Stage 2's backward peak on `rank` over the traced gradient arrivals (see the module docstring)."""
    mine = owned(tr.param_numels, dp, rank)
    own = d * sum(tr.param_numels[i] for i in mine)  # DeepSpeed copies whole parameters into the partition buffer
    best: dict[str, int] = {}
    for m, segments in enumerate(tr.grad_arrivals[: 1 if grad_accum == 1 else 2]):
        walk = stage2_walk(segments[1:], mine, bucket)
        for k, ((_, _, _, kinds), (alloc, big)) in enumerate(zip(segments, walk)):
            out = {n: kinds.get(n, 0) for n in ("activations", "temporaries", "buffers", "parameters")}
            # the previous micro batches' partition buffer (kept by all_grad_tensors), the reduce buffers and the
            # bucket being filled (released after each backward, set up at its first gradient), an oversized
            # gradient waiting for its reduction
            out["gradients"] = (own if m else 0) + (3 * bucket * d if k else 0) + d * big
            out["grad_partition"] = own if alloc else 0
            if sum(out.values()) > sum(best.values()):
                best = out
    return best


def _stage3_gathered(tr: StepTrace, d: int, steady: bool, released: int = 0) -> int:
    """Bytes of stage 3's gathered parameters: the one rule forward and the backward walk read. Step 1 releases each
    module's parameters after use (at the forward peak, the loss, and the backward peak, its start, none were gathered
    on the measured rows); steady steps keep every parameter gathered below the reuse distance, but the `released`
    elements (modules whose backward is done), frozen ones (LoRA's base) alike (measured on a 101.6M Gemma 3 with
    LoRA: benchmarks/results/adapters.md); above it the largest module's parameters and gradients (2x)."""
    if not steady:
        return 0
    if tr.params > REUSE_DISTANCE:
        return 2 * tr.largest_module_param_bytes
    return d * (tr.params - released)


def _stage3_backward(tr: StepTrace, d: int, hidden: int, steady: bool, grad_accum: int) -> dict[str, int]:
    """Stage 3's backward peak walked over the traced gradient arrivals (DeepSpeed 0.19 stage3.py:
    reduce_independent_p_g_buckets_and_remove_grads, partition_grads; partitioned_param_coordinator.py:
    release_sub_module, __params_to_release). At a gradient's arrival its hook first reduces the bucket if the new
    gradient does not fit beside it (a gradient larger than the bucket stays alive until then: `stage2_walk`'s rule,
    the same code path), then copies the new one into the bucket (a fixed buffer) unless it is larger; reduced
    gradients land in the flat gradient-partition buffer (fixed) and are freed. So at an arrival the new gradient and
    the one still pending are alive; every other gradient the trace holds (a tied weight's partial sum is a temporary
    there) is not yet DeepSpeed's. In steady steps a module's parameters are released after its backward when the
    rest of the step does not use them again (always, below the reuse distance: backward is the step's end), which
    comes after its weights' gradient hooks: gathered are the parameters but those of the modules whose gradients
    arrived before this one, and but persistent ones (below stage3_param_persistence_threshold, accelerate's "auto" =
    10 x hidden, never partitioned); frozen ones (an adapter's base) stay counted gathered (no arrival marks their
    module done; an adapter's backward peaks at its start, where all are gathered anyway). Step 1 has no complete
    trace: every module releases its parameters after use, none gathered at the measured peaks."""
    bucket, persistent = hidden * hidden, 10 * hidden
    best: dict[str, int] = {}
    for m, segments in enumerate(tr.grad_arrivals[: 1 if grad_accum == 1 else 2]):
        walk = stage2_walk(segments[1:], set(), bucket)
        arrived = released = 0
        for k, (i, n, _, kinds) in enumerate(segments):
            arrived += n if k else 0
            out = {x: kinds.get(x, 0) for x in ("activations", "temporaries", "buffers")}
            # the trace's gradients less those DeepSpeed took (with accumulation the trace's .grad tensors hold the earlier
            # micro batches' sums, which DeepSpeed keeps in its partition buffer), plus the arriving and pending ones
            taken = d * (tr.trainable_params if m else arrived)
            out["gradients"] = max(kinds.get("gradients", 0) - taken, 0) + (d * (walk[k - 1][1] + n) if k else 0)
            out["parameters"] = _stage3_gathered(tr, d, steady, released)
            released += n if k and n > persistent else 0
            if sum(out.values()) > sum(best.values()):
                best = out
    return best


def deepspeed_phases(tr: StepTrace, zero: int, dp: int, offload: str, hidden: int, steady: bool,
                     grad_accum: int = 1, adamw: str = "fused", rank: int | None = None) -> dict[str, dict[str, int]]:
    """{phase: {kind: bytes}} per rank under DeepSpeed ZeRO `zero` over `dp` ranks (see the module docstring);
    with offload, what lives on the host is under `host_*` kinds. `rank`: which rank (stage 2's backward
    differs per rank); None: the rank with the highest backward peak."""
    N = max(1, dp)
    P = tr.trainable_params
    d = 2 if tr.precision in ("bf16", "bf16-pure") else 4
    part = -(-P // N)  # DeepSpeed pads the flat partition to the rank count
    states = -(-tr.state_bytes // N)
    off = offload != "none"
    where = HOST if off else ""
    # held from the start (moments from the end of step 1's optimizer step on)
    fixed = {where + "master_weights": 4 * part}
    if zero == 3:
        fixed.update({where + "param_partition": d * part, "grad_partition_buffer": (4 if d == 4 else 2) * part,
                      "reduce_bucket": hidden * hidden * d})
    elif off:  # the pinned fp32 gradient partition and an fp32 staging buffer of the largest parameter on the
        # host; on the device the d-byte gradient partition and staging buffer (temp_grad_buffer_for_*_offload)
        largest = tr.largest_module_param_bytes // d  # elements of the largest parameter (one per module here)
        fixed.update({HOST + "grad_partition": 4 * part, HOST + "staging": 4 * largest,
                      "grad_partition": d * part, "staging": d * largest})
    if off and zero == 3:
        fixed[HOST + "grad_partition"] = 4 * part
    out: dict[str, dict[str, int]] = {}
    for phase in ("forward", "backward"):
        k = _phase_kinds(tr, phase, steady, grad_accum)
        kinds = {n: k.get(n, 0) for n in ("activations", "temporaries", "buffers")}
        grads = k.get("gradients", 0)
        if zero <= 1:
            kinds["gradients"] = grads
        elif zero == 3:  # the flat gradient-partition buffer is allocated up front (below)
            kinds["gradients"] = -(-grads // N)
        elif grads:  # stage 2: once a bucket was reduced, the whole gradient partition exists, beside the two
            # overlap_comm buffers and the gradients of the bucket being filled (reduce_bucket_size elements each)
            kinds["gradients"] = d * part + 3 * hidden * hidden * d
        if zero == 3:
            kinds["parameters"] = _stage3_gathered(tr, d, steady)
        else:
            kinds["parameters"] = k.get("parameters", 0)
        if phase == "backward" and zero == 3 and tr.grad_arrivals:
            kinds = _stage3_backward(tr, d, hidden, steady, grad_accum)
        if phase == "backward" and zero == 2 and not off and tr.grad_arrivals:
            ranks = range(N) if rank is None else [rank]
            kinds = max((_stage2_backward(tr, N, r, d, hidden * hidden, grad_accum) for r in ranks),
                        key=lambda x: sum(x.values()))
        kinds[where + "optimizer"] = states if steady else 0
        held = dict(fixed)
        if off and zero == 3 and not steady:  # stage 3 allocates its pinned fp32 gradient partition in step 1's step
            held.pop(HOST + "grad_partition")
        out[phase] = {**kinds, **held}
    opt = {"buffers": _phase_kinds(tr, "optimizer", steady, grad_accum).get("buffers", 0),
           where + "optimizer": states,  # step 1 creates them in this phase
           "optimizer_temporaries": 0 if off or adamw == "fused" else 2 * 4 * part, **fixed}
    if not off:
        opt["grad_partition"] = 4 * part
    if zero < 3:
        opt["parameters"] = d * tr.params  # frozen parameters (LoRA's base) stay whole too
    out["optimizer"] = opt
    return {ph: {k: v for k, v in kinds.items() if v} for ph, kinds in out.items()}


def split_host(kinds: dict) -> tuple[int, int]:
    """(device bytes, host bytes) of one phase's kinds."""
    host = sum(v for k, v in kinds.items() if k.startswith(HOST))
    return sum(kinds.values()) - host, host


__all__ = ["HOST", "REUSE_DISTANCE", "deepspeed_phases", "owned", "stage2_walk", "split_host"]
