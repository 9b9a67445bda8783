"""`rapidtrain generate --load-in-4bit` takes transformers' 4-bit settings (--bnb-4bit-quant-type nf4|fp4,
--bnb-4bit-compute-dtype, --bnb-4bit-use-double-quant), refuses them without --load-in-4bit, and says the weights'
memory in its first line and the process's peak at the end: what quantization saved is visible."""

from __future__ import annotations

import re

import pytest

from rapidtrain import cli
from tests.launch import TINY_GPT_SHAPE

pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, demo_data):
    from rapidtrain.pretrain import main

    folder = tmp_path_factory.mktemp("generate4bit") / "ck"
    main([*TINY_GPT_SHAPE, "--micro-batch-size", "2", "--num-workers", "0", "--eval-iters", "0", "--lr", "1e-3",
          "--train-iters", "1", "--save", str(folder)])
    return folder


def generate(checkpoint, capsys, *flags: str) -> tuple[int, list[str]]:
    code = cli.main(["generate", "--load", str(checkpoint), "--prompt", "Return a new", "--max-new-tokens", "3",
                     *flags])
    return code, capsys.readouterr().err.strip().splitlines()


def weights_mib(first_line: str) -> float:
    return float(re.search(r"\| weights ([\d.,]+) MiB \|", first_line).group(1).replace(",", ""))


def test_4bit_format_flags_reach_the_layers_and_the_lines_say_the_memory(checkpoint, capsys):
    code, plain = generate(checkpoint, capsys)
    assert code == 0 and "quantization none" in plain[0]
    code, nf4 = generate(checkpoint, capsys, "--load-in-4bit")
    assert code == 0 and "bitsandbytes NF4 4-bit weights, computed in fp32 in 12 linear layers" in nf4[0]
    code, fp4 = generate(checkpoint, capsys, "--load-in-4bit", "--bnb-4bit-quant-type", "fp4",
                         "--bnb-4bit-use-double-quant", "--bnb-4bit-compute-dtype", "bfloat16")
    assert code == 0
    assert "bitsandbytes FP4 4-bit weights, double quantisation, computed in bf16 in 12 linear layers" in fp4[0]
    # The 12 linear layers' fp32 weights (4 bytes a weight) become half a byte: the total falls by their 7/8ths (the
    # embeddings and the head stay fp32). 2 layers of hidden 64: q, k, v, the projection (4 · 64²) and the MLP's two
    # (2 · 64 · 256) a layer; the quantization constants are small beside them (at least 80% of 7/8ths saved).
    linear_mib = 2 * (4 * 64 * 64 + 2 * 64 * 256) * 4 / 2**20
    assert weights_mib(plain[0]) - weights_mib(nf4[0]) >= 0.8 * 7 / 8 * linear_mib
    for lines in (plain, nf4, fp4):
        assert re.fullmatch(r"rapidtrain generate: peak memory [\d.,]+ MiB resident \(the whole process\)", lines[-1])


def test_the_layers_get_the_format_asked_for():
    import bitsandbytes as bnb
    import torch

    from rapidtrain.models import build_model
    from rapidtrain.models.config import ModelConfig
    from rapidtrain.train.generation.loading import quantize_linear_layers
    from rapidtrain.train.generation.runtime import FourBit

    model = build_model(ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=16,
                                    max_position_embeddings=16, vocab_size=128))
    assert quantize_linear_layers(model, 4, torch.float32, FourBit("fp4", "bf16", True)) == 6
    model.to("cpu")  # bitsandbytes quantises when the layer moves
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == 6  # q, k, v, the attention output and the two MLP projections
    for layer in layers:
        assert layer.weight.quant_type == "fp4" and layer.compute_dtype == torch.bfloat16
        assert layer.weight.quant_state.nested  # double quantisation: the scales are quantised too


def test_4bit_format_flags_without_load_in_4bit_are_refused_by_name(checkpoint, capsys):
    code, lines = generate(checkpoint, capsys, "--bnb-4bit-use-double-quant", "--bnb-4bit-quant-type", "fp4")
    assert code == 2
    assert ("--bnb-4bit-quant-type, --bnb-4bit-use-double-quant set the format of --load-in-4bit's weights" in
            lines[-1])
