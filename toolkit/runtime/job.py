"""Where a rank stands in its job (RankEnv, read from any launcher: torchrun, deepspeed, accelerate, srun) and the
job's TCPStore, which the health check and the training watchdog use as their side channel."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

from toolkit.errors import UserInputError

# Set by `dmt health --nproc`, which hosts the TCPStore itself so that it outlives any rank.
STORE_HOSTED_ENV = "DMT_HEALTH_STORE_HOSTED"
# The node name a rank reports; defaults to the hostname (containers that share one hostname can set it).
HOSTNAME_ENV = "DMT_HEALTH_HOSTNAME"


@dataclass(frozen=True)
class RankEnv:
    """One rank's place in the job, as the launcher announced it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None
    master_addr: str
    master_port: int
    host: str
    agent_store: bool
    """The launcher (torchrun's agent, or `dmt health --nproc`) hosts the TCPStore; otherwise rank 0 does."""


def _int(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name)
    if value is None or value == "":
        return None
    if not value.isdigit():
        raise UserInputError(name, f"must be a non-negative integer, got '{value}'")
    return int(value)


def rank_env(environ: Mapping[str, str] | None = None) -> RankEnv | None:
    """torchrun / deepspeed / accelerate (RANK, WORLD_SIZE, ...) or srun (SLURM_PROCID, ...); None: no launcher."""
    environ = os.environ if environ is None else environ
    if "RANK" in environ and "WORLD_SIZE" in environ:
        rank, world = _int(environ, "RANK"), _int(environ, "WORLD_SIZE")
        local = _int(environ, "LOCAL_RANK")
        local_world = _int(environ, "LOCAL_WORLD_SIZE")
        if local_world is None:  # the deepspeed launcher says LOCAL_SIZE
            local_world = _int(environ, "LOCAL_SIZE")
    elif "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        rank, world = _int(environ, "SLURM_PROCID"), _int(environ, "SLURM_NTASKS")
        local = _int(environ, "SLURM_LOCALID")
        per_node = environ.get("SLURM_NTASKS_PER_NODE", "")
        local_world = int(per_node) if per_node.isdigit() else None  # "4(x2),2" forms: nodes differ, no single answer
    else:
        return None
    if world < 1 or rank >= world:
        raise UserInputError("RANK", f"rank {rank} does not fit world size {world}")
    if world > 1 and "MASTER_ADDR" not in environ:
        raise UserInputError("MASTER_ADDR", "not set: export the address of rank 0's node (the generated SLURM script does)")
    return RankEnv(rank=rank, world_size=world, local_rank=local if local is not None else 0, local_world_size=local_world,
                   master_addr=environ.get("MASTER_ADDR", "127.0.0.1"), master_port=_int(environ, "MASTER_PORT") or 29500,
                   host=environ.get(HOSTNAME_ENV) or socket.gethostname(),
                   agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or environ.get(STORE_HOSTED_ENV) == "1")


def connect_store(env: RankEnv, timeout_s: float, master: bool):
    """The job's TCPStore at MASTER_ADDR:MASTER_PORT: rank 0 hosts it unless a launcher already does."""
    from torch.distributed import TCPStore

    try:
        return TCPStore(env.master_addr, env.master_port, None, master, timedelta(seconds=timeout_s),
                        wait_for_workers=False, multi_tenant=master)
    except (RuntimeError, OSError) as exc:  # DistNetworkError / DistStoreError: the address is what the user can fix
        what = "cannot listen on" if master else f"no TCPStore answered within {timeout_s:.0f} s at"
        raise UserInputError("MASTER_ADDR", f"{what} {env.master_addr}:{env.master_port} (MASTER_PORT); "
                                            f"{str(exc).splitlines()[0][:160]}") from exc
