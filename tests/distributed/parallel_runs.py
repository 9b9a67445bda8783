"""The trainings the 3D-parallel tests compare, run once per test session.

Every 4-rank training (tensor, pipeline, data parallel and their combinations, ZeRO-1, sequence parallel,
interleaving, BERT, and the checkpoint saves and resharded loads) runs in ONE torchrun launch through
`pretrain_runs.py`; the one-process references (and the one-process loads of 4-rank checkpoints) run in
the test process. Parity runs keep dropout off and the padded vocabulary equal in every layout.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from tests.launch import torchrun

RUNS = Path(__file__).with_name("pretrain_runs.py")
# Six iterations, the checkpoints saved (and the validation run) at the third: past the 2-iteration warm-up, with
# three iterations after the save. Ten (saved at 5) trained every layout two thirds as long again and proved nothing
# more: each iteration is the same schedule, reduction and optimizer step.
ITERATIONS, SAVED_AT = 6, 3
SMALL = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 2 "
    f"--global-batch-size 8 --hidden-dropout 0 --attention-dropout 0 --num-workers 0 --log-interval {SAVED_AT} "
    f"--eval-iters 0 --lr 1e-3 --lr-warmup-iters 2 --train-iters {ITERATIONS}"
).split()
# 4-rank layouts of the GPT: name → flags (data parallel takes the ranks tensor × pipeline leave).
GPT_LAYOUTS = {
    "tp2_dp2": ["--tensor-model-parallel-size", "2"],
    "pp2_dp2": ["--pipeline-model-parallel-size", "2"],
    "tp2_pp2": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
    "tp2_zero1": ["--tensor-model-parallel-size", "2", "--zero-1-memory-optimization"],
    "tp2_sequence_parallel": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2_interleaved": "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1".split(),
}
# Layouts trained in two halves: saved at iteration SAVED_AT (then resumed at the same layout), and loaded elsewhere.
SAVED_HALFWAY = ("tp2_dp2", "pp2_dp2", "tp2_pp2")
# Validation at iterations SAVED_AT and ITERATIONS and the test set at the end: the pipeline evaluates on its last
# stage.
EVALUATED = ("tp2_dp2", "pp2_dp2")
EVALUATION = ["--eval-interval", str(SAVED_AT), "--eval-iters", "2"]


@dataclass
class LayoutRuns:
    out: Path

    def losses(self, name: str) -> Path:
        return self.out / f"{name}.txt"

    def evaluation(self, name: str) -> list[float]:
        """The validation and test losses the run printed, in order ("lm loss value: ...")."""
        if name == "single":
            text = (self.out / "single.log").read_text()
        else:  # the launch's output, one section per run (each prints its plan first)
            sections = (self.out / "four_ranks.log").read_text().split("rapidtrain plan —")[1:]
            names = json.loads((self.out / "run_names.json").read_text())
            text = "".join(
                section for section, run_name in zip(sections, names, strict=True) if run_name == name
            )
        return [
            float(line.split("lm loss value:")[1].split("|")[0])
            for line in text.splitlines()
            if "lm loss value:" in line
        ]


def gpt_flags(demo_data) -> list[str]:
    # The demo vocabulary (2,005 ids) pads to 2048 at TP 1, 2 and 4 (multiples of 512 · TP).
    return SMALL + [
        "--data-path",
        demo_data.data_prefix,
        "--tokenizer-type",
        demo_data.tokenizer_type,
        "--tokenizer-model",
        demo_data.tokenizer_model,
        "--make-vocab-size-divisible-by",
        "512",
    ]


def bert_flags(data: Path, tensor_parallel: int) -> list[str]:
    # A ~500-word vocabulary: 1024 / TP · TP pads it to 1024 at TP 1 and TP 2.
    return SMALL + [
        "--model-type",
        "bert",
        "--bert-no-binary-head",  # the masked-LM's parity under TP; the data is not sentence-split
        "--data-path",
        str(data / "bert_text_document"),
        "--split",
        "98,2,0",
        "--tokenizer-type",
        "BertWordPieceLowerCase",
        "--vocab-file",
        str(data / "vocab.txt"),
        "--make-vocab-size-divisible-by",
        str(1024 // tensor_parallel),
    ]


def prepare_bert_data(folder: Path) -> Path:
    """A tiny BERT corpus: pydoc's help topics, a WordPiece vocabulary trained on them, and the indexed
    data written by scripts/preprocess_data.py."""
    import subprocess
    import sys
    from pydoc_data.topics import topics

    from tokenizers import BertWordPieceTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    documents = [topics[name] for name in sorted(topics)]
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    tokenizer = BertWordPieceTokenizer(lowercase=True)
    tokenizer.train_from_iterator(
        documents,
        vocab_size=500,
        min_frequency=2,
        special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
    )
    tokenizer.save_model(str(folder))
    script = Path(__file__).resolve().parents[2] / "scripts" / "preprocess_data.py"
    subprocess.run(
        [
            sys.executable,
            str(script),
            "--input",
            str(folder / "corpus.jsonl"),
            "--tokenizer-type",
            "BertWordPieceLowerCase",
            "--vocab-file",
            str(folder / "vocab.txt"),
            "--output-prefix",
            str(folder / "bert"),
        ],
        check=True,
        capture_output=True,
    )
    return folder


def four_rank_runs(out: Path, gpt: list[str], bert_data: Path) -> list[tuple[str, list[str]]]:
    runs = []
    for name, flags in GPT_LAYOUTS.items():
        flags = (
            flags + ["--loss-log-file", str(out / f"{name}.txt")] + (EVALUATION if name in EVALUATED else [])
        )
        if name in SAVED_HALFWAY:
            runs.append((name, gpt + flags + ["--exit-interval", str(SAVED_AT), "--save", str(out / f"{name}_saved")]))
            runs.append((name, gpt + flags + ["--load", str(out / f"{name}_saved")]))
        else:
            runs.append((name, gpt + flags))
    runs.append(
        (
            "dp4_from_tp2_pp2",
            gpt + ["--load", str(out / "tp2_pp2_saved"), "--loss-log-file", str(out / "dp4_from_tp2_pp2.txt")],
        )
    )
    runs.append(
        (
            "bert_tp2_dp2",
            bert_flags(bert_data, 2)
            + ["--tensor-model-parallel-size", "2", "--loss-log-file", str(out / "bert_tp2_dp2.txt")],
        )
    )
    return runs


def train_here(args: list[str], log: Path | None = None) -> None:
    """One process, in this process (its output kept in `log`)."""
    import contextlib

    from rapidtrain.pretrain import main

    with open(log or "/dev/null", "w") as out, contextlib.redirect_stdout(out):
        main(args)


_DONE: dict[str, LayoutRuns] = {}


def layout_runs(tmp_path_factory, demo_data) -> LayoutRuns:
    """Run everything once per session (each test module asks; the first one pays). Under xdist the session's
    workers share one build: the modules that ask may land on both workers, and the second waits for the first
    (idle, so the build has the cores) instead of training every layout again beside it."""
    if "runs" in _DONE:
        return _DONE["runs"]
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the workers' common folder
    out = shared / "parallel_layouts"
    with FileLock(str(shared / "parallel_layouts.lock")):
        if not (out / "complete").exists():
            out.mkdir(exist_ok=True)
            _build(out, demo_data)
            (out / "complete").touch()
    _DONE["runs"] = LayoutRuns(out)
    return _DONE["runs"]


def _build(out: Path, demo_data) -> None:
    gpt = gpt_flags(demo_data)
    bert_data = prepare_bert_data(out / "bert_data")
    train_here(gpt + EVALUATION + ["--loss-log-file", str(out / "single.txt")], out / "single.log")
    train_here(bert_flags(bert_data, 1) + ["--loss-log-file", str(out / "bert_single.txt")])
    runs = four_rank_runs(out, gpt, bert_data)
    (out / "runs.json").write_text(json.dumps([args for _, args in runs]))
    (out / "run_names.json").write_text(json.dumps([name for name, _ in runs]))
    result = torchrun(4, RUNS, [str(out / "runs.json")], timeout=1800, warm=True)
    (out / "four_ranks.log").write_text(result.stdout)
    for name in ("tp2_dp2", "pp2_dp2"):  # resharded to one process: TP 2 → TP 1, PP 2 → PP 1
        train_here(
            gpt
            + ["--load", str(out / f"{name}_saved"), "--loss-log-file", str(out / f"single_from_{name}.txt")]
        )
