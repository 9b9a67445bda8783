"""The inference paths on CUDA (skipped without it, see conftest.py): `rapidtrain generate` on one GPU, batched greedy
equal to one prompt at a time in fp32 and with bitsandbytes 4/8-bit weights; bf16 and fp16 with the flash and eager
kernels; and with two GPUs or more, the layers split across them giving the same tokens as one GPU.

    python -m pytest tests/gpu/test_gpu_generation.py -v
"""

from __future__ import annotations

import json

import pytest
import torch

from rapidtrain import cli
from tests.launch import TINY_GPT_SHAPE

PROMPTS = ["Once upon a time", "The history of the city", "A", "In 1990 the band released their"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, demo_data):
    from rapidtrain.pretrain import main

    folder = tmp_path_factory.mktemp("gpu_generate") / "ck"
    main([*TINY_GPT_SHAPE, "--micro-batch-size", "2", "--num-workers", "0", "--eval-iters", "0", "--lr", "1e-3",
          "--lr-warmup-iters", "1", "--train-iters", "2", "--save", str(folder)])
    return folder


def completions(checkpoint, tmp_path, capsys, *flags: str) -> list[str]:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "out.jsonl"
    code = cli.main(["generate", "--load", str(checkpoint), "--input-file", str(prompts), "--output-file", str(out),
                     "--max-new-tokens", "8", *flags])
    err = capsys.readouterr().err
    assert code == 0, err
    first = err.splitlines()[0]
    assert ("device cuda" in first or "GPUs, layers split" in first) and all(
        f"dtype {dtype}" in first for dtype in ("bf16", "fp16") if f"--{dtype}" in flags)
    return [json.loads(line)["completion"] for line in out.read_text().splitlines()]


@pytest.mark.parametrize("flags", [[], ["--load-in-8bit"], ["--load-in-4bit"]], ids=["fp32", "int8", "nf4"])
def test_batched_generation_on_one_gpu_equals_one_prompt_at_a_time(checkpoint, tmp_path, capsys, flags):
    alone = completions(checkpoint, tmp_path, capsys, "--device", "cuda", *flags)
    assert completions(checkpoint, tmp_path, capsys, "--device", "cuda", "--batch-size", "4", *flags) == alone
    assert all(alone)


@pytest.mark.parametrize("flags", [["--bf16"], ["--fp16"], ["--fp16", "--attention-backend", "eager"]],
                         ids=["bf16", "fp16", "eager"])
def test_half_precision_generation_runs_in_the_dtype_asked(checkpoint, tmp_path, capsys, flags):
    """In bf16/fp16 a padded batch runs another SDPA kernel than one unpadded prompt, and the rounding differs; a
    barely trained model's near-tied logits may then choose differently, so only fp32 asserts equal tokens."""
    texts = completions(checkpoint, tmp_path, capsys, "--device", "cuda", "--batch-size", "4", *flags)
    assert len(texts) == 4 and all(texts)


def test_flash_generation_runs_unpadded_prompts_and_refuses_a_padded_batch(checkpoint, tmp_path, capsys):
    """CUDA's flash kernel takes no attention mask: one prompt at a time runs on it (found on an H100: a padded batch
    stopped with SDPA's "No available kernel"); a padded batch is refused up front, naming the flags."""
    texts = completions(checkpoint, tmp_path, capsys, "--device", "cuda", "--bf16", "--attention-backend", "flash")
    assert len(texts) == 4 and all(texts)
    prompts = tmp_path / "prompts.jsonl"
    code = cli.main(["generate", "--load", str(checkpoint), "--input-file", str(prompts), "--device", "cuda",
                     "--bf16", "--attention-backend", "flash", "--batch-size", "4", "--max-new-tokens", "8"])
    err = capsys.readouterr().err
    assert code == 2 and "--attention-backend flash with --batch-size 4" in err and "Traceback" not in err, err


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs or more")
def test_layers_split_across_gpus_give_the_tokens_of_one_gpu(checkpoint, tmp_path, capsys):
    one = completions(checkpoint, tmp_path, capsys, "--device", "cuda", "--batch-size", "4")
    assert completions(checkpoint, tmp_path, capsys, "--split-layers", "--batch-size", "4") == one
