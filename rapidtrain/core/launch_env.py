"""The environment a launcher hands a rank (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), checked before
the first collective: inconsistent numbers or an unusable master address end in one message and exit 2, never in a
hang (a RANK at or above WORLD_SIZE waits forever for peers that do not exist) or a DistNetworkError traceback."""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Mapping, MutableMapping

from rapidtrain.core.errors import UserError

# What torchrun (or srun/mpirun scripts written for env://) set for each rank; all of them make a launched rank.
LAUNCHED_RANK = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


class LaunchEnvironmentError(UserError, RuntimeError):
    """The launcher's variables contradict each other or point at an unusable master."""

    every_rank = True  # a rank's own numbers: the rank that has them says so (rank 0 may be fine)


def launched_rank(env: Mapping[str, str]) -> bool:
    """This process is one rank of a launch: torchrun's, or another launcher that set every env:// variable."""
    return "TORCHELASTIC_RUN_ID" in env or all(name in env for name in LAUNCHED_RANK)


def drop_stale_rank_variables(env: MutableMapping[str, str]) -> list[str]:
    """Outside a launch, rank variables are leftovers (an `export WORLD_SIZE=...` from an earlier session): removed
    so that neither the plan nor torchrun's ranks read them; returns them as NAME=value for a note."""
    if launched_rank(env):
        return []
    stale = [f"{name}={env[name]}" for name in RANK_VARIABLES if name in env]
    for name in RANK_VARIABLES:
        env.pop(name, None)
    return stale


def _integer(env: Mapping[str, str], name: str) -> int | None:
    if name not in env:
        return None
    value = env[name].strip()
    if not value.lstrip("-").isdigit():
        raise LaunchEnvironmentError(f"{name}={env[name]!r} in the environment is not a whole number; the launcher "
                                     "that starts the ranks sets it (torchrun does: start the run with it).")
    return int(value)


def check_rank_environment(env: Mapping[str, str]) -> None:
    """RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE agree; MASTER_ADDR resolves; MASTER_PORT is a port."""
    world, rank = _integer(env, "WORLD_SIZE"), _integer(env, "RANK")
    local, local_world = _integer(env, "LOCAL_RANK"), _integer(env, "LOCAL_WORLD_SIZE")
    fix = ("These come from the launcher: start the ranks with torchrun (or the `rapidtrain` command), or unset "
           "stale values (`unset RANK WORLD_SIZE LOCAL_RANK`).")
    if world is None:
        return
    if world < 1:
        raise LaunchEnvironmentError(f"WORLD_SIZE={world} in the environment: a run has at least one rank. {fix}")
    if rank is None:
        raise LaunchEnvironmentError(f"WORLD_SIZE={world} is set but RANK is not: each rank needs its number. {fix}")
    if not 0 <= rank < world:
        raise LaunchEnvironmentError(f"RANK={rank} with WORLD_SIZE={world}: ranks are numbered 0 to {world - 1}, so "
                                     f"this rank would wait forever for peers that do not exist. {fix}")
    if local is not None and local_world is not None and not 0 <= local < local_world:
        raise LaunchEnvironmentError(f"LOCAL_RANK={local} with LOCAL_WORLD_SIZE={local_world}: local ranks are "
                                     f"numbered 0 to {local_world - 1}. {fix}")
    if local_world is not None and local_world > world:
        raise LaunchEnvironmentError(f"LOCAL_WORLD_SIZE={local_world} exceeds WORLD_SIZE={world}. {fix}")
    check_master_address(env.get("MASTER_ADDR"), env.get("MASTER_PORT"))


def check_master_address(address: str | None, port: str | int | None) -> None:
    """MASTER_ADDR names a host this machine can resolve, MASTER_PORT a TCP port."""
    if port is not None and not (str(port).isdigit() and 0 < int(port) < 65536):
        raise LaunchEnvironmentError(f"MASTER_PORT={port!r} is not a TCP port (1-65535). Set MASTER_PORT to a free "
                                     "port on the master node.")
    if not address:
        return
    try:
        socket.getaddrinfo(address, None)
    except socket.gaierror as error:
        raise LaunchEnvironmentError(f"MASTER_ADDR={address} cannot be resolved ({error.strerror}): give the master "
                                     "node's address as every node can reach it (an IP address, or a host name "
                                     "in DNS or /etc/hosts).") from None


def check_master_port_free(port: int) -> None:
    """On the node that serves the rendezvous: the port can be listened on (torchrun would fail with a
    DistNetworkError traceback after the ranks' set-up otherwise)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("", port))
        except OSError as error:
            if error.errno != errno.EADDRINUSE:
                raise
            raise LaunchEnvironmentError(
                f"MASTER_PORT={port} is in use on this node (another run, or a process of an earlier one still "
                "alive): torchrun serves the rendezvous there. Give another MASTER_PORT, or stop what holds it "
                f"(`ss -ltnp 'sport = :{port}'` shows it).") from None


def environment_problems(env: Mapping[str, str] | None = None) -> None:
    """Every check of a rank's environment, before the process group starts (rank 0 also serves the store when
    no torchrun agent does)."""
    env = os.environ if env is None else env
    check_rank_environment(env)
    serves_store = env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and env.get("RANK") == "0"
    if serves_store and env.get("MASTER_PORT", "").isdigit() and _is_local(env.get("MASTER_ADDR", "")):
        check_master_port_free(int(env["MASTER_PORT"]))


def _is_local(address: str) -> bool:
    if address in ("", "localhost", "127.0.0.1", "::1", socket.gethostname()):
        return True
    try:
        with socket.socket() as probe:
            probe.bind((address, 0))
        return True
    except OSError:
        return False
