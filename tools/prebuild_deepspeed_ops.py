"""Build DeepSpeed's CPU ops once, at install time, instead of at the first run that needs them.

On a CPU host DeepSpeed JIT-compiles its C++ ops the first time a run asks for them: `cpu_adam` (CPU offload),
`deepspeed_shm_comm` (its shared-memory collectives), `async_io` and `pin_memory` (NVMe offload). Measured on a
2-core AVX512 host: 31 s, 18 s and 117 s idle (53, 61 and 222 s shared with other jobs; an AVX2-only host took ~15
min for async_io), and two ranks of one launch wait on each other's build lock. DeepSpeed documents building ops
ahead of time (DS_BUILD_OPS at pip install) as the alternative to JIT; this does it through DeepSpeed's own op
builders, into the same JIT cache the runs load from
(TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions). An op the host cannot build (async_io without libaio)
is reported and skipped: the runs that need it say so themselves.

    python tools/prebuild_deepspeed_ops.py          # `make install` runs it
"""

from __future__ import annotations

import sys
import time

OPS = ("CPUAdamBuilder", "ShareMemCommBuilder", "AsyncIOBuilder", "PinMemoryBuilder")


def main() -> int:
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    for name in OPS:
        t0 = time.perf_counter()
        builder = acc.create_op_builder(name)
        if builder is None or not builder.is_compatible(verbose=False):
            print(f"deepspeed op {name}: not buildable on this host (skipped)", flush=True)
            continue
        builder.load(verbose=False)
        print(f"deepspeed op {builder.NAME}: ready ({time.perf_counter() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
