"""Launched by tests/test_exit.py under `accelerate launch --config_file accelerate_configs/zero2.yaml` (DeepSpeed over
gloo, 2 CPU processes): the end of a run and nothing else, so the exit race can be repeated cheaply.

    python tests/scripts/exit_probe.py ENDING OUT_DIR

Each rank joins the process group the way ENDING's runs do, does what the end of a run does (a reduce on the world
group, then an all_reduce of a fresh Python tensor on each of 4 more gloo groups that the script still holds, as
DeepSpeed holds its groups), writes OUT_DIR/reached_rank{RANK}, and ends:

    recipe   hfscale.make_accelerator (what every recipe's start_run builds), then exit_rank: the recipes', proof's and
             profile's ending
    trainer  accelerate's own Accelerator (as HF Trainer builds it), hfscale.training_arguments_kwargs called as a
             Trainer script does, then a normal interpreter exit: the atexit teardown it registers is the only guard
    bare     the same as trainer without hfscale: the old ending, for measuring how often it aborts (not in the test)

The last collectives leave each group's gloo worker holding a finished work whose tensors were made in Python; at a
normal exit that worker can take the GIL during interpreter finalization and abort the rank (SIGABRT, "terminate
called without an active exception"): see hfscale.scale.runtime.exit_rank.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ending, out = sys.argv[1], Path(sys.argv[2])
if ending == "recipe":
    from hfscale.scale.runtime import make_accelerator

    accelerator = make_accelerator()
else:
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    if ending == "trainer":
        from hfscale.scale.presets import PRESETS
        from hfscale.scale.runtime import training_arguments_kwargs

        training_arguments_kwargs(PRESETS["zero2"])
import deepspeed  # noqa: E402

assert accelerator.num_processes == 2 and deepspeed.comm.is_initialized() and dist.get_backend() == "gloo"
groups = [dist.new_group([0, 1]) for _ in range(4)]
total = accelerator.reduce(torch.ones(4096), reduction="sum")
assert float(total[0]) == 2.0
for g in groups:
    dist.all_reduce(torch.ones(1 << 14), group=g)
(out / f"reached_rank{os.environ['RANK']}").write_text(ending)
if ending == "recipe":
    from hfscale.scale.runtime import exit_rank

    exit_rank(0)
sys.exit(0)
