"""`hfscale config`: write accelerate YAML + DeepSpeed JSON from a preset, a spec file, or flags."""

from __future__ import annotations

import argparse
from dataclasses import replace

from ..util.errors import ConfigError
from ..scale.load import load_spec
from ..scale.presets import PRESETS
from ..scale.spec import DEVICES, ENGINES, PRECISIONS, RDZV_BACKENDS, SP_ATTENTION, STATE_DICT_TYPES, ZERO_STAGES, ScaleSpec

EXAMPLES = """examples:
  hfscale config zero3                                   # accelerate_configs/zero3.yaml + ds_configs/zero3.json
  hfscale config zero2 --name zero2_16 --num-processes 16 --grad-accum 4
  hfscale config zero3 --name z3_nvme --offload-optimizer nvme --offload-params cpu --nvme-path /local_nvme
  hfscale config multinode_zero3 --num-machines 4 --num-processes 32 --main-process-ip 10.1.0.7
  hfscale config --spec my_setup.yaml --out-accelerate cfg --out-deepspeed cfg
  hfscale config zero3 --name z3_sp4 --sp 4 --num-processes 8 --model gemma-3-27b   # Ulysses SP, heads checked
  hfscale config fsdp2 --name fsdp2_tp4 --tp 4 --num-processes 8
  hfscale config fsdp2 --name fsdp2_keep --no-reshard-after-forward --checkpointing every:2 --state-dict FULL
  hfscale config --all --force                           # regenerate every shipped file

exit codes: 0 written, 2 invalid combination (one line naming the fix; nothing written)
"""


def add_parser(sub):
    p = sub.add_parser(
        "config",
        help="write accelerate YAML and DeepSpeed JSON",
        description="Write an accelerate config (YAML) and its DeepSpeed config (JSON) from a preset, "
        "a spec file, or flags. Presets: " + ", ".join(PRESETS),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("preset", nargs="?", choices=list(PRESETS), help="start from this preset")
    p.add_argument("--all", action="store_true", help="write every preset")
    p.add_argument("--spec", help="a YAML/JSON ScaleSpec file (keys: name, engine, zero, precision, launch, ...)")
    p.add_argument("--name", help="file name stem of the written config (default: the preset's)")
    p.add_argument("--engine", choices=ENGINES)
    p.add_argument("--zero", type=int, choices=ZERO_STAGES, help="ZeRO stage (DeepSpeed)")
    p.add_argument("--offload-optimizer", choices=DEVICES)
    p.add_argument("--offload-params", choices=DEVICES)
    p.add_argument("--nvme-path", help="directory for NVMe offload swap files")
    p.add_argument("--precision", choices=PRECISIONS)
    p.add_argument("--grad-accum", type=int, help="gradient accumulation steps (default: auto)")
    p.add_argument("--clip", type=float, help="gradient clipping norm, 0 = off")
    p.add_argument("--checkpointing", help="off | full | every:K")
    p.add_argument("--num-processes", type=int, help="processes over all machines")
    p.add_argument("--num-machines", type=int)
    p.add_argument("--machine-rank", type=int)
    p.add_argument("--main-process-ip")
    p.add_argument("--main-process-port", type=int)
    p.add_argument("--rdzv-backend", choices=RDZV_BACKENDS)
    p.add_argument("--sp", type=int, help="sequence parallel size (DeepSpeed Ulysses; needs --zero 2/3)")
    p.add_argument("--tp", type=int, help="tensor parallel size (transformers tp_plan; engine ddp or fsdp2)")
    p.add_argument("--cp", type=int, help="context parallel size (torch, engine fsdp2)")
    p.add_argument("--sp-attention", choices=SP_ATTENTION, help="attention kernel under SP (default sdpa)")
    p.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=None,
                   help="fsdp2: free each unit's gathered parameters after its forward (default: on)")
    p.add_argument("--state-dict", choices=STATE_DICT_TYPES, help="fsdp2 checkpoints: SHARDED (torch.distributed.checkpoint, "
                   "resumes on another world size; default) or FULL (gathered on rank 0)")
    p.add_argument("--wrap-class", help="fsdp2: the layer class wrapped as one unit (default: the model's _no_split_modules)")
    p.add_argument("--model", help="check sp / tp / cp against this model's heads (built-in name, config.json or directory)")
    p.add_argument("--out-accelerate", default="accelerate_configs", help="directory for the YAML, created if missing (default: %(default)s)")
    p.add_argument("--out-deepspeed", default="ds_configs", help="directory for the JSON, created if missing (default: %(default)s)")
    p.add_argument("--force", action="store_true", help="overwrite existing files")
    p.add_argument("--print", action="store_true", help="print the files instead of writing them")
    p.set_defaults(run=run)


ZERO_FLAGS = {"zero": "stage", "offload_optimizer": "offload_optimizer", "offload_params": "offload_params", "nvme_path": "nvme_path"}
LAUNCH_FLAGS = ("num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port", "rdzv_backend")
PARALLEL_FLAGS = {"sp": "sp", "tp": "tp", "cp": "cp", "sp_attention": "sp_attention"}
FSDP_FLAGS = {"reshard_after_forward": "reshard_after_forward", "state_dict": "state_dict_type", "wrap_class": "transformer_layer_cls"}
TOP_FLAGS = {"engine": "engine", "precision": "precision", "grad_accum": "gradient_accumulation_steps", "clip": "gradient_clipping", "checkpointing": "gradient_checkpointing", "name": "name"}


def spec_from_args(args) -> ScaleSpec:
    """Preset or spec file, then each flag that was given replaces one field (validated again)."""
    if args.spec:
        base = load_spec(args.spec)
    elif args.preset:
        base = PRESETS[args.preset]
    else:
        base = ScaleSpec(args.name or "custom")
    zero = {f: getattr(args, a) for a, f in ZERO_FLAGS.items() if getattr(args, a) is not None}
    launch = {a: getattr(args, a) for a in LAUNCH_FLAGS if getattr(args, a) is not None}
    top = {f: getattr(args, a) for a, f in TOP_FLAGS.items() if getattr(args, a) is not None}
    engine = args.engine or base.engine
    if args.zero is not None and engine != "deepspeed":
        raise ConfigError(f"--zero {args.zero} is a DeepSpeed ZeRO stage but the engine is {engine}; "
                          "drop --zero or use --engine deepspeed")
    if args.engine and args.engine != "deepspeed" and base.engine == "deepspeed" and (args.preset or args.spec):
        src = f"preset {args.preset}" if args.preset else f"--spec {args.spec}"
        raise ConfigError(f"{src} is a DeepSpeed ZeRO-{base.zero.stage} config and --engine {args.engine} would drop "
                          f"its ZeRO settings; start from `hfscale config {args.engine}` instead")
    par = {f: getattr(args, a) for a, f in PARALLEL_FLAGS.items() if getattr(args, a) is not None}
    fsdp = {f: getattr(args, a) for a, f in FSDP_FLAGS.items() if getattr(args, a, None) is not None}
    if fsdp and engine != "fsdp2":
        flags = ", ".join("--" + a.replace("_", "-") for a, f in FSDP_FLAGS.items() if f in fsdp)
        raise ConfigError(f"{flags} set FSDP2 but the engine is {engine}; start from `hfscale config fsdp2` or drop them")
    if args.num_machines is not None and args.num_machines == 1 and "main_process_ip" not in launch:
        launch["main_process_ip"] = None
    if engine == "fsdp2" and zero:  # FSDP2 shards parameters, gradients and optimizer states: ZeRO-3's semantics
        zero.setdefault("stage", 3)
    # dataclasses.replace re-runs __post_init__, so every combination is validated
    z = replace(base.zero, **zero) if zero else base.zero
    lch = replace(base.launch, **launch) if launch else base.launch
    pl = replace(base.parallel, **par) if par else base.parallel
    fs = replace(base.fsdp, **fsdp) if fsdp else base.fsdp
    return replace(base, zero=z, launch=lch, parallel=pl, fsdp=fs, **top)


def run(args) -> int:
    from ..scale.files import render_config_set, write_config_sets

    if args.all and (args.preset or args.spec):
        raise ConfigError("--all writes every preset; drop the preset name / --spec, or drop --all")
    if args.all:
        specs = list(PRESETS.values())
    else:
        if not (args.preset or args.spec or args.engine or args.zero is not None):
            raise ConfigError(f"name a preset ({', '.join(PRESETS)}), --spec FILE, or --all")
        specs = [spec_from_args(args)]
    if args.model:
        from ..models.builtin import load_config
        from ..scale.parallel import require_model_fits

        for spec in specs:
            require_model_fits(spec.parallel, load_config(args.model), args.model)
    if args.print:
        for spec in specs:
            for path, text in render_config_set(spec, args.out_accelerate, args.out_deepspeed).items():
                print(f"--- {path}\n{text}")
        return 0
    # shipped presets name example paths (e.g. /local_nvme) that need not exist on this host
    written = write_config_sets(specs, args.out_accelerate, args.out_deepspeed, force=args.force, check_paths=not args.all,
                                inputs={args.spec: "--spec"})
    for path in written:
        print(f"wrote {path}")
    return 0
