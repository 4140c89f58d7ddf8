"""Per-rank bytes of a training step under DeepSpeed ZeRO 1-3, from a one-rank step trace (`trace.py`).

The trace gives what the model's own code keeps alive (activations, temporaries, parameters, gradients);
this module lays DeepSpeed's own buffers over it, as DeepSpeed 0.19 allocates them per rank (N ranks,
P trainable elements, d bytes per parameter element: 4 fp32, 2 bf16; A = 8P, AdamW's two fp32 moments):

  all stages    fp32 master partition 4P/N (also in fp32 runs: DeepSpeed steps a flat fp32 copy);
                AdamW moments A/N from the end of step 1 on
  optimizer     the fp32 gradient partition 4P/N; the base optimizer runs on one flat partition, so
  phase         torch AdamW's forloop / foreach temporaries are 2 x 4P/N (fused and DeepSpeed's own
                optimizers: none); stages 1-2 hold the whole d*P parameters, stage 3 none gathered
  stage 1-2     whole parameters d*P; gradients in backward whole at stage 1; at stage 2, once the first
                bucket is reduced, the gradient partition d*P/N, two reduce buffers (overlap_comm) and the
                gradients of the bucket being filled (3 x reduce_bucket_size elements; with full checkpointing
                ranks 0 / 1 of the tiny model measured 1.7% / 2.8% more: the buckets are partition-dependent)
  stage 3       gradients in backward 1/N; the parameter partition d*P/N and the flat gradient-partition
                buffer 4P/N (fp32 runs; bf16: 2P/N) from the start, plus the reduce bucket (reduce_bucket_size elements,
                accelerate's "auto" = hidden^2); in steady forward / backward every parameter stays
                gathered while the model has fewer elements than stage3_max_reuse_distance (1e9 by
                default: DeepSpeed keeps a parameter it will use again within that many), else the
                largest module's parameters and gradients (2x) are gathered at a time

Measured on CPU against `hfscale profile` inside 2 ranks (tiny Gemma 3, fp32 and bf16, forloop AdamW):
within 0.003% on the steady peaks of ZeRO-1, 2 and 3 and with offload without checkpointing, and on ZeRO-3
every:2; ZeRO-2 with checkpointing or gradient accumulation -0.2% to -7.5% (rank 1 holds more in backward
than rank 0: per-rank partition effects not modelled); all in benchmarks/results/step_peak.md.
Step 1 of ZeRO-3 releases parameters after use (nothing is traced yet): none gathered at the peaks.
CPU offload (DeepSpeedCPUAdam, in place): AdamW's moments, the master and fp32 gradient partitions
(and at stage 3 the parameter partition, at stages 1-2 an fp32 staging buffer of the largest parameter)
move to the host (`offloaded_bytes`); stages 1-2 keep a d*P/N gradient partition and a d-byte staging
buffer of the largest parameter on the device. On a CPU host both sides are one memory: measured there
against device + offloaded bytes. What is not measured: GPUs (allocator, CUDA kernels), models large
enough for stage3_max_reuse_distance to release parameters, fused / foreach AdamW under DeepSpeed.
"""

from __future__ import annotations

from .trace import StepTrace

REUSE_DISTANCE = 10**9  # DeepSpeed's stage3_max_reuse_distance default (hfscale's shipped configs keep it)


def _phase_kinds(tr: StepTrace, phase: str, steady: bool, grad_accum: int) -> dict:
    return dict(tr.phases(steady, grad_accum)[phase].breakdown)


HOST = "host_"  # kinds with this prefix live in host memory (CPU offload): not in a device peak


def deepspeed_phases(tr: StepTrace, zero: int, dp: int, offload: str, hidden: int, steady: bool,
                     grad_accum: int = 1, adamw: str = "fused") -> dict[str, dict[str, int]]:
    """{phase: {kind: bytes}} per rank under DeepSpeed ZeRO `zero` over `dp` ranks (see the module docstring);
    with offload, what lives on the host is under `host_*` kinds."""
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
            # step 1 releases each module's parameters after use: at the forward peak (the loss) and the backward
            # peak (its start) none were gathered on the measured rows
            kinds["parameters"] = (d * P if P <= REUSE_DISTANCE else 2 * tr.largest_module_param_bytes) if steady else 0
        else:
            kinds["parameters"] = k.get("parameters", 0)
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


__all__ = ["HOST", "REUSE_DISTANCE", "deepspeed_phases", "split_host"]
