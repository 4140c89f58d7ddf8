"""Multi-node launches under SLURM: one `accelerate launch` per node, machine rank and main address
taken from the allocation. `recipes/slurm/multinode.sbatch` calls `node_command` on every node through
srun; `hfscale slurm --dry-run` prints the same commands for a given allocation without running them.
"""

from __future__ import annotations

import re
import shlex
from typing import Mapping

from ..util.errors import HfscaleError

# a hostlist part: name, or name[ranges]suffix (brackets balanced, no nesting)
_BRACKETED = re.compile(r"([^\[\]]*)\[([^\[\]]+)\]([^\[\]]*)")


def expand_hostlist(spec: str) -> list[str]:
    """SLURM hostlist syntax -> host names: 'gpu[01-03,07],login1' -> gpu01 gpu02 gpu03 gpu07 login1."""
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", spec.strip()):
        m = _BRACKETED.fullmatch(part)
        if not m:
            if "[" in part or "]" in part:
                raise HfscaleError(f"bad hostlist entry {part!r} in {spec!r} (one balanced [ranges] group per name)")
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


def env_int(env: Mapping[str, str], name: str) -> int | None:
    """An integer SLURM variable (SLURM_NODEID, SLURM_GPUS_ON_NODE, SLURM_NNODES): None if unset or empty."""
    raw = env.get(name, "").strip()
    if not raw:
        return None
    if not re.fullmatch(r"[0-9]+", raw):
        raise HfscaleError(f"{name}={env[name]!r} in the environment is not a non-negative integer; "
                           f"fix or unset it (SLURM sets it inside a job), or pass the value as a flag")
    return int(raw)


def env_nodelist(env: Mapping[str, str]) -> list[str] | None:
    """The hosts of SLURM_JOB_NODELIST (None if unset), checked against SLURM_NNODES when that is set."""
    spec = env.get("SLURM_JOB_NODELIST", "").strip()
    if not spec:
        return None
    try:
        nodes = expand_hostlist(spec)
    except HfscaleError as e:
        raise HfscaleError(f"SLURM_JOB_NODELIST in the environment: {e}; fix or unset it, or pass --nodelist") from None
    n = env_int(env, "SLURM_NNODES")
    if n is not None and n != len(nodes):
        raise HfscaleError(f"SLURM_NNODES={n} but SLURM_JOB_NODELIST={spec!r} names {len(nodes)} nodes; "
                           "fix the environment or pass --nodelist")
    return nodes


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


def dry_run(config: str, script: list[str], nodelist: str | list[str], gpus_per_node: int, port: int = 29500) -> list[str]:
    """Every node's command, prefixed by its host; `nodelist` is hostlist syntax or the expanded hosts."""
    nodes = expand_hostlist(nodelist) if isinstance(nodelist, str) else list(nodelist)
    return [f"[{host}] " + shlex.join(node_command(config, script, nodes, rank, gpus_per_node, port))
            for rank, host in enumerate(nodes)]
