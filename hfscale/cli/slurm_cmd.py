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
    # defaults come from SLURM's variables, read when the command runs (a malformed one is named then)
    p.add_argument("--nodelist", help="hosts, SLURM hostlist syntax (default: $SLURM_JOB_NODELIST)")
    p.add_argument("--gpus-per-node", type=int, help="default: $SLURM_GPUS_ON_NODE")
    p.add_argument("--node-rank", type=int, help="this node's rank (default: $SLURM_NODEID)")
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--dry-run", action="store_true", help="print every node's command and exit")
    p.add_argument("script", nargs="*", help="the training script and its arguments (after --)")
    p.set_defaults(run=run)


def run(args) -> int:
    import shlex

    from ..util.errors import HfscaleError
    from ..scale.slurm import dry_run, env_int, env_nodelist, expand_hostlist, node_command

    env = os.environ  # the edge: SLURM's variables are read here, only for what no flag gave
    nodes = expand_hostlist(args.nodelist) if args.nodelist else env_nodelist(env)
    if not nodes:
        raise HfscaleError("no allocation: pass --nodelist 'gpu[01-04]' or run inside a SLURM job")
    gpus = args.gpus_per_node if args.gpus_per_node is not None else (env_int(env, "SLURM_GPUS_ON_NODE") or None)
    if gpus is None:
        raise HfscaleError("GPUs per node unknown: pass --gpus-per-node or request them with #SBATCH --gpus-per-node")
    if args.dry_run:
        for line in dry_run(args.config, args.script, nodes, gpus, args.port):
            print(line)
        return 0
    rank = args.node_rank if args.node_rank is not None else env_int(env, "SLURM_NODEID")
    if rank is None:
        raise HfscaleError("node rank unknown: run under srun (SLURM_NODEID) or pass --node-rank")
    argv = node_command(args.config, args.script, nodes, rank, gpus, args.port)
    print(shlex.join(argv), flush=True)
    os.execvp(argv[0], argv)  # replace this process: signals from SLURM reach accelerate directly
