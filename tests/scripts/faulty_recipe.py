"""Run a training recipe with a fault injected, as an OOM killer or a lost node would strike:

    accelerate launch ... tests/scripts/faulty_recipe.py kill@step:5:1 recipes/train_clm.py --config ...

`kill@POINT:STEP:RANK` SIGKILLs rank RANK at POINT ("step": after that optimizer step; "save": after
it wrote its shard of that step's checkpoint) through hfscale.train.state.FAULT_HOOKS, the test seam
the step loop and the checkpoint writer call; production code reads no environment for it."""

import os
import runpy
import signal
import sys

from hfscale.train.state import FAULT_HOOKS

spec, recipe, *args = sys.argv[1:]


def kill_at(point, step, rank):
    if spec == f"kill@{point}:{step}:{rank}":
        os.kill(os.getpid(), signal.SIGKILL)


FAULT_HOOKS.append(kill_at)
sys.argv = [recipe, *args]
runpy.run_path(recipe, run_name="__main__")
