"""A Hugging Face GPT-2 trained by a user's own loop through `Engine.compose` on 2 gloo ranks under DDP, OSS,
SDP, FSDP, ZeRO-1/2/3 and ZeRO-2 + CPU offload gives the losses of one process with the same global batch.

Global batch 8 = micro 2 × accumulation 2 × 2 ranks (accumulation 4 in one process). Every sequence has the
same length and no padding, so HF's per-micro-batch mean loss weighs every token alike in both layouts.
All 2-rank trainings run in one torchrun launch (this file, run as a script); the reference runs in the test
process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

if __package__ in (None, ""):  # run by torchrun as the worker
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.launch import relative_difference, torchrun  # noqa: E402

# Eight iterations: a wrong scaling of the accumulated gradient, or a reduction missed or doubled, leaves parity from
# the second on, and one process's loss falls 0.32 by the eighth (4.861 -> 4.538; 0.1 is asked). Twenty trained
# the eight modes' runs two and a half times as long and proved nothing more.
ITERATIONS = 8
SEQUENCE = 32
VOCAB = 128
# fmt: off
FLAGS = ["--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3", "--train-iters", str(ITERATIONS),
         "--num-workers", "0", "--seed", "5"]
MODES = {
    "ddp": [], "oss": ["--oss-memory-optimization"], "sdp": ["--oss-sdp-memory-optimization"],
    "fsdp": ["--fsdp-memory-optimization"], "zero1": ["--zero-1-memory-optimization"],
    "zero2": ["--zero-2-memory-optimization"], "zero3": ["--zero-3-memory-optimization"],
    "zero2_offload": ["--zero-2-memory-optimization", "--cpu-offload"],
}
# What each mode must have wrapped the model and optimizer in: (module, optimizer, its inner optimizer).
WRAPPING = {
    "ddp": ["DistributedDataParallel", "AdamW", "NoneType"],
    "oss": ["DistributedDataParallel", "ZeroRedundancyOptimizer", "NoneType"],
    "sdp": ["FSDPGPT2LMHeadModel", "AdamW", "NoneType"], "fsdp": ["FSDPGPT2LMHeadModel", "AdamW", "NoneType"],
    "zero1": ["DeepSpeedEngine", "DeepSpeedZeroOptimizer", "AdamW"],
    "zero2": ["DeepSpeedEngine", "DeepSpeedZeroOptimizer", "AdamW"],
    "zero3": ["DeepSpeedEngine", "DeepSpeedZeroOptimizer_Stage3", "AdamW"],
    "zero2_offload": ["DeepSpeedEngine", "DeepSpeedZeroOptimizer", "DeepSpeedCPUAdam"],
}
# fmt: on


class TokenRows:
    """Fixed-length synthetic sequences, learnable (counting from a random start by a stride of 1, 2 or 3,
    modulo the vocabulary): one global batch of 8 per iteration, in order."""

    def __init__(self) -> None:
        import torch

        generator = torch.Generator().manual_seed(3)
        rows = ITERATIONS * 8
        start = torch.randint(0, VOCAB, (rows, 1), generator=generator)
        stride = torch.randint(1, 4, (rows, 1), generator=generator)
        self.tokens = (start + stride * torch.arange(SEQUENCE)) % VOCAB

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def tiny_gpt2():
    """The same weights on every rank and in every run."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=SEQUENCE,
        resid_pdrop=0,
        embd_pdrop=0,
        attn_pdrop=0,
    )
    torch.manual_seed(1234)
    return GPT2LMHeadModel(config)


def own_loop(flags: list[str]) -> dict:
    """The user's loop → {"losses": per iteration, the mean micro-batch loss over the whole global batch,
    "wrapping": the classes of the module, optimizer and inner optimizer it ran}."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from rapidtrain.train.engine import Engine

    engine = Engine(argv=FLAGS + flags)
    loader = DataLoader(
        TokenRows(), batch_size=2, shuffle=False
    )  # in order: the same global batches anywhere
    model, optimizer, _, loader, _ = engine.compose(
        model=tiny_gpt2(), train_dataloader=loader, optimizer=None
    )
    model.train()
    losses, pending = {}, []
    for batch in loader:
        loss = model(**batch).loss
        engine.backward(loss)
        pending.append(loss.detach().double())
        if engine.accumulation.is_last:
            total = torch.stack(pending).sum()
            count = torch.tensor(float(len(pending)), dtype=torch.float64)
            if dist.is_initialized():
                dist.all_reduce(total)
                dist.all_reduce(count)
            losses[len(losses) + 1] = float(total / count)
            pending = []
        engine.step()
        if len(losses) == ITERATIONS:
            break
    inner = getattr(engine.runner.optimizer, "optimizer", None)
    return {"losses": losses, "wrapping": [type(x).__name__ for x in (model, engine.runner.optimizer, inner)]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, dict[str, dict]]:
    out = tmp_path_factory.mktemp("hf_compose") / "runs.json"
    torchrun(2, Path(__file__), [str(out)], timeout=1200, warm=True)
    two_ranks = json.loads(out.read_text())
    for run in two_ranks.values():
        run["losses"] = {int(k): v for k, v in run["losses"].items()}
    return own_loop([]), two_ranks


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_hf_model_in_own_loop_matches_single_process_losses(runs, mode):
    """ITERATIONS iterations with accumulation 2 on 2 ranks: the losses of one process accumulating 4, fp32
    within 1e-5."""
    single, two_ranks = runs
    assert sorted(single["losses"]) == list(range(1, ITERATIONS + 1))
    assert single["losses"][ITERATIONS] < single["losses"][1] - 0.1  # it trains
    assert single["wrapping"] == ["GPT2LMHeadModel", "AdamW", "NoneType"]
    assert two_ranks[mode]["wrapping"] == WRAPPING[mode]
    assert relative_difference(two_ranks[mode]["losses"], single["losses"]) < 1e-5


if __name__ == "__main__":
    from rapidtrain.core.process import exit_after

    def _main() -> None:
        import torch.distributed as dist

        results = {mode: own_loop(flags) for mode, flags in MODES.items()}
        if dist.get_rank() == 0:
            Path(sys.argv[1]).write_text(json.dumps(results))
        dist.barrier()
        dist.destroy_process_group()

    exit_after(_main)  # no interpreter finalization racing gloo's threads
