"""Multi-node launches under SLURM: one `accelerate launch` per node, machine rank and main address
taken from the allocation. `recipes/slurm/multinode.sbatch` calls `node_command` on every node through
srun; `hfscale slurm --dry-run` prints the same commands for a given allocation without running them.
"""

from __future__ import annotations

import re
import shlex

from .errors import HfscaleError


def expand_hostlist(spec: str) -> list[str]:
    """SLURM hostlist syntax -> host names: 'gpu[01-03,07],login1' -> gpu01 gpu02 gpu03 gpu07 login1."""
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", spec.strip()):
        m = re.fullmatch(r"([^\[]*)\[([^\]]+)\](.*)", part)
        if not m:
            hosts.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for r in ranges.split(","):
            if "-" in r:
                lo, hi = r.split("-", 1)
                if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
                    raise HfscaleError(f"bad hostlist range {r!r} in {spec!r}")
                hosts += [f"{prefix}{i:0{len(lo)}d}{suffix}" for i in range(int(lo), int(hi) + 1)]
            elif r.isdigit():
                hosts.append(f"{prefix}{r}{suffix}")
            else:
                raise HfscaleError(f"bad hostlist entry {r!r} in {spec!r}")
    if not hosts:
        raise HfscaleError(f"empty hostlist {spec!r}")
    return hosts


def node_command(config: str, script: list[str], nodes: list[str], node_rank: int, gpus_per_node: int,
                 port: int = 29500) -> list[str]:
    """The exact `accelerate launch` argv for one node of the allocation."""
    if gpus_per_node < 1:
        raise HfscaleError("--gpus-per-node must be at least 1")
    if not 0 <= node_rank < len(nodes):
        raise HfscaleError(f"node rank {node_rank} outside the {len(nodes)}-node allocation")
    if not script:
        raise HfscaleError("give the training script after --, e.g. -- recipes/train_clm.py --config ...")
    return ["accelerate", "launch", "--config_file", config,
            "--num_machines", str(len(nodes)), "--num_processes", str(len(nodes) * gpus_per_node),
            "--machine_rank", str(node_rank), "--main_process_ip", nodes[0], "--main_process_port", str(port),
            *script]


def dry_run(config: str, script: list[str], nodelist: str, gpus_per_node: int, port: int = 29500) -> list[str]:
    nodes = expand_hostlist(nodelist)
    return [f"[{host}] " + shlex.join(node_command(config, script, nodes, rank, gpus_per_node, port))
            for rank, host in enumerate(nodes)]
