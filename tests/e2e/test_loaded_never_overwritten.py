"""Nothing a run loaded is overwritten by it: a fine-tune (`--finetune`, which starts again at iteration 0) into the
folder it loads from is refused before training, every file of that folder unchanged (hashed); into a folder of its
own it trains and saves there, the loaded folder still unchanged."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from rapidtrain.checkpoint.save_folder import SaveFolderError, check_resume_safety
from rapidtrain.pretrain import ENTRY, MegatronPreTrainer
from rapidtrain.train.engine import Engine
from tests.launch import TINY_GPT_SHAPE

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
TINY = [*TINY_GPT_SHAPE, "--micro-batch-size", "2", "--global-batch-size", "4", "--num-workers", "0",
        "--eval-iters", "0", "--lr", "1e-3", "--train-iters", "2", "--log-interval", "1", "--save-interval", "2"]


def folder_hash(folder: Path) -> dict[str, str]:
    """Every file under `folder` (names and contents), the lock file's holder text aside."""
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file() and path.name != ".rapidtrain.lock"}


def train(argv: list[str]) -> None:
    engine = Engine(argv=argv, entry=ENTRY)
    try:
        MegatronPreTrainer(engine).train()
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, demo_data) -> Path:
    folder = tmp_path_factory.mktemp("pretrained") / "ck"
    train([*TINY, "--save", str(folder)])
    assert (folder / "iter_0000002").is_dir()
    return folder


def test_finetune_into_the_folder_it_loads_is_refused_before_training_and_touches_nothing(pretrained, one_thread):
    before = folder_hash(pretrained)
    with pytest.raises(SaveFolderError) as refused:
        train([*TINY, "--finetune", "--load", str(pretrained), "--save", str(pretrained)])
    message = str(refused.value)
    assert "--finetune" in message and "iteration 0" in message and "iter_0000002" in message
    assert "a --save folder of its own" in message
    assert folder_hash(pretrained) == before


def test_finetune_into_its_own_folder_saves_there_and_leaves_the_loaded_one(pretrained, tmp_path, one_thread):
    before = folder_hash(pretrained)
    train([*TINY, "--finetune", "--load", str(pretrained), "--save", str(tmp_path / "tuned")])
    assert (tmp_path / "tuned" / "iter_0000002").is_dir()
    assert folder_hash(pretrained) == before


def test_the_launcher_check_refuses_it_too_and_a_plain_resume_is_allowed(pretrained):
    with pytest.raises(SaveFolderError):
        check_resume_safety(pretrained, pretrained, restarts_count=True)
    check_resume_safety(pretrained, pretrained)  # resuming the run itself continues its count: nothing overwritten
