"""One row of the trace check: measure two real training steps of a tiny architecture (first, in this fresh
process: a second real run in one process counts one hidden state fewer), then trace it on fake tensors.
Prints JSON {"real": [step1, step2], "fake": {"step1": ..., "steady": ...}}, phase -> bytes."""

import json
import sys

from hfscale.plan.trace import measure_steps, trace_step
from hfscale.testing.zoo import ARCHITECTURES

row = json.loads(sys.argv[1])
config = ARCHITECTURES[row.pop("arch")]()
real = measure_steps(config, **row)
tr = trace_step(config, **row)
ga = row.get("grad_accum", 1)
print(json.dumps({"real": [{k: v.bytes for k, v in step.items()} for step in real],
                  "fake": {name: {k: v.bytes for k, v in tr.phases(steady, ga).items()}
                           for name, steady in (("step1", False), ("steady", True))}}))
