"""Can torch's context parallel run on a CPU host? Two processes over gloo, one causal SDPA of 128 tokens split on the
sequence, against the same attention in one process.

    python -m torch.distributed.run --nproc_per_node 2 benchmarks/scripts/cp_cpu_probe.py            # the flash kernel
    CP_MATH=1 python -m torch.distributed.run --nproc_per_node 2 benchmarks/scripts/cp_cpu_probe.py   # the math kernel

Measured (torch 2.13.0+cpu, 2026-12-06): flash -> NotImplementedError "Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy registered" (torch's ring
attention covers the CUDA flash / efficient / cuDNN kernels only); math -> RuntimeError "aten.add.Tensor got mixed
torch.Tensor and DTensor". So CP stays configured-only here (docs/fsdp2.md)."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor.experimental import context_parallel  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

mesh = init_device_mesh("cpu", (world,))
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, 128, 16, generator=g) for _ in range(3))
ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
qc, kc, vc = q.clone(), k.clone(), v.clone()
try:
    with context_parallel(mesh, buffers=[qc, kc, vc], buffer_seq_dims=[2, 2, 2]):
        with sdpa_kernel(SDPBackend.MATH if os.environ.get("CP_MATH") else SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True)
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    local = out.to_local() if hasattr(out, "to_local") else out
    (full,) = context_parallel_unshard(mesh, [local], [2])
    print(f"rank {rank}: CP ran on {qc.shape[2]} of 128 tokens; max |out - 1 process| = {(full - ref).abs().max().item():.3e}")
except Exception as e:  # the finding is the error itself
    print(f"rank {rank}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
dist.destroy_process_group()
