"""Library messages that do not concern the user are filtered at one place (core/library_warnings.py): optional
kernels a library looks for are hidden, a message a library repeats every forward is shown once, and
--show-library-warnings shows everything again."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from rapidtrain.core import library_warnings
from rapidtrain.core.library_warnings import HIDDEN, ONCE, quiet_library_messages
from tests.launch import REPO, TINY_GPT_SHAPE, child_env


@pytest.fixture
def quiet():
    # The filter remembers what it showed for the whole process: another test of this worker (a 4-bit generation)
    # may already have shown bitsandbytes' cast message once.
    library_warnings._FILTER.shown.clear()
    quiet_library_messages()
    yield
    quiet_library_messages()  # what every run starts with


def messages(caplog, name: str) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == name]


def test_a_message_repeated_every_forward_is_shown_once(quiet, caplog):
    logger = logging.getLogger(ONCE[0])
    with caplog.at_level(logging.WARNING):
        for _ in range(50):  # bitsandbytes' 8-bit matmul logs its cast on every call
            logger.warning("MatMul8bitLt: inputs will be cast from %s to float16 during quantization", "torch.float32")
        logger.warning("another message")
    assert messages(caplog, ONCE[0]) == [
        "MatMul8bitLt: inputs will be cast from torch.float32 to float16 during quantization", "another message"]


def test_messages_about_optional_pieces_are_hidden_and_the_flag_shows_them(quiet, caplog):
    with caplog.at_level(logging.WARNING):
        for name, start, _ in HIDDEN:
            logging.getLogger(name).warning(start + "something")
        logging.getLogger(HIDDEN[0][0]).warning("a message of its own")
    assert [r.getMessage() for r in caplog.records] == ["a message of its own"]

    quiet_library_messages(show=True)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        for name, start, _ in HIDDEN:
            logging.getLogger(name).warning(start + "something")
        for _ in range(3):
            logging.getLogger(ONCE[0]).warning("repeated")
    assert len(caplog.records) == len(HIDDEN) + 3


@pytest.mark.slow
def test_4bit_generation_prints_no_library_noise_unless_asked(tmp_path, demo_data):
    """bitsandbytes' 'Failed to load CPU gemm_4bit_forward' (an optional kernel package) opened every 4-bit run."""
    pytest.importorskip("bitsandbytes")
    from rapidtrain.pretrain import main

    folder = tmp_path / "ck"
    main([*TINY_GPT_SHAPE, "--micro-batch-size", "2", "--num-workers", "0", "--eval-iters", "0", "--lr", "1e-3",
          "--train-iters", "1", "--save", str(folder)])
    command = [sys.executable, "-m", "rapidtrain.cli", "generate", "--load", str(folder), "--prompt", "Return a new",
               "--max-new-tokens", "2", "--load-in-4bit"]
    quiet = subprocess.run(command, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    shown = subprocess.run([*command, "--show-library-warnings"], cwd=REPO, env=child_env(), capture_output=True,
                           text=True, timeout=300)
    assert quiet.returncode == shown.returncode == 0, quiet.stderr + shown.stderr
    assert "gemm_4bit_forward" not in quiet.stderr and "rapidtrain generate:" in quiet.stderr
    if "gemm_4bit_forward" not in shown.stderr:
        pytest.skip("this bitsandbytes found its optional CPU kernel package: nothing to hide here")
