"""The `rapidtrain` command: launch under torchrun, run a task or a user script, `plan`, `demo-data`.

`rapidtrain FLAGS` checks the flags, then starts `torch.distributed.run` itself (unless it already runs
under torchrun, in which case it runs in place): the built-in pretraining for `--task pretraining`, the
black-box fine-tuning for the Hugging Face tasks, or the script given by `--user-script`.
"""

from __future__ import annotations

import argparse
import os
import runpy
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path

from rapidtrain.core.process import exit_after, pause_collection

pause_collection(__name__ == "__main__")  # until main starts (rapidtrain/core/process.py)

from rapidtrain.config import arguments, plan, resolve, rules, settings  # noqa: E402
from rapidtrain.config.describe import describe_plan  # noqa: E402
from rapidtrain.config.flag_parser import FlagParser  # noqa: E402
from rapidtrain.core.errors import UserError, user_errors  # noqa: E402

PACKAGE_DIR = Path(__file__).resolve().parent
USAGE = """usage:
  rapidtrain FLAGS                       train (torchrun is started for you; see rapidtrain --help)
  rapidtrain --user-script FILE FLAGS    run a white-box script (Finetuner / PreTrainer / Trainer / Engine.compose)
  rapidtrain plan FLAGS [--world-size N] [--device cpu|cuda] [--device-name GPU] [--json]
                       [--entry pretrain_gpt|pretrain_bert|tasks_main]
                                         print what the flags resolve to, start nothing (--device-name, e.g.
                                         "H100", picks the peak FLOP/s that MFU is measured against)
  rapidtrain demo-data [--cache-dir DIR] prepare the built-in demo corpus
  rapidtrain generate --load DIR (--prompt TEXT | --input-file P.jsonl) [--output-file O.jsonl --batch-size B
                       --max-new-tokens N --temperature T --top-k K --top-p P --device D --bf16 --load-in-4bit ...]
                                         continue prompts with a trained built-in GPT (any saved layout) or a
                                         Hugging Face folder (see rapidtrain generate --help)
"""


def under_torchrun() -> bool:
    """A rank of a launch (torchrun's, or one that set every env:// variable); stale WORLD_SIZE/LOCAL_RANK left in
    the environment alone do not make one."""
    from rapidtrain.core.launch_env import launched_rank

    return launched_rank(os.environ)


def entry_script(args: argparse.Namespace) -> Path:
    if args.user_script:
        script = Path(args.user_script)
        if not script.is_file():
            raise UserError(f"--user-script {args.user_script}: no such file. Give the path of a Python file that "
                            "subclasses Finetuner, PreTrainer or Trainer (see templates/).")
        return script
    if args.task == "pretraining":
        return PACKAGE_DIR / "pretrain.py"
    if args.task in arguments.MEGATRON_TASKS:
        return PACKAGE_DIR / "tasks_main.py"
    return PACKAGE_DIR / "finetune.py"


def torchrun_command(args: argparse.Namespace, script: Path, argv: list[str], device_type: str,
                     env: Mapping[str, str] | None = None) -> list[str]:
    """torchrun (through `torchrun_command`'s quiet wrapper) on this node: Rapidformer's environment (NNODES,
    NODE_RANK, MASTER_*), else Slurm's (node count, node id, first host of the node list), else one standalone
    node."""
    from rapidtrain.core.slurm import node_layout

    nodes = node_layout(os.environ if env is None else env)
    nproc = args.nproc_per_node or settings.default_nproc_per_node(device_type) or 1
    command = [sys.executable, "-m", "rapidtrain.cli", TORCHRUN, f"--nproc-per-node={nproc}",
               f"--nnodes={nodes.nnodes}"]
    if nodes.master_addr is None:
        command.append("--standalone")
    else:
        command += [f"--node-rank={nodes.node_rank}", f"--master-addr={nodes.master_addr}",
                    f"--master-port={nodes.master_port}"]
    if args.user_script:  # through rapidtrain.cli, which checks that the script trains something
        return command + ["-m", "rapidtrain.cli", *argv]
    return command + [str(script), *argv]


def run_in_place(script: Path, argv: list[str]) -> None:
    sys.argv = [str(script), *argv]
    runpy.run_path(str(script), run_name="__main__")


def launch_arguments(argv: list[str]) -> argparse.Namespace:
    """The flags; a user script may add its own through extra_args_provider, which only its Engine knows."""
    if any(a == "--user-script" or a.startswith("--user-script=") for a in argv):
        return arguments.build_parser().parse_known_args(argv)[0]
    return arguments.parse_args(argv, entry=entry_of(argv))


def run_user_script_in_place(script: Path, argv: list[str]) -> int:
    from rapidtrain.user_script import UserScriptError, run_user_script

    try:
        run_user_script(script, argv)
    except UserScriptError as error:
        if os.environ.get("RANK", "0") == "0":
            print(error, file=sys.stderr)
        return 2
    return 0


def launch(argv: list[str]) -> int:
    from rapidtrain.core.launch_env import drop_stale_rank_variables

    stale = drop_stale_rank_variables(os.environ)
    if stale:
        print(f"rapidtrain: note: ignoring {', '.join(stale)} left in the environment (no launcher set them; torchrun "
              "sets each rank's own)", file=sys.stderr)
    args = launch_arguments(argv)
    ctx = settings.RunContext.detect(args)
    script = entry_script(args)
    if under_torchrun():
        if args.user_script:
            return run_user_script_in_place(script, argv)
        run_in_place(script, argv)
        return 0
    rules.exit_on_conflicts(args, ctx)
    check_inputs_before_launch(args)
    check_rendezvous_before_launch()
    from rapidtrain.core.shutdown import run_forwarding_signals, stop_signals
    from rapidtrain.core.stopped_run import COMMAND_ENV

    # torchrun in its own session, each stop signal forwarded once, waited for (rapidtrain/core/shutdown.py). The
    # command line goes with it, for the resume line of a stopped run.
    env = dict(os.environ, **{COMMAND_ENV: shlex.join(["rapidtrain", *argv])})
    command = torchrun_command(args, script, argv, ctx.device_type)
    # The same torchrun as a fork of this process, which has imported torch already (core/shutdown.py).
    return run_forwarding_signals(command, env, fork_main=lambda: main(command[command.index(TORCHRUN):]),
                                  signals=stop_signals(args.exit_signal))


def check_inputs_before_launch(args: argparse.Namespace) -> None:
    """What can fail on files is checked here, before torchrun starts its workers: the save folder, and for
    the built-in pretraining the tokenizer and data files (a UserError names the flag or file)."""
    from rapidtrain.checkpoint.save_folder import check_resume_safety, check_save_writable

    check_resume_safety(args.save, args.load, bool(args.finetune))
    if args.save:
        check_save_writable(args.save)
    if args.task == "pretraining" and not args.user_script:
        from rapidtrain.data.inputs import check_pretraining_inputs

        # Pai's SFT idxmap holds negative markers and -100 labels: its ids are not checked against the vocabulary
        tokenizer = tokenizer_settings(args) if args.tokenizer_type and not getattr(args, "idxmap_sft", False) else None
        check_pretraining_inputs(args.data_path, args.data_impl, tokenizer)


def check_rendezvous_before_launch(env: Mapping[str, str] | None = None) -> None:
    """Where torchrun will meet the other nodes: the master address resolves, and on the node that serves the
    rendezvous the port is free (a clear message instead of torchrun's DistNetworkError traceback)."""
    from rapidtrain.core.launch_env import check_master_address, check_master_port_free
    from rapidtrain.core.slurm import node_layout

    nodes = node_layout(os.environ if env is None else env)
    if nodes.master_addr is None:
        return
    check_master_address(nodes.master_addr, nodes.master_port)
    if nodes.node_rank == 0:
        check_master_port_free(int(nodes.master_port))


def plan_command(argv: list[str]) -> int:
    extra = FlagParser(prog="rapidtrain plan", add_help=False)
    extra.add_argument("--world-size", type=int, default=None)
    extra.add_argument("--device", choices=("cpu", "cuda"), default=None)
    extra.add_argument("--device-name", default=None)
    extra.add_argument("--json", action="store_true")
    extra.add_argument("--entry", choices=tuple(arguments.ENTRY_DEFAULTS), default=None)  # pretrain_bert.py's plan
    options, rest = extra.parse_known_args(argv)
    entry = entry_of(rest) if options.entry is None else options.entry
    args = arguments.parse_args(rest, prog="rapidtrain plan", entry=entry)
    detected = settings.RunContext.detect(args)
    world_size = detected.world_size if options.world_size is None else options.world_size
    device_type = options.device or detected.device_type
    capability = detected.capability
    if device_type != detected.device_type or options.device_name:  # planning for another machine
        capability = settings.DeviceCapability(options.device_name or "", native_bf16=True)
    ctx = settings.RunContext(world_size, device_type, detected.script, capability)
    rules.exit_on_conflicts(args, ctx)
    resolved = plan.from_args(args, ctx)
    deepspeed_config_problems(resolved)
    data_file_problems(resolved)
    print(resolved.to_json() if options.json else describe_plan(resolved))
    return 0


def deepspeed_config_problems(resolved: settings.Plan) -> None:
    """A --deepspeed_config that contradicts the flags stops the run as DeepSpeed starts: the plan stops on it too."""
    if resolved.switches.partitioning_engine == "deepspeed" and resolved.switches.deepspeed_config_file:
        from rapidtrain.parallel.deepspeed import run_config

        run_config(resolved)  # raises DeepSpeedConfigConflict (a UserError) naming each contradiction


def data_file_problems(resolved: settings.Plan) -> None:
    """The launcher opens every --data-path prefix before torchrun starts (check_inputs_before_launch): the plan
    stops on a missing or unusable one too, with the same message."""
    data = resolved.data
    if data.source == "indexed" and data.data_path and not data.raw_json:
        from rapidtrain.data.inputs import check_data_files

        # Pai's SFT idxmap holds negative markers and -100 labels: no vocabulary check
        padded_vocab = resolved.model.vocab_size if resolved.model is not None and not data.idxmap_sft else None
        check_data_files(data.data_path, data.data_impl, padded_vocab)


def entry_of(argv: list[str]) -> str | None:
    """The entry point a launch with these flags runs, whose declared defaults its plan must use."""
    args = arguments.build_parser().parse_known_args(argv)[0]
    if not args.user_script and args.task in arguments.MEGATRON_TASKS:
        return "tasks_main"
    if args.user_script or args.task != "pretraining":
        return None
    return "pretrain"


def tokenizer_settings(args: argparse.Namespace):
    """The tokenizer settings of (possibly edited) flags, for user scripts that build their own tokenizer."""
    return resolve.tokenizer_settings_of(args)


def demo_data_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rapidtrain demo-data", description="Prepare the built-in demo corpus.")
    parser.add_argument("--cache-dir", default=None, help="Where to build it (default $RAPIDTRAIN_CACHE or ~/.cache).")
    options = parser.parse_args(argv)
    from rapidtrain.data.demo import prepare_demo_data

    demo = prepare_demo_data(options.cache_dir)
    print(f"demo corpus: {demo.num_documents:,} documents, {demo.num_tokens:,} tokens\n"
          f"  --data-path {demo.data_prefix}\n  --tokenizer-type {demo.tokenizer_type} "
          f"--tokenizer-model {demo.tokenizer_model}")
    return 0


def generate_command(argv: list[str]) -> int:
    from rapidtrain.train.generation import generate_command as run

    return run(argv)


TORCHRUN = "_torchrun"  # internal: the launcher's torchrun, not a command users type


def quiet_torchrun(argv: list[str]) -> int:
    """torch.distributed.run as the launcher starts it: SIGTERM is passed to the ranks, which save and exit,
    and waited for (rapidtrain/core/shutdown.py); workers that all stopped on a user error (status 2, their message
    already printed by rank 0) end with status 2 instead of torchrun's traceback and failure report."""
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from rapidtrain.core.shutdown import PARENT_PID_ENV, RankSignalForwarder, parent_pid_from_env, stop_with_parent
    from rapidtrain.core.stopped_run import flag_value

    stop_with_parent(parent_pid_from_env())  # the launcher SIGKILLed: stop the ranks (they save), not orphan them
    os.environ[PARENT_PID_ENV] = str(os.getpid())  # the ranks' parent, for their own parent-death check
    options = parse_args(argv)
    forwarder = RankSignalForwarder()
    if RankSignalForwarder.available():  # torchrun then leaves those alone; it handles the others its own way
        import signal

        handled = forwarder.install(flag_value(list(options.training_script_args), "--exit-signal"))
        names = {signal.Signals(signum).name for signum in handled}
        options.signals_to_handle = ",".join(
            name for name in options.signals_to_handle.split(",") if name.strip() not in names)
    # Its per-worker "failed (exitcode: N)" log line; a real crash is still reported in full below.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    try:
        run(options)
    except ChildFailedError as failed:
        return stopped_launch_status(failed.failures, options, forwarder.forwarded)
    except SignalException as stopped:  # a signal torchrun handles itself (SIGINT, SIGHUP, SIGQUIT)
        return 128 + int(stopped.sigval)
    finally:
        forwarder.settle()
    return 0


def stopped_launch_status(failures: dict, options: argparse.Namespace, forwarded: set[int]) -> int:
    """The launch's status when ranks failed, with its one paragraph (core/stopped_run.py): user errors and
    Ctrl-C were told by the ranks; anything else is told here, naming the rank that failed first."""
    import signal

    from rapidtrain.core.stopped_run import EXIT_INTERRUPTED, EXIT_LOST_CONTACT, flag_value, launcher_story, resume_line

    codes = {failure.exitcode for failure in failures.values()}
    if 2 in codes and codes <= {2, EXIT_LOST_CONTACT, -signal.SIGTERM, -signal.SIGKILL}:  # others stopped by torchrun
        return 2
    save = flag_value(list(options.training_script_args), "--save")
    if codes & {EXIT_INTERRUPTED, -signal.SIGINT} and codes <= {EXIT_INTERRUPTED, -signal.SIGINT, EXIT_LOST_CONTACT}:
        # Ctrl-C: the ranks saved and said how to resume (a rank in a collective with one that left: lost contact)
        if -signal.SIGINT in codes:
            print(f"rapidtrain: stopped by Ctrl-C. {resume_line(save)}", file=sys.stderr)
        return EXIT_INTERRUPTED
    if forwarded and codes <= {-signum for signum in forwarded}:
        ended_by = signal.Signals(-min(codes)).name
        how = ("a run saves on SIGTERM when it has --save, or stops cleanly with --exit-signal-handler"
               if ended_by == "SIGTERM" else
               f"{ended_by} is not this run's --exit-signal: give --exit-signal {ended_by} with --save or "
               "--exit-signal-handler to save and stop on it")
        print(f"rapidtrain: the ranks ended on {ended_by} without saving ({how}, once its training has started)",
              file=sys.stderr)
        return 128 - min(codes)
    print(launcher_story(failures, save, str(options.node_rank)), file=sys.stderr, flush=True)
    return 1


COMMANDS = {"plan": plan_command, "demo-data": demo_data_command, "generate": generate_command,
            TORCHRUN: quiet_torchrun}


@user_errors()
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]](argv[1:])
    if not argv:
        print(USAGE)
        return 2
    return launch(argv)


if __name__ == "__main__":
    exit_after(main, returns_status=True)  # a rank ends without finalization (core/process.py)
