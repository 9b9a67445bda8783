"""`rapidtrain plan FLAGS` prints exactly the plan a run with FLAGS prints (and acts on): one table of flag
sets over GPT, BERT, the demo, real data, each parallel family and fine-tuning."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import REPO, child_env, free_port, torchrun

RUNS = REPO / "tests" / "distributed" / "pretrain_runs.py"

SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--num-workers", "0", "--eval-iters", "0"]


def printed_plan(output: str) -> str:
    """The plan block of a command's output: its header and the indented lines after it."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("rapidtrain plan —"))
    block = [lines[start]]
    for line in lines[start + 1:]:
        if not line.startswith("  "):
            break
        block.append(line)
    return "\n".join(block)


def plan_command(flags: list[str], world: int, *extra: str) -> str:
    """What `rapidtrain plan --world-size N [EXTRA] FLAGS` prints, run in this process: the command is pure (no
    process group, no model), so it needs no Python start of its own beside the run it is compared with. With
    EXTRA (--json) the whole output, else the plan block."""
    from unittest import mock

    from rapidtrain import cli

    printed = io.StringIO()
    # The plan names the CPU threads per rank from OMP_NUM_THREADS: the run's ranks get the launch's value
    # (tests/launch.py child_env), so the command is asked under the same.
    threads = {"OMP_NUM_THREADS": child_env(nproc=world)["OMP_NUM_THREADS"]}
    with contextlib.redirect_stdout(printed), mock.patch.dict(os.environ, threads):
        assert cli.main(["plan", "--world-size", str(world), *extra, *flags]) == 0
    return printed.getvalue() if extra else printed_plan(printed.getvalue())


def built(output: str) -> dict:
    """The run's ` built: {...}` line: what Engine.compose really built."""
    line = next(line for line in output.splitlines() if line.startswith(" built: "))
    return json.loads(line.removeprefix(" built: "))


def check_built_as_planned(made: dict, plan: dict) -> None:
    """What was built (runner, wrapper, optimizer class, parameter kind, mesh) is what the Plan says."""
    layout, switches = plan["layout"], plan["switches"]
    engine = switches["partitioning_engine"]
    if layout["pipeline_parallel_size"] > 1:
        assert made["runner"] == "PipelineRunner"
    elif engine == "deepspeed":
        assert (made["runner"], made["wrapper"]) == ("DeepSpeedRunner", "DeepSpeedEngine")
    elif engine == "fsdp2":
        assert made["wrapper"].startswith("FSDP") and made["dtensor"]
    elif layout["data_parallel_size"] > 1 and layout["tensor_parallel_size"] == 1:
        assert made["wrapper"] == "DistributedDataParallel"
    assert made["dtensor"] == (layout["tensor_parallel_size"] > 1 or engine == "fsdp2" and layout["world_size"] > 1)
    optimizer_line = next(c["engine"] for c in plan["engines"] if c["switch"] == "optimizer")
    assert made["optimizer"] in optimizer_line, (made["optimizer"], optimizer_line)
    expected_mesh = {"tp": layout["tensor_parallel_size"], "pp": layout["pipeline_parallel_size"]}
    assert all(made["mesh"].get(name, 1) == size for name, size in expected_mesh.items()), made["mesh"]
    if layout["expert_parallel_size"] > 1:
        assert made["mesh"]["ep"] == layout["expert_parallel_size"]
    if plan["precision"]["dtype"] == "fp32":
        assert made["dtypes"] == ["float32"]


def indexed_data(demo_data, sentences: bool = False) -> list[str]:
    """Real data flags: the demo corpus named explicitly (sentence-split for BERT's binary head), with its
    tokenizer."""
    return ["--data-path", demo_data.sentence_prefix if sentences else demo_data.data_prefix, "--tokenizer-type",
            demo_data.tokenizer_type, "--tokenizer-model", demo_data.tokenizer_model]


PRETRAINING = {
    # name: (flags, ranks); "DATA" is replaced by real data flags
    "demo": ([], 1),
    "demo_with_user_flags": (["--micro-batch-size", "2", "--lr", "3e-4", "--train-iters", "3"], 1),
    "gpt_real_data": (["DATA", "--micro-batch-size", "2", "--lr", "1e-3"], 1),
    "bert_real_data": (["SENTENCES", "--model-type", "bert", "--micro-batch-size", "2", "--lr", "1e-3"], 1),
    "zero2": (["DATA", "--zero-2-memory-optimization", "--micro-batch-size", "2", "--lr", "1e-3"], 2),
    "fsdp_bf16": (["DATA", "--fsdp-memory-optimization", "--bf16", "--micro-batch-size", "1", "--lr", "1e-3"], 2),
    "tp2": (["DATA", "--tensor-model-parallel-size", "2", "--micro-batch-size", "2", "--lr", "1e-3"], 2),
    "pp2": (["DATA", "--pipeline-model-parallel-size", "2", "--micro-batch-size", "1", "--global-batch-size", "2",
             "--lr", "1e-3"], 2),
    "ep2_moe": (["DATA", "--num-experts", "2", "--expert-model-parallel-size", "2", "--micro-batch-size", "1",
                 "--lr", "1e-3"], 2),
}
SLOW = {"zero2", "fsdp_bf16", "pp2", "ep2_moe"}  # the 2-rank runs: one launch for them all (two_ranks below)


def run_flags(name: str, demo_data) -> list[str]:
    """PRETRAINING[name]'s flags with the data named and two iterations unless it says."""
    flags, _ = PRETRAINING[name]
    data = {"DATA": indexed_data(demo_data), "SENTENCES": indexed_data(demo_data, sentences=True)}
    flags = [f for flag in flags for f in data.get(flag, [flag])]
    return SHAPE + flags + (["--train-iters", "2"] if "--train-iters" not in flags else [])


def launch(ranks: int, tmp_path_factory, demo_data) -> dict[str, tuple[str, str]]:
    """Every PRETRAINING run on `ranks` ranks in one torchrun launch of pretrain_runs.py (the built-in pretraining's
    code path, each run with its own Engine; a launch per run paid the agent's imports and the rendezvous nine
    times): name → (that run's output from its plan on, its ` built:` line). Each run prints one of each, the
    ` built:` line when it composes, before its plan: the k-th of each is the k-th run's."""
    names = [name for name, (_, world) in PRETRAINING.items() if world == ranks]
    out = tmp_path_factory.mktemp(f"plan_runs_{ranks}")
    (out / "runs.json").write_text(json.dumps([run_flags(name, demo_data) for name in names]))
    result = torchrun(ranks, RUNS, [str(out / "runs.json")], timeout=900, warm=True)
    sections = ["rapidtrain plan —" + part for part in result.stdout.split("rapidtrain plan —")[1:]]
    built_lines = [line for line in result.stdout.splitlines() if line.startswith(" built: ")]
    return dict(zip(names, zip(sections, built_lines, strict=True), strict=True))


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, demo_data) -> dict[str, tuple[str, str]]:
    return launch(1, tmp_path_factory, demo_data)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, demo_data) -> dict[str, tuple[str, str]]:
    return launch(2, tmp_path_factory, demo_data)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in PRETRAINING])
def test_plan_command_prints_the_plan_the_pretraining_run_prints(name, demo_data, request):
    flags, ranks = run_flags(name, demo_data), PRETRAINING[name][1]
    printed, built_line = request.getfixturevalue({1: "one_rank", 2: "two_ranks"}[ranks])[name]
    assert printed_plan(printed) == plan_command(flags, ranks)
    check_built_as_planned(built(built_line), json.loads(plan_command(flags, ranks, "--json")))


def test_plan_command_prints_the_plan_the_fine_tuning_run_prints(tmp_path):
    from rapidtrain.tasks import toy

    model, data = toy.make_task("sequence_classification", tmp_path, train=16, dev=8)
    flags = ["--task", "sequence_classification", "--pretrained-model-name-or-path", str(model),
             "--data-dir", str(data.parent), "--data-name", data.name, "--epochs", "1", "--micro-batch-size", "4",
             "--seq-length", "32", "--lr", "1e-3", "--num-workers", "0"]
    run = subprocess.run([str(Path(sys.executable).parent / "rapidtrain"), *flags, "--nproc-per-node", "1"],
                         capture_output=True, text=True, cwd=REPO, timeout=600,
                         env=child_env({"MASTER_PORT": str(free_port())}))
    assert run.returncode == 0, run.stderr[-3000:]
    assert printed_plan(run.stdout) == plan_command(flags, 1)
