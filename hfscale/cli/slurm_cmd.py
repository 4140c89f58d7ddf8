"""`hfscale slurm`: the per-node accelerate commands of a SLURM allocation (what multinode.sbatch runs)."""

from __future__ import annotations

import os


def add_parser(sub):
    import argparse

    p = sub.add_parser("slurm", help="per-node accelerate launch commands for a SLURM allocation",
                       description="Print (--dry-run) or run the `accelerate launch` command of each node of a SLURM "
                       "allocation. Inside a job the nodes, node rank and GPUs come from SLURM_* variables.",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="examples:\n  hfscale slurm --dry-run --nodelist 'gpu[01-04]' --gpus-per-node 8 "
                       "--config accelerate_configs/multinode_zero3.yaml -- train.py --lr 1e-4\n"
                       "  srun --ntasks-per-node=1 hfscale slurm --config accelerate_configs/multinode_zero3.yaml -- train.py")
    p.add_argument("--config", required=True)
    p.add_argument("--nodelist", default=os.environ.get("SLURM_JOB_NODELIST"), help="default: $SLURM_JOB_NODELIST")
    p.add_argument("--gpus-per-node", type=int, default=int(os.environ.get("SLURM_GPUS_ON_NODE", "0") or 0) or None)
    p.add_argument("--node-rank", type=int, default=int(os.environ["SLURM_NODEID"]) if "SLURM_NODEID" in os.environ else None)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--dry-run", action="store_true", help="print every node's command and exit")
    p.add_argument("script", nargs="*", help="the training script and its arguments (after --)")
    p.set_defaults(run=run)


def run(args) -> int:
    import shlex

    from ..errors import HfscaleError
    from ..slurm import dry_run, expand_hostlist, node_command

    if not args.nodelist:
        raise HfscaleError("no allocation: pass --nodelist 'gpu[01-04]' or run inside a SLURM job")
    if not args.gpus_per_node:
        raise HfscaleError("GPUs per node unknown: pass --gpus-per-node or request them with #SBATCH --gpus-per-node")
    if args.dry_run:
        for line in dry_run(args.config, args.script, args.nodelist, args.gpus_per_node, args.port):
            print(line)
        return 0
    if args.node_rank is None:
        raise HfscaleError("node rank unknown: run under srun (SLURM_NODEID) or pass --node-rank")
    argv = node_command(args.config, args.script, expand_hostlist(args.nodelist), args.node_rank, args.gpus_per_node, args.port)
    print(shlex.join(argv), flush=True)
    os.execvp(argv[0], argv)  # replace this process: signals from SLURM reach accelerate directly
