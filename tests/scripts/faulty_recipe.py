"""Run a training recipe with a fault injected, as an OOM killer or a lost node would strike:

    accelerate launch ... tests/scripts/faulty_recipe.py kill@step:5:1 recipes/train_clm.py --config ...

`kill@POINT:STEP:RANK` SIGKILLs rank RANK at POINT ("step": after that optimizer step; "save": after
it wrote its shard of that step's checkpoint) through hfscale.train.state.FAULT_HOOKS, the test seam
the step loop and the checkpoint writer call; production code reads no environment for it. `usr1@POINT:STEP:RANK`
sends that rank SIGUSR1 there instead (the ranks agree on the stop in the next step's collective).
`record@DIR` (alone or after a comma) appends every sequence index each rank reads, as
`{"step", "rank", "world", "idx"}` lines, to DIR/indices.jsonl (the data order the resume tests compare), and
each rank's exit status to DIR/exit_rank{RANK}.txt (the launcher reports only its own). `unheld` turns
hfscale.scale.runtime.hold_process_groups off (benchmarks/failed_save_exit.py measures the deadlock it prevents)."""

import json
import os
import runpy
import signal
import sys

import hfscale.data.sampler as batching
from hfscale.train.state import FAULT_HOOKS

spec, recipe, *args = sys.argv[1:]
specs = spec.split(",")


def kill_at(point, step, rank):
    if f"usr1@{point}:{step}:{rank}" in specs:  # a stop request to this rank alone: all stop after the next step
        os.kill(os.getpid(), signal.SIGUSR1)
    if f"kill@{point}:{step}:{rank}" in specs:
        os.kill(os.getpid(), signal.SIGKILL)


FAULT_HOOKS.append(kill_at)
if "unheld" in specs:
    import hfscale.scale.runtime as runtime

    runtime.hold_process_groups = lambda: None  # looked up at call time by every caller
record = next((s[len("record@"):] for s in specs if s.startswith("record@")), None)
if record:
    plain = batching.rank_indices

    def recorded(plan, n, seed, step, micro, rank):
        idx = plain(plan, n, seed, step, micro, rank)
        with open(os.path.join(record, "indices.jsonl"), "a") as f:  # one short line per append: no interleaving
            f.write(json.dumps({"step": step + 1, "rank": rank, "world": plan.world, "idx": idx.tolist()}) + "\n")
        return idx

    batching.rank_indices = recorded  # the step loop imports it from the module at call time
sys.argv = [recipe, *args]
try:  # the recipe's main(), then its own ending (exit_rank), with the status recorded between
    code = runpy.run_path(recipe, run_name="recipe")["main"]()
except SystemExit as e:  # argparse
    code = e.code
if record:
    with open(os.path.join(record, f"exit_rank{os.environ.get('RANK', '0')}.txt"), "w") as f:
        f.write(str(code if isinstance(code, int) else 1))
from hfscale.scale.runtime import exit_rank  # noqa: E402

exit_rank(code)
