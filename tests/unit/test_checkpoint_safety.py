"""Checkpoints load without running code stored in them, and damaged files are named before anything is read.

Each crafted file carries a payload that would create a file when unpickled; the tests assert that the load is
refused with the file's name and that the file was never created. The checkpoints are real
torch.distributed.checkpoint folders written by `save_checkpoint` from a real model and AdamW.
"""

from __future__ import annotations

import json
import pickle
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from rapidtrain.checkpoint.checkpointer import (
    COMMON_FILE,
    LEGACY_COMMON_FILE,
    MANIFEST_FILE,
    CheckpointError,
    file_checksum,
    iteration_dir,
    load_checkpoint,
    rng_state,
    save_checkpoint,
)
from rapidtrain.optim.lr_schedule import LRScheduler, lr_schedule_from_iters


class ModelAndOptimizer:
    """The checkpoint protocol of rapidtrain's runners (state_dict / state_dict_for_loading / load_state_dict)
    over a plain module and optimizer, as TorchRunner implements it for one process."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.module = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=1e-2)
        self.module(torch.randn(3, 8)).sum().backward()
        self.optimizer.step()  # optimizer state exists (exp_avg, step)

    def state_dict(self) -> dict:
        model, optimizer = get_state_dict(self.module, self.optimizer)
        return {"model": model, "optimizer": optimizer}

    def state_dict_for_loading(self, load_optimizer: bool) -> dict:
        state = self.state_dict()
        if not load_optimizer:
            state.pop("optimizer")
        return state

    def load_state_dict(self, state: dict, load_optimizer: bool = True) -> None:
        set_state_dict(self.module, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])


class Payload:
    """Unpickling this creates `marker`: the stand-in for any code an attacker would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


MODEL = {"model_type": "gpt", "num_layers": 2, "hidden_size": 16}
ARGS = {"args": {"num_layers": 2}, "plan": {"model": MODEL}}  # what a run records: its flags and plan


def schedule(runner: ModelAndOptimizer) -> LRScheduler:
    settings = lr_schedule_from_iters(lr=1e-2, min_lr=0.0, style="cosine", train_iters=10, lr_decay_iters=None,
                                      lr_warmup_iters=2, lr_warmup_fraction=None, global_batch_size=4)
    return LRScheduler(runner.optimizer, settings)


def rewrite_manifest(directory: Path) -> None:
    """What an attacker who changes a file does too: the manifest protects against damage, not against them."""
    manifest = json.loads((directory / MANIFEST_FILE).read_text())
    manifest["files"] = {name: file_checksum(directory / name) for name in manifest["files"]
                         if (directory / name).exists()}
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest))


@pytest.fixture
def saved(tmp_path) -> Path:
    runner = ModelAndOptimizer()
    save_checkpoint(tmp_path / "ck", 3, runner, schedule(runner), consumed_samples=12, config=ARGS,
                    extra={"best_metric": float("-inf"), "history": [{"epoch": 1, "loss": 0.5}]})
    return tmp_path / "ck"


def load(folder: Path, **kwargs):
    runner = ModelAndOptimizer(seed=1)
    return runner, load_checkpoint(folder, runner, schedule(runner), MODEL, **kwargs)


def test_round_trip_restores_weights_position_extras_and_random_state(saved):
    reference = ModelAndOptimizer()
    python_next, numpy_next, torch_next = random.random(), np.random.rand(), torch.rand(1)
    random.seed(99), np.random.seed(99), torch.manual_seed(99)  # noqa: B018 - scramble before loading
    runner, loaded = load(saved)
    assert (loaded.iteration, loaded.consumed_samples) == (3, 12)
    assert loaded.extra == {"best_metric": float("-inf"), "history": [{"epoch": 1, "loss": 0.5}]}
    for ours, theirs in zip(runner.module.parameters(), reference.module.parameters(), strict=True):
        assert torch.equal(ours, theirs)
    # The state saved was the one just before those three draws.
    assert (random.random(), np.random.rand(), torch.rand(1)) == (python_next, numpy_next, torch_next)
    assert loaded.notes == []
    files = json.loads((iteration_dir(saved, 3) / MANIFEST_FILE).read_text())["files"]
    assert set(files) == {".metadata", "__0_0.distcp", COMMON_FILE, "rng/rank_0.pt"}


def test_common_state_is_json_and_rng_state_plain_tensors(saved):
    directory = iteration_dir(saved, 3)
    common = json.loads((directory / COMMON_FILE).read_text())
    assert common["iteration"] == 3 and common["args"] == ARGS["args"] and common["plan"] == ARGS["plan"]
    assert common["lr_scheduler"]["num_steps"] == 0
    rng = torch.load(directory / "rng" / "rank_0.pt", weights_only=True)  # no allow-list needed
    assert set(rng) >= {"python_state", "numpy_keys", "torch"} and rng["numpy_keys"].shape == (624,)


def test_crafted_rng_file_is_refused_and_runs_nothing(saved, tmp_path):
    marker = tmp_path / "pwned"
    directory = iteration_dir(saved, 3)
    torch.save({"python": Payload(marker)}, directory / "rng" / "rank_0.pt")
    rewrite_manifest(directory)
    with pytest.raises(CheckpointError, match=r"rng/rank_0\.pt: refused: it holds objects other than tensors"):
        load(saved)
    assert not marker.exists()


def test_crafted_metadata_is_refused_and_runs_nothing(saved, tmp_path):
    marker = tmp_path / "pwned"
    directory = iteration_dir(saved, 3)
    (directory / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    rewrite_manifest(directory)
    refused = r"\.metadata: refused: it asks to import io\.open, which checkpoint metadata never holds"
    with pytest.raises(CheckpointError, match=refused):
        load(saved)
    assert not marker.exists()


def test_distcp_entry_holding_a_pickled_object_is_refused_and_runs_nothing(tmp_path):
    """An optimizer hyper-parameter replaced by an object: torch's planner would unpickle it fully."""
    marker = tmp_path / "pwned"
    poisoned = ModelAndOptimizer()
    clean_state = poisoned.state_dict

    def state_with_payload() -> dict:
        state = clean_state()
        state["optimizer"]["param_groups"][0]["lr"] = Payload(marker)
        return state

    poisoned.state_dict = state_with_payload  # type: ignore[method-assign]
    save_checkpoint(tmp_path / "ck", 3, poisoned, schedule(poisoned), 12, ARGS)
    assert not marker.exists()  # pickling only records the call
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: refused: its entry 'optimizer\.param_groups\.0\.lr'"):
        load(tmp_path / "ck")
    assert not marker.exists()


def test_legacy_common_pt_with_a_payload_is_refused(saved, tmp_path):
    marker = tmp_path / "pwned"
    directory = iteration_dir(saved, 3)
    (directory / COMMON_FILE).unlink()
    (directory / MANIFEST_FILE).unlink()
    torch.save({"iteration": 3, "args": Payload(marker)}, directory / LEGACY_COMMON_FILE)
    with pytest.raises(CheckpointError, match=r"common\.pt: refused"):
        load(saved)
    assert not marker.exists()


def test_checkpoint_of_the_previous_format_still_loads(saved, capsys):
    """common.pt and the getstate() tuples of rapidtrain before format 2, read with weights_only=True."""
    directory = iteration_dir(saved, 3)
    common = json.loads((directory / COMMON_FILE).read_text())
    torch.save(common, directory / LEGACY_COMMON_FILE)
    (directory / COMMON_FILE).unlink()
    (directory / MANIFEST_FILE).unlink()
    random.seed(5), np.random.seed(5), torch.manual_seed(5)  # noqa: B018
    legacy_rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    expected = (random.random(), np.random.rand())
    torch.save(legacy_rng, directory / "rng" / "rank_0.pt")
    _, loaded = load(saved)
    assert (loaded.iteration, loaded.consumed_samples) == (3, 12)
    assert (random.random(), np.random.rand()) == expected
    assert "has no manifest.json" in capsys.readouterr().out


@pytest.mark.parametrize("damage", ["flip", "nan", "truncate"])
def test_damaged_distcp_is_named_before_anything_is_read(saved, damage):
    path = iteration_dir(saved, 3) / "__0_0.distcp"
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    elif damage == "nan":  # fp32 NaNs over a stretch of weights: the sizes still agree
        data[-4096:-2048] = np.full(512, np.nan, dtype=np.float32).tobytes()
    else:
        del data[-100:]
    path.write_bytes(bytes(data))
    reason = "bytes, the manifest says" if damage == "truncate" else "CRC-32"
    with pytest.raises(CheckpointError, match=rf"__0_0\.distcp is damaged: .*{reason}"):
        load(saved)


def test_truncated_metadata_without_manifest_is_named(saved):
    directory = iteration_dir(saved, 3)
    (directory / MANIFEST_FILE).unlink()
    (directory / ".metadata").write_bytes((directory / ".metadata").read_bytes()[:500])
    with pytest.raises(CheckpointError, match=r"\.metadata: damaged \(.*\): truncated or overwritten"):
        load(saved)


def test_missing_rng_is_said(saved):
    shutil.rmtree(iteration_dir(saved, 3) / "rng")
    rewrite_manifest(iteration_dir(saved, 3))
    _, loaded = load(saved)
    assert any("rng/rank_0.pt is missing: random state not restored" in note for note in loaded.notes)


def test_rng_state_holds_no_python_objects():
    state = rng_state()
    assert all(isinstance(v, (torch.Tensor, int, float, str, type(None))) for v in state.values())


def test_a_full_disk_during_a_save_is_named_and_leaves_no_partial_checkpoint(tmp_path):
    """The file-size limit (RLIMIT_FSIZE) makes writes fail as a full disk does; run in a child so the limit
    stays there."""
    import subprocess
    import sys
    import textwrap

    child = textwrap.dedent(f"""
        import resource, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail the write with EFBIG instead of killing
        from tests.unit.test_checkpoint_safety import ModelAndOptimizer, schedule, ARGS
        from rapidtrain.checkpoint.checkpointer import save_checkpoint, CheckpointError
        runner = ModelAndOptimizer()
        save_checkpoint({str(tmp_path / 'ck')!r}, 2, runner, schedule(runner), 8, ARGS)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))
        try:
            save_checkpoint({str(tmp_path / 'ck')!r}, 4, runner, schedule(runner), 16, ARGS)
        except CheckpointError as error:
            print("refused:", error)
    """)
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, cwd=repo, timeout=120,
                          env={**__import__("os").environ, "PYTHONPATH": str(repo)})
    assert "refused: saving iter_0000004 into" in done.stdout, done.stdout + done.stderr[-2000:]
    assert "File too large" in done.stdout and "the earlier ones are intact" in done.stdout
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    assert (tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text() == "2\n"
