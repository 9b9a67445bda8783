"""Text generation: the KV cache decodes the same tokens as recomputing, greedy / temperature / top-k / top-p
choose as specified, padded vocabulary rows and end-of-document are handled, and `rapidtrain generate` continues
a prompt from a saved checkpoint."""

from __future__ import annotations

import pytest
import torch

from rapidtrain import cli
from rapidtrain.models import ModelConfig, build_model
from rapidtrain.train.generation import SamplingSettings, generate, generate_sample, next_token
from tests.launch import TINY_GPT_SHAPE

SMALL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16,
             max_position_embeddings=48, hidden_dropout=0.0, attention_dropout=0.0)
LLAMA = dict(normalization="RMSNorm", swiglu=True, num_query_groups=2, add_bias_linear=False,
             position_embedding_type="rope", tie_embeddings=False, ffn_hidden_size=48)
MIXTRAL = LLAMA | dict(num_experts=(4, 4), moe_router_topk=2, moe_token_dropping=False)


def model_of(**shape):
    return build_model(ModelConfig(**SMALL | shape), seed=3).eval()


def prompt(batch: int = 2, length: int = 5) -> torch.Tensor:
    return torch.randint(0, 64, (batch, length), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("shape", [{}, LLAMA, MIXTRAL], ids=["gpt2", "llama", "llama-moe"])
def test_cached_and_uncached_greedy_decoding_give_identical_tokens(shape):
    model = model_of(**shape)
    settings = SamplingSettings(max_new_tokens=20)
    cached = generate(model, prompt(), settings)
    uncached = generate(model, prompt(), settings, use_cache=False)
    assert cached.shape == (2, 25)
    assert torch.equal(cached, uncached)
    assert torch.equal(cached[:, :5], prompt())


def test_cached_sampling_draws_the_same_tokens_as_uncached():
    model = model_of(**LLAMA)
    settings = SamplingSettings(max_new_tokens=12, temperature=0.9, top_k=20, top_p=0.9)
    runs = [generate(model, prompt(), settings, use_cache=cache, generator=torch.Generator().manual_seed(5))
            for cache in (True, False)]
    assert torch.equal(runs[0], runs[1])


def test_greedy_takes_the_most_likely_token_and_top_k_one_is_greedy():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [3.0, 0.0, 0.0, 0.0]])
    assert next_token(logits, SamplingSettings(), None).tolist() == [1, 0]
    sampled = next_token(logits, SamplingSettings(temperature=5.0, top_k=1), torch.Generator().manual_seed(0))
    assert sampled.tolist() == [1, 0]


def draws(logits: torch.Tensor, settings: SamplingSettings, count: int = 20000) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return next_token(logits.expand(count, -1), settings, generator)


def test_temperature_sampling_follows_the_softened_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    frequencies = torch.bincount(draws(logits, SamplingSettings(temperature=2.0)), minlength=4) / 20000
    assert torch.allclose(frequencies, (logits[0] / 2.0).softmax(-1), atol=0.015)


def test_top_k_and_top_p_sample_only_inside_their_set():
    probabilities = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probabilities.log()
    assert set(draws(logits, SamplingSettings(temperature=1.0, top_k=2)).tolist()) == {0, 1}
    assert set(draws(logits, SamplingSettings(temperature=1.0, top_p=0.7)).tolist()) == {0, 1}
    nucleus = draws(logits, SamplingSettings(temperature=1.0, top_p=0.9))
    assert set(nucleus.tolist()) == {0, 1, 2}
    frequencies = torch.bincount(nucleus, minlength=4)[:3] / 20000
    assert torch.allclose(frequencies, probabilities[0, :3] / 0.95, atol=0.015)  # renormalised inside the set


def test_padded_vocabulary_rows_are_never_chosen():
    model = model_of()
    model.output.register_forward_hook(lambda _m, _a, logits: logits + (torch.arange(64) >= 50) * 100.0)
    settings = SamplingSettings(max_new_tokens=6)
    assert (generate(model, prompt(), settings)[:, 5:] >= 50).all()  # the hook works: padding would win
    assert (generate(model, prompt(), settings, vocab_size=50)[:, 5:] < 50).all()


def test_end_of_document_stops_the_rows_that_reached_it():
    model = model_of()
    model.output.register_forward_hook(lambda _m, _a, logits: logits + (torch.arange(64) == 7) * 100.0)
    tokens = generate(model, prompt(), SamplingSettings(max_new_tokens=10), eos_id=7)
    assert tokens.shape == (2, 6) and (tokens[:, 5] == 7).all()


def test_min_new_tokens_holds_end_of_document_back():
    """A model that always prefers end of document (as a briefly trained demo model often does right after its
    prompt) writes min_new_tokens tokens first, then ends."""
    model = model_of()
    model.output.register_forward_hook(lambda _m, _a, logits: logits + (torch.arange(64) == 7) * 100.0)
    tokens = generate(model, prompt(), SamplingSettings(max_new_tokens=10, min_new_tokens=3), eos_id=7)
    assert tokens.shape == (2, 9)
    assert not (tokens[:, 5:8] == 7).any() and (tokens[:, 8] == 7).all()


def test_learned_positions_bound_the_length():
    with pytest.raises(ValueError, match="--max-new-tokens 50 exceeds the model's 48 learned positions"):
        generate(model_of(), prompt(), SamplingSettings(max_new_tokens=50))


def test_settings_refuse_filters_without_sampling():
    assert SamplingSettings(top_k=5).problems() == [
        "--top-k / --top-p filter sampling; greedy decoding (--temperature 0) has nothing to filter: give "
        "--temperature > 0 (e.g. 0.8)"]
    assert SamplingSettings(temperature=0.7, top_k=5, top_p=0.9).problems() == []


def test_generate_sample_continues_a_prompt_as_text(demo_data):
    from rapidtrain.data.tokenizer import TokenizerSettings, build_tokenizer

    tokenizer = build_tokenizer(TokenizerSettings(demo_data.tokenizer_type, tokenizer_model=demo_data.tokenizer_model))
    model = build_model(ModelConfig(**SMALL | {"vocab_size": 8192, "max_position_embeddings": 64}), seed=3)
    model.train()
    text = generate_sample(model, tokenizer, "The history of", max_new_tokens=8)
    assert text.startswith("The history of") and len(text) > len("The history of")
    assert model.training  # left as it was


def test_generate_sample_runs_compiled_layers_eagerly(demo_data):
    """--torch-compile's layers are not traced by the end-of-training sample: its KV-cache decoding recompiled them
    at every token on an H100 (eight times, until dynamo's limit). The eager backend traces without inductor."""
    from torch._dynamo.utils import counters

    from rapidtrain.data.tokenizer import TokenizerSettings, build_tokenizer
    from rapidtrain.parallel.transforms import apply_compile

    tokenizer = build_tokenizer(TokenizerSettings(demo_data.tokenizer_type, tokenizer_model=demo_data.tokenizer_model))
    model = build_model(ModelConfig(**SMALL | {"vocab_size": 8192, "max_position_embeddings": 64}), seed=3)
    expected = generate_sample(model, tokenizer, "The history of", max_new_tokens=6)
    apply_compile(model, backend="eager")
    torch._dynamo.reset()
    frames = counters["stats"]["calls_captured"]
    assert generate_sample(model, tokenizer, "The history of", max_new_tokens=6) == expected
    assert counters["stats"]["calls_captured"] == frames
    model(torch.zeros((1, 4), dtype=torch.long))  # outside the sample the layers are compiled
    assert counters["stats"]["calls_captured"] > frames


def test_generate_sample_stops_where_the_learned_positions_end(demo_data):
    from rapidtrain.data.tokenizer import TokenizerSettings, build_tokenizer

    tokenizer = build_tokenizer(TokenizerSettings(demo_data.tokenizer_type, tokenizer_model=demo_data.tokenizer_model))
    model = build_model(ModelConfig(**SMALL | {"vocab_size": 8192, "max_position_embeddings": 8}), seed=3)
    prompt_length = len(tokenizer.tokenize("The history of"))
    text = generate_sample(model, tokenizer, "The history of", max_new_tokens=24)  # the demo's 24 do not fit in 8
    assert len(tokenizer.tokenize(text)) >= prompt_length + 1 and text.startswith("The history of")
    assert generate_sample(model, tokenizer, "The history of " * 4, max_new_tokens=24) == "The history of " * 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, demo_data):
    from rapidtrain.pretrain import main

    folder = tmp_path_factory.mktemp("generate") / "ck"
    main([*TINY_GPT_SHAPE, "--micro-batch-size", "2", "--num-workers", "0", "--eval-iters", "0", "--lr", "1e-3",
          "--lr-warmup-iters", "1", "--train-iters", "2", "--save", str(folder)])
    return folder


def test_generate_command_continues_a_prompt_from_a_checkpoint(checkpoint, capsys):
    argv = ["generate", "--load", str(checkpoint), "--prompt", "Once upon a time", "--max-new-tokens", "12"]
    assert cli.main(argv) == 0
    greedy = capsys.readouterr().out.strip()
    assert greedy.startswith("Once upon a time") and len(greedy) > len("Once upon a time")
    assert cli.main([*argv, "--no-kv-cache"]) == 0
    assert capsys.readouterr().out.strip() == greedy
    sampled = [*argv, "--temperature", "0.8", "--top-k", "40", "--top-p", "0.95", "--seed", "7"]
    assert cli.main(sampled) == 0
    first = capsys.readouterr().out
    assert cli.main(sampled) == 0
    assert capsys.readouterr().out == first  # the seed fixes the draw


def test_generate_command_refuses_bad_settings_and_flags_clearly(checkpoint, tmp_path, capsys):
    base = ["generate", "--load", str(checkpoint), "--prompt", "x"]
    assert cli.main([*base, "--top-p", "0.9"]) == 2
    assert "--temperature > 0" in capsys.readouterr().err
    assert cli.main([*base, "--tokenizer-model", str(tmp_path / "missing.model")]) == 2
    assert "missing.model" in capsys.readouterr().err
    assert cli.main([*base, "--num-layers", "3"]) == 2
    assert "--num-layers (checkpoint 2, now 3)" in capsys.readouterr().err
    assert cli.main(["generate", "--load", str(tmp_path), "--prompt", "x"]) == 2
    assert "no latest_checkpointed_iteration.txt" in capsys.readouterr().err
