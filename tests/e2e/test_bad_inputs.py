"""Bad inputs as a careful user would try them, through `rapidtrain plan`, the pretraining entry point, the
black-box command, preprocess_data.py and convert_checkpoint.py. Each case asserts the exit status, a message
naming the flag or file, no Python traceback, and that no input or checkpoint file was lost or changed.

The entry points run in this process (the same `main` a console script runs, with its output captured at the
file-descriptor level) except where the launch itself is the subject; crafted checkpoint files carry a payload
that would create a file, which must not exist afterwards.

`python tests/e2e/test_bad_inputs.py [WORD ...]` prints one line per case (or per case whose name holds a WORD):
status, traceback or not, the message, for the rapidtrain on PYTHONPATH: how the closing note's before/after
table was made.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--num-workers", "0", "--eval-iters", "0",
        "--lr", "1e-3", "--lr-warmup-iters", "1", "--lr-decay-iters", "10", "--log-interval", "1"]


class Payload:
    """Unpickling this creates `marker`: it stands for any code a crafted file would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


# ---- the workspace: data, a tokenizer-free vocabulary, one real checkpoint ----

@dataclass
class Workspace:
    root: Path

    @property
    def data(self) -> str:
        return str(self.root / "data" / "d_text_document")

    @property
    def checkpoint(self) -> Path:
        return self.root / "ck"

    @property
    def marker(self) -> Path:
        return self.root / "pwned"

    def data_flags(self, prefix: str | None = None) -> list[str]:
        return ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--data-path", prefix or self.data,
                "--data-cache-path", str(self.root / "cache")]

    def copy_checkpoint(self, name: str) -> Path:
        target = self.root / name
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(self.checkpoint, target)
        return target


def make_workspace(root: Path) -> Workspace:
    from rapidtrain.data.indexed import IndexedDatasetBuilder

    ws = Workspace(root)
    (root / "data").mkdir(parents=True)
    rng = np.random.RandomState(0)
    builder = IndexedDatasetBuilder(ws.data + ".bin", np.uint16)
    for _ in range(200):
        builder.add_document([list(rng.randint(0, 100, size=rng.randint(20, 120))) + [100]])
    builder.finalize(ws.data + ".idx")
    builder = IndexedDatasetBuilder(str(root / "data" / "wide.bin"), np.uint16)  # ids from a vocabulary of 1000
    for _ in range(50):
        builder.add_document([list(rng.randint(0, 1000, size=60))])
    builder.finalize(str(root / "data" / "wide.idx"))
    builder = IndexedDatasetBuilder(str(root / "data" / "empty.bin"), np.uint16)
    builder.finalize(str(root / "data" / "empty.idx"))
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": "1 2 3"}) + "\n" for _ in range(20)))
    (root / "blank.jsonl").write_text("\n  \n")
    (root / "a_file").write_text("not a folder")
    code, output = run_pretrain(TINY + ws.data_flags() + ["--train-iters", "3", "--save", str(ws.checkpoint)])
    assert code == 0, output
    return ws


# ---- running an entry point in this process, its output captured at the descriptors ----

def captured(call: Callable[[], object]) -> tuple[int, str]:
    """(exit status, stdout + stderr) of `call` as a console script would end: SystemExit's code, 1 and a
    traceback for an uncaught exception, else 0 (or the int it returned). Python's streams and the descriptors
    (what subprocesses such as torchrun write) both go to one file."""
    sys.stdout.flush(), sys.stderr.flush()  # noqa: B018
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        text = io.TextIOWrapper(open(sink.fileno(), "wb", closefd=False), line_buffering=True, errors="replace")
        os.dup2(sink.fileno(), 1), os.dup2(sink.fileno(), 2)  # noqa: B018
        try:
            with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
                code = _exit_status(call)
        finally:
            text.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)  # noqa: B018
            os.close(saved[0]), os.close(saved[1])  # noqa: B018
        sink.seek(0)
        return code, sink.read().decode(errors="replace")


def _exit_status(call: Callable[[], object]) -> int:
    try:
        result = call()
        return result if isinstance(result, int) else 0
    except SystemExit as stop:
        if isinstance(stop.code, int) or stop.code is None:
            return stop.code or 0
        print(stop.code, file=sys.stderr)  # SystemExit("message"): printed, status 1
        return 1
    except BaseException:  # noqa: BLE001 - what the interpreter would print
        traceback.print_exc()
        return 1


def run_cli(argv: list[str]) -> tuple[int, str]:
    from rapidtrain import cli

    return captured(lambda: cli.main(argv))


def run_pretrain(argv: list[str]) -> tuple[int, str]:
    from rapidtrain import pretrain

    return captured(lambda: pretrain.main(argv))


def run_script(name: str, argv: list[str]) -> tuple[int, str]:
    spec = importlib.util.spec_from_file_location(f"_script_{name}", REPO / "scripts" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return captured(lambda: module.main(argv))


# ---- crafting bad checkpoints ----

def rewrite_manifest(directory: Path) -> None:
    """An attacker who replaces a file rewrites the manifest too (absent in checkpoints before format 2)."""
    path = directory / "manifest.json"
    if not path.exists():
        return
    from rapidtrain.checkpoint.checkpointer import file_checksum

    manifest = json.loads(path.read_text())
    manifest["files"] = {name: file_checksum(directory / name) for name in manifest["files"]}
    path.write_text(json.dumps(manifest))


def damaged(ws: Workspace, how: str) -> Path:
    folder = ws.copy_checkpoint(f"ck_{how}")
    directory = folder / "iter_0000003"
    data = directory / "__0_0.distcp"
    if how == "flip":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        data.write_bytes(bytes(raw))
    elif how == "nan":
        raw = bytearray(data.read_bytes())
        raw[-8192:-4096] = np.full(1024, np.nan, dtype=np.float32).tobytes()
        data.write_bytes(bytes(raw))
    elif how == "truncated_metadata":
        (directory / ".metadata").write_bytes((directory / ".metadata").read_bytes()[:1000])
    elif how == "evil_rng":
        import torch

        torch.save({"python": Payload(ws.marker)}, directory / "rng" / "rank_0.pt")
        rewrite_manifest(directory)
    elif how == "evil_metadata":
        (directory / ".metadata").write_bytes(pickle.dumps(Payload(ws.marker)))
        rewrite_manifest(directory)
    elif how == "evil_common":
        import torch

        for name in ("common.json", "manifest.json", "common.pt"):
            (directory / name).unlink(missing_ok=True)
        torch.save({"iteration": 3, "consumed_samples": 12, "args": Payload(ws.marker)}, directory / "common.pt")
    return folder


# ---- the table ----

@dataclass
class Case:
    name: str
    run: Callable[[Workspace], tuple[int, str]]
    message: str  # a regex the output must match: it names the flag or file
    status: int = 2
    protect: Callable[[Workspace], list[Path]] = field(default=lambda ws: [ws.root / "data", ws.checkpoint])
    slow: bool = False


def plan(*flags: str) -> Callable[[Workspace], tuple[int, str]]:
    return lambda ws: run_cli(["plan", "--train-iters", "10", "--lr", "1e-3", *flags])


def pretrain(*flags: str, data: bool = True) -> Callable[[Workspace], tuple[int, str]]:
    return lambda ws: run_pretrain(TINY + (ws.data_flags() if data else []) + ["--train-iters", "4", *flags])


def load_damaged(how: str) -> Callable[[Workspace], tuple[int, str]]:
    return lambda ws: run_pretrain(TINY + ws.data_flags() + ["--train-iters", "4", "--load", str(damaged(ws, how))])


def launch(*flags: str) -> Callable[[Workspace], tuple[int, str]]:
    """The black-box command; `{root}` in a flag is the workspace folder."""
    return lambda ws: run_cli(["--task", "pretraining", "--train-iters", "4", *TINY, *ws.data_flags(),
                               *(flag.format(root=ws.root) for flag in flags)])


CASES = [
    Case("plan: misspelled flag", plan("--lr-warmup-iter", "2"),
         r"^rapidtrain plan: error: unknown flag --lr-warmup-iter \(did you mean --lr-warmup-iters\?\)"),
    Case("plan: --lr -1e-3", plan("--lr", "-1e-3"), r"--lr -0\.001: must be a finite number"),
    Case("plan: --lr nan", plan("--lr", "nan"), r"argument --lr: 'nan' is not a finite number"),
    Case("plan: --split a,b", plan("--split", "a,b"), r"--split 'a,b': expected one to three numbers"),
    Case("plan: --split 0,0,0", plan("--split", "0,0,0"), r"--split '0,0,0': weights must be non-negative"),
    Case("plan: --split 0,0,1", plan("--split", "0,0,1"), r"--split '0,0,1' gives the training split no documents"),
    Case("plan: --train-iters 0", plan("--train-iters", "0"), r"--train-iters 0: iteration counts"),
    Case("plan: --log-interval 0", plan("--log-interval", "0"), r"--log-interval 0: iteration counts"),
    Case("plan: --eval-interval 0", plan("--eval-interval", "0"), r"--eval-interval 0: iteration counts"),
    Case("plan: --hidden-dropout 2", plan("--hidden-dropout", "2"), r"--hidden-dropout 2\.0 \(allowed \[0, 1\)\)"),
    Case("plan: --seed -1", plan("--seed", "-1"), r"--seed -1: must lie in \[0, 4294967296\)"),
    Case("plan: --num-workers -1", plan("--num-workers", "-1"), r"--num-workers -1"),
    Case("plan: --world-size -3", plan("--world-size", "-3"), r"world size -3: the number of processes"),
    Case("plan: --train-iters 10^12", plan("--train-iters", str(10**12)), r"--train-iters 1000000000000 × global"),
    Case("plan: nccl without CUDA", plan("--distributed-backend", "nccl"), r"--distributed-backend nccl: NCCL"),
    Case("plan: missing tokenizer file",
         plan("--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "/no/vocab.json", "--merge-file", "/no/m.txt"),
         r"--vocab-file /no/vocab\.json: no such file"),
    Case("plan: --num-layers 100000000 answers", plan("--num-layers", "100000000"), r"100000000 layers",
         status=0),
    Case("plan: missing --data-path files, as the launch refuses them", lambda ws: run_cli(
        ["plan", "--train-iters", "10", *TINY, *ws.data_flags(str(ws.root / "nope"))]),
        r"nope\.idx and .*nope\.bin not found; --data-path is a prefix"),
    Case("plan: --data-path of a JSON file", lambda ws: run_cli(
        ["plan", "--train-iters", "10", *TINY, *ws.data_flags(str(ws.root / "docs.jsonl"))]),
        r"--data-path .*docs\.jsonl: a JSON file, not Megatron indexed data .*scripts/preprocess_data\.py .*"
        r"--dataset LLama-Pretrain-Raw"),
    Case("plan: token ids beyond the vocabulary, as the launch refuses them", lambda ws: run_cli(
        ["plan", "--train-iters", "10", *TINY, *ws.data_flags(str(ws.root / "data" / "wide"))]),
        r"wide: token id \d+ in sequence \d+ is outside the vocabulary \[0, 128\)"),
    Case("pretrain: --data-path of a JSON file", lambda ws: run_pretrain(
        TINY + ws.data_flags(str(ws.root / "docs.jsonl")) + ["--train-iters", "4"]),
        r"--data-path .*docs\.jsonl: a JSON file, not Megatron indexed data"),
    Case("pretrain: misspelled flag", pretrain("--save-intervall", "2"),
         r"unknown flag --save-intervall \(did you mean --save-interval\?\)"),
    Case("pretrain: missing --data-path files", lambda ws: run_pretrain(
        TINY + ws.data_flags(str(ws.root / "nope")) + ["--train-iters", "4"]),
        r"nope\.idx and .*nope\.bin not found; --data-path is a prefix"),
    Case("pretrain: --data-path with a space", lambda ws: run_pretrain(
        TINY + ws.data_flags(str(ws.root / "my data/x")) + ["--train-iters", "4"]),
        r"should be a number: the weight of the prefix after it \('data/x'\).*has a space"),
    Case("pretrain: empty dataset", lambda ws: run_pretrain(
        TINY + ws.data_flags(str(ws.root / "data" / "empty")) + ["--train-iters", "4"]),
        r"--data-path .*empty: the dataset holds no tokens"),
    Case("pretrain: .idx dtype code changed", lambda ws: run_pretrain(
        TINY + ws.data_flags(retyped(ws)) + ["--train-iters", "4"]),
        r"retyped\.bin: .*the dtype code in the \.idx header is wrong"),
    Case("pretrain: --split leaves no training documents", pretrain("--split", "1,1000,0"),
         r"--split leaves no training documents"),
    Case("pretrain: nccl without CUDA", pretrain("--distributed-backend", "nccl"), r"--distributed-backend nccl"),
    Case("pretrain: .distcp with a flipped byte", load_damaged("flip"), r"__0_0\.distcp is damaged: CRC-32"),
    Case("pretrain: .distcp with NaN bytes", load_damaged("nan"), r"__0_0\.distcp is damaged: CRC-32"),
    Case("pretrain: truncated .metadata", load_damaged("truncated_metadata"), r"\.metadata is damaged: \d+ bytes"),
    Case("pretrain: crafted rng file", load_damaged("evil_rng"), r"rng/rank_0\.pt: refused"),
    Case("pretrain: crafted .metadata", load_damaged("evil_metadata"), r"\.metadata: refused: it asks to import"),
    Case("pretrain: crafted common.pt", load_damaged("evil_common"), r"common\.pt: refused"),
    Case("pretrain: checkpoint of another model", lambda ws: run_pretrain(
        [a if a != "64" else "128" for a in TINY] + ws.data_flags() + ["--train-iters", "4", "--load",
                                                                         str(ws.checkpoint)]),
        r"holds a different model: --hidden-size \(checkpoint 64, now 128\)"),
    Case("pretrain: resumed with another --global-batch-size names that flag alone", lambda ws: run_pretrain(
        TINY + ws.data_flags() + ["--train-iters", "6", "--global-batch-size", "8", "--load", str(ws.checkpoint)]),
        r"the learning-rate schedule would change, since --global-batch-size \(checkpoint 4, now 8\): give the"),
    Case("pretrain: resumed with a --decoupled-lr the checkpoint was saved without", lambda ws: run_pretrain(
        TINY + ws.data_flags() + ["--train-iters", "6", "--decoupled-lr", "1e-4", "--load", str(ws.checkpoint)]),
        r"saved without --decoupled-lr, and this run is with --decoupled-lr 0\.0001, which changes the optimizer's "
        r"parameter groups .* --no-load-optim \(or --finetune\) .* or drop --decoupled-lr"),
    Case("pretrain: --decoupled-lr with --no-load-optim loads the saved weights", lambda ws: run_pretrain(
        TINY + ws.data_flags() + ["--train-iters", "5", "--decoupled-lr", "1e-4", "--no-load-optim", "--load",
                                  str(ws.checkpoint)]), r"loaded checkpoint from .* at iteration 3", status=0),
    Case("launch: token ids beyond the vocabulary", lambda ws: run_cli(
        ["--task", "pretraining", "--train-iters", "4", *TINY, *ws.data_flags(str(ws.root / "data" / "wide"))]),
        r"wide: token id \d+ in sequence \d+ is outside the vocabulary \[0, 128\)"),
    Case("launch: --save holds checkpoints it did not load", launch("--save", "{root}/ck"),
         r"--save .*ck already holds checkpoints .* give --load .*ck"),
    Case("launch: mistyped --load", launch("--load", "{root}/ckk", "--save", "{root}/fresh"),
         r"--load .*ckk: no such folder"),
    Case("pretrain: mistyped --load without --save", pretrain("--load", "/no/such/ck"),
         r"--load /no/such/ck: no such folder"),
    Case("launch: --save under a regular file", launch("--save", "{root}/a_file/ck"),
         r"--save .*a_file/ck is not writable"),
    Case("launch: missing --user-script", lambda ws: run_cli(["--user-script", str(ws.root / "nope.py"),
                                                              "--train-iters", "2", "--lr", "1e-3"]),
         r"--user-script .*nope\.py: no such file"),
    Case("preprocess: input without documents", lambda ws: run_script("preprocess_data.py", [
        "--input", str(ws.root / "blank.jsonl"), "--output-prefix", str(ws.root / "out" / "p"), "--tokenizer-type",
        "NullTokenizer", "--vocab-size", "10"]), r"--input .*blank\.jsonl: no documents"),
    Case("preprocess: output prefix under a file", lambda ws: run_script("preprocess_data.py", [
        "--input", str(ws.root / "docs.jsonl"), "--output-prefix", str(ws.root / "a_file" / "p"), "--tokenizer-type",
        "NullTokenizer", "--vocab-size", "10"]), r"--output-prefix .*a_file/p: cannot create the folder"),
    Case("preprocess: stale .tmp of a killed run", lambda ws: stale_preprocess(ws),
         r"removed .*p_text_document\.bin\.tmp-999999999, left by an earlier run that was killed", status=0),
    Case("convert: crafted .metadata", lambda ws: run_script("convert_checkpoint.py", [
        "--load", str(damaged(ws, "evil_metadata")), "--output", str(ws.root / "export")]),
        r"\.metadata: refused: it asks to import"),
    Case("black-box command: damaged checkpoint, through torchrun", lambda ws: subprocess_cli(
        ["--task", "pretraining", "--train-iters", "4", *TINY, *ws.data_flags(), "--load", str(damaged(ws, "flip"))]),
        r"__0_0\.distcp is damaged: CRC-32", slow=True),
]


def retyped(ws: Workspace) -> str:
    (ws.root / "retyped").mkdir(exist_ok=True)
    prefix = ws.root / "retyped" / "retyped"
    for suffix in (".bin", ".idx"):
        shutil.copyfile(ws.data + suffix, str(prefix) + suffix)
    with open(str(prefix) + ".idx", "r+b") as index:
        index.seek(17)  # magic (9) + version (8): the dtype code
        index.write(bytes([4]))  # int32 instead of uint16
    return str(prefix)


def stale_preprocess(ws: Workspace) -> tuple[int, str]:
    out = ws.root / "out_stale"
    out.mkdir(exist_ok=True)
    (out / "p_text_document.bin.tmp-999999999").write_bytes(b"\0" * 64)  # no such pid: its writer is gone
    code, output = run_script("preprocess_data.py", [
        "--input", str(ws.root / "docs.jsonl"), "--output-prefix", str(out / "p"), "--tokenizer-type",
        "NullTokenizer", "--vocab-size", "10"])
    left = (out / "p_text_document.bin.tmp-999999999").exists()
    return code, output + ("\n(the stale temporary file is still there)" if left else "")


def subprocess_cli(argv: list[str]) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "rapidtrain.cli", *argv], capture_output=True, text=True,
                          env=env, timeout=300, cwd=REPO)
    return done.returncode, done.stdout + done.stderr


def digest(paths: list[Path]) -> dict[str, str]:
    hashes = {}
    for root in paths:
        for path in sorted(p for p in ([root] if root.is_file() else root.rglob("*")) if p.is_file()):
            hashes[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return hashes


def run_case(case: Case, ws: Workspace) -> tuple[int, str]:
    return case.run(ws)


# ---- pytest ----

@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    os.environ.setdefault("RAPIDTRAIN_CACHE", str(tmp_path_factory.mktemp("cache")))
    return make_workspace(tmp_path_factory.mktemp("bad_inputs"))


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.slow else [])
                                  for c in CASES])
def test_bad_input_is_refused_clearly_and_loses_nothing(case, workspace):
    protected = case.protect(workspace)
    before = digest(protected)
    status, output = run_case(case, workspace)
    assert status == case.status, output[-3000:]
    assert re.search(case.message, output, re.MULTILINE), output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert digest(protected) == before, "an input or checkpoint file was changed or lost"
    assert not workspace.marker.exists(), "a crafted file ran its payload"


# ---- the before/after table ----

if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    with tempfile.TemporaryDirectory() as folder:
        os.environ.setdefault("RAPIDTRAIN_CACHE", os.path.join(folder, "cache"))
        ws = make_workspace(Path(folder) / "ws")
        for case in [c for c in CASES if not sys.argv[1:] or any(word in c.name for word in sys.argv[1:])]:
            before = digest(case.protect(ws))
            status, output = run_case(case, ws)
            changed = digest(case.protect(ws)) != before
            lines = [line.strip() for line in output.splitlines() if line.strip() and "Warning" not in line]
            error = next((line for line in reversed(lines) if "Error" in line or "error" in line), lines[-1] if lines
                         else "")
            print(f"{case.name} | exit {status} | {'TRACEBACK' if 'Traceback' in output else 'no traceback'} | "
                  f"{'FILES CHANGED' if changed else 'files kept'} | "
                  f"{'PAYLOAD RAN' if ws.marker.exists() else ''} | {error[:220]}", flush=True)
            ws.marker.unlink(missing_ok=True)
