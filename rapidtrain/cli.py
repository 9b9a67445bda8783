"""The `rapidtrain` command: launch under torchrun, run a task or a user script, `plan`, `demo-data`.

`rapidtrain FLAGS` checks the flags, then starts `torch.distributed.run` itself (unless it already runs
under torchrun, in which case it runs in place): the built-in pretraining for `--task pretraining`, the
black-box fine-tuning for the Hugging Face tasks, or the script given by `--user-script`.
"""

from __future__ import annotations

import argparse
import os
import runpy
import subprocess
import sys
from pathlib import Path

from rapidtrain import arguments, plan, rules

PACKAGE_DIR = Path(__file__).resolve().parent
USAGE = """usage:
  rapidtrain FLAGS                       train (torchrun is started for you; see rapidtrain --help)
  rapidtrain --user-script FILE FLAGS    run a white-box script (Finetuner / PreTrainer / Trainer / Engine.compose)
  rapidtrain plan FLAGS [--world-size N] [--device cpu|cuda] [--json]
                                         print what the flags resolve to, start nothing
  rapidtrain demo-data [--cache-dir DIR] prepare the built-in demo corpus
  rapidtrain generate --load DIR --prompt TEXT [--max-new-tokens N --temperature T --top-k K --top-p P]
                                         continue a prompt with a trained built-in GPT (any saved layout)
"""


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ)


def entry_script(args: argparse.Namespace) -> Path:
    if args.user_script:
        script = Path(args.user_script)
        if not script.is_file():
            raise SystemExit(f"rapidtrain: --user-script {args.user_script}: no such file. Give the path of a Python "
                             "file that subclasses Finetuner, PreTrainer or Trainer (see templates/).")
        return script
    if args.task == "pretraining":
        return PACKAGE_DIR / "pretrain.py"
    return PACKAGE_DIR / "finetune.py"


def torchrun_command(args: argparse.Namespace, script: Path, argv: list[str], device_type: str) -> list[str]:
    """`python -m torch.distributed.run ...` with Rapidformer's environment (NNODES, NODE_RANK, MASTER_*)."""
    nproc = args.nproc_per_node or plan.default_nproc_per_node(device_type) or 1
    nnodes = int(os.environ.get("NNODES", "1"))
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--nnodes={nnodes}"]
    if nnodes == 1 and "MASTER_ADDR" not in os.environ:
        command.append("--standalone")
    else:
        command += [f"--node-rank={os.environ.get('NODE_RANK', '0')}",
                    f"--master-addr={os.environ.get('MASTER_ADDR', '127.0.0.1')}",
                    f"--master-port={os.environ.get('MASTER_PORT', '29500')}"]
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
    return arguments.parse_args(argv)


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
    args = launch_arguments(argv)
    ctx = plan.RunContext.detect(args)
    script = entry_script(args)
    if under_torchrun():
        if args.user_script:
            return run_user_script_in_place(script, argv)
        run_in_place(script, argv)
        return 0
    rules.exit_on_conflicts(args, ctx)
    return subprocess.call(torchrun_command(args, script, argv, ctx.device_type))


def plan_command(argv: list[str]) -> int:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--world-size", type=int, default=None)
    extra.add_argument("--device", choices=("cpu", "cuda"), default=None)
    extra.add_argument("--json", action="store_true")
    options, rest = extra.parse_known_args(argv)
    args = arguments.parse_args(rest, prog="rapidtrain plan")
    detected = plan.RunContext.detect(args)
    ctx = plan.RunContext(options.world_size or detected.world_size, options.device or detected.device_type)
    rules.exit_on_conflicts(args, ctx)
    resolved = plan.from_args(args, ctx, vocab_size=plan_vocab_size(args))
    print(resolved.to_json() if options.json else resolved.describe())
    return 0


def plan_vocab_size(args: argparse.Namespace) -> int | None:
    """The padded vocabulary of the built-in model, from the tokenizer flags or the demo corpus."""
    from rapidtrain.models.hf_config import trains_builtin_model

    if not trains_builtin_model(args):
        return None
    if args.tokenizer_type is None and not args.data_path:
        from rapidtrain.data.demo import VOCAB_SIZE

        vocab = VOCAB_SIZE
    elif args.tokenizer_type == "NullTokenizer" and args.vocab_size:
        vocab = args.vocab_size
    else:
        from rapidtrain.data.tokenizer import build_tokenizer

        vocab = build_tokenizer(tokenizer_settings(args)).vocab_size
    return plan.builtin_vocab_size(args, vocab)


def tokenizer_settings(args: argparse.Namespace):
    from rapidtrain.data.tokenizer import TokenizerSettings

    return TokenizerSettings(
        tokenizer_type=args.tokenizer_type, vocab_file=args.vocab_file, merge_file=args.merge_file,
        tokenizer_model=args.tokenizer_model, vocab_size=args.vocab_size,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        tensor_model_parallel_size=args.tensor_model_parallel_size)


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
    from rapidtrain.generation import generate_command as run

    return run(argv)


COMMANDS = {"plan": plan_command, "demo-data": demo_data_command, "generate": generate_command}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]](argv[1:])
    if not argv:
        print(USAGE)
        return 2
    return launch(argv)


if __name__ == "__main__":
    raise SystemExit(main())
