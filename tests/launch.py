"""Run rapidtrain the way users do in tests: real `torchrun` processes on CPU with gloo."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PRETRAIN = REPO / "rapidtrain" / "pretrain.py"
# The tiny GPT the multi-process tests train: small enough for 2 CPU cores, big enough to have every part.
TINY_GPT_SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64"]
# ... with what parity runs need: no dropout (masks differ by layout), data in-process, no evaluation.
TINY_GPT_PARITY = [*TINY_GPT_SHAPE, "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0",
                   "--eval-iters", "0"]
# The model's own shape: GPT-2's (learned positions, LayerNorm, GELU, biases, tied head) or Llama's (rotary positions,
# RMSNorm, SwiGLU, no biases, an untied head, grouped-query attention): parameters and state that differ in kind.
ARCHITECTURES = {
    "gpt2": [],
    "llama": ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
              "--untie-embeddings-and-output-weights", "--group-query-attention", "--num-query-groups", "2"],
}


def bindable(port: int) -> bool:
    """Whether this host can bind `port` on the loopback interface right now."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# Not the module-level generator: a training run in a test's own process seeds it (random.seed(1234)), and then
# every xdist worker draws the same ports in the same order (seen on a GPU host: 7 of 8 workers' launches failed).
_PORTS = random.SystemRandom()


def free_port() -> int:
    """A free TCP port below the kernel's ephemeral range, so that no outgoing connection (gloo opens many between
    the ranks of the tests running beside this one) takes it between this check and torchrun's bind."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    for _ in range(100 if low > 20_000 else 0):
        port = _PORTS.randrange(15_000, low)
        if bindable(port):
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_env(extra: dict[str, str] | None = None, nproc: int = 1) -> dict[str, str]:
    env = dict(os.environ)
    # Share the cores among the ranks: oversubscribed threads make multi-rank CPU runs many times slower.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # the suite's own parallel workers
    env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) // (nproc * workers)))
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


# torchrun's function mode (`--run-path --start-method fork`) under an agent that has imported the training stack
# first: each rank is forked from the agent instead of starting Python and importing torch, torch._dynamo (which
# the optimizer's and DDP's first calls import), rapidtrain and DeepSpeed again. That import is most of a tiny
# run's time: a 2-rank, 3-iteration pretraining took 7.3 CPU-s launched plainly and 3.9 warm. It is still torchrun
# (its parser, agent, rendezvous, environment and exit handling) and each rank runs the script as `python -u
# script` would. Parity and composition tests launch warm; tests whose subject is how users launch, or the
# process itself (signals, faults, exits, README blocks, launch scripts), launch the plain way.
WARM_IMPORTS = ("torch._dynamo", "rapidtrain.pretrain")
DEEPSPEED_IMPORTS = ("deepspeed", "rapidtrain.parallel.deepspeed")


def warm_agent(args: list[str]) -> list[str]:
    """`python -c` that imports what the ranks will, then runs torchrun's main on the arguments that follow."""
    # DeepSpeed (5 s to import) only for launches that name it: in a flag, or in a runs file's argument lists.
    mentioned = " ".join(args) + "".join(Path(arg).read_text() for arg in args
                                         if arg.endswith(".json") and Path(arg).is_file())
    modules = WARM_IMPORTS + (DEEPSPEED_IMPORTS if "deepspeed" in mentioned or "zero" in mentioned else ())
    # gc.freeze: what an entry point does after its imports (rapidtrain/core/process.py); forked ranks inherit it,
    # and the collector's walks no longer touch (and copy) the pages they share with the agent.
    return [sys.executable, "-c",
            f"import gc, {', '.join(modules)}; gc.freeze(); from torch.distributed.run import main; main()"]


def torchrun(nproc: int, script: str | Path, args: list[str], *, timeout: int = 600,
             env: dict[str, str] | None = None, extra_torchrun: list[str] | None = None,
             check: bool = True, warm: bool = False) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --nproc-per-node N script args`; output captured as text. `warm`: the ranks
    are forked from an agent that has imported the training stack (WARM_IMPORTS above)."""
    agent = warm_agent(args) if warm else [sys.executable, "-m", "torch.distributed.run"]
    mode = ["--run-path", "--start-method", "fork"] if warm else []
    # Unbuffered as `python -u` leaves a plain launch's ranks: forked ranks share the agent's stdout.
    unbuffered = {"PYTHONUNBUFFERED": "1"} if warm else {}
    for _ in range(3):  # a port taken between the check and the bind (EADDRINUSE) fails before any work: retried
        command = [*agent, f"--nproc-per-node={nproc}", f"--master-port={free_port()}", *mode,
                   *(extra_torchrun or []), str(script), *args]
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                                env=child_env({**unbuffered, **(env or {})}, nproc), cwd=REPO)
        if result.returncode == 0 or "EADDRINUSE" not in result.stdout + result.stderr:
            break
    if check and result.returncode != 0:
        raise AssertionError(f"torchrun failed "
                             f"({result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}")
    return result


def pretrain(nproc: int, args: list[str], script: str | Path = PRETRAIN, **kwargs) -> subprocess.CompletedProcess:
    return torchrun(nproc, script, args, **kwargs)


def read_losses(path: str | Path) -> dict[int, float]:
    """The exact per-iteration losses written by --loss-log-file (later lines win, as after a resume)."""
    losses: dict[int, float] = {}
    for line in Path(path).read_text().splitlines():
        iteration, value = line.split()[:2]
        losses[int(iteration)] = float.fromhex(value)
    return losses


def read_grad_norms(path: str | Path) -> dict[int, float]:
    """The exact per-iteration global gradient norms of --loss-log-file (4th column; "-" when none)."""
    norms: dict[int, float] = {}
    for line in Path(path).read_text().splitlines():
        fields = line.split()
        if len(fields) > 3 and fields[3] != "-":
            norms[int(fields[0])] = float.fromhex(fields[3])
    return norms


def read_extra(path: str | Path, name: str) -> dict[int, float]:
    """An extra value of --loss-log-file (`name=float.hex` columns, e.g. load_balancing_loss) per iteration."""
    values: dict[int, float] = {}
    for line in Path(path).read_text().splitlines():
        fields = line.split()
        for field in fields[4:]:
            key, _, value = field.partition("=")
            if key == name:
                values[int(fields[0])] = float.fromhex(value)
    return values


def relative_difference(a: dict[int, float], b: dict[int, float]) -> float:
    assert a.keys() == b.keys(), f"different iterations: {sorted(a)} vs {sorted(b)}"
    return max(abs(a[k] - b[k]) / max(abs(b[k]), 1e-12) for k in a)


def spawn_ranks(worker: Callable[..., None], *args: object, nprocs: int = 2) -> None:
    """`torch.multiprocessing.spawn(worker, args, nprocs)` whose ranks end as rapidtrain's do: a rank whose worker
    returned exits without the interpreter's finalization (rapidtrain/core/process.py says why: a gloo thread that
    drops a finished collective during finalization aborts a rank that passed, SIGABRT, "terminate called without
    an active exception": CI stop 51, a tensor-parallel MLA test). A worker's exception is reported as spawn does."""
    import torch.multiprocessing

    torch.multiprocessing.spawn(_ends_without_finalization, args=(worker, *args), nprocs=nprocs)


def _ends_without_finalization(rank: int, worker: Callable[..., None], *args: object) -> None:
    from rapidtrain.core.process import end_process

    worker(rank, *args)
    end_process(0)
