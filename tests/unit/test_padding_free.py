"""--padding-free: a micro-batch packed into one row gives each token the loss it has in a padded batch (so no token
attends to or predicts across another sequence), has no padded tokens, and is refused where the model would mix
the sequences."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from rapidtrain.config import arguments, rules
from rapidtrain.config.settings import RunContext
from rapidtrain.models import hf_config
from rapidtrain.tasks.base import FlattenCollator, PadCollator

LENGTHS = (7, 3, 12, 5)  # uneven, so the padded batch is mostly padding
VOCAB = 97
# fp32 on CPU: the same arithmetic per token, observed bit-identical here (eager and sdpa); the tolerance
# allows a kernel that tiles one long row differently from four short ones.
TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}


def tiny_model(kind: str, attention: str) -> torch.nn.Module:
    import transformers as t

    torch.manual_seed(0)
    if kind == "gpt2":
        config = t.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64, resid_pdrop=0.0,
                              embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        model = t.GPT2LMHeadModel(config)
    else:
        config = t.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        model = t.LlamaForCausalLM(config)
    model.set_attn_implementation(attention)
    return model.float().eval()


def features() -> list[dict]:
    generator = torch.Generator().manual_seed(1)
    rows = []
    for i, length in enumerate(LENGTHS):
        ids = torch.randint(1, VOCAB, (length,), generator=generator).tolist()
        rows.append({"input_ids": ids, "attention_mask": [1] * length, "labels": list(ids), "index": i})
    return rows


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each labelled next-token loss, in reading order (the causal shift, -100 dropped)."""
    logits, labels = logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)
    keep = labels != -100
    return F.cross_entropy(logits[keep], labels[keep], reduction="none")


def padded_and_packed(kind: str, attention: str, use_cache: bool = False):
    model = tiny_model(kind, attention)
    padded = PadCollator({"input_ids": 0, "attention_mask": 0, "labels": -100}, None)(features())
    packed = FlattenCollator()(features())
    with torch.no_grad():
        by_padding = token_losses(model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"]).logits,
                                  padded["labels"])
        by_packing = token_losses(model(input_ids=packed["input_ids"], position_ids=packed["position_ids"],
                                        use_cache=use_cache).logits, packed["labels"])
    return padded, packed, by_padding, by_packing


def test_the_collator_packs_one_row_with_restarting_positions_and_no_cross_sequence_label():
    packed = FlattenCollator()(features())
    total = sum(LENGTHS)
    assert packed["input_ids"].shape == packed["position_ids"].shape == packed["labels"].shape == (1, total)
    assert "attention_mask" not in packed
    starts = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0)[:-1].tolist()])
    assert packed["position_ids"][0, starts].tolist() == [0] * len(LENGTHS)
    assert (packed["labels"][0, starts] == -100).all()
    assert (packed["labels"] != -100).sum() == total - len(LENGTHS)
    assert packed["index"].tolist() == list(range(len(LENGTHS)))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_packed_tokens_have_the_losses_of_the_padded_batch(kind, attention):
    padded, packed, by_padding, by_packing = padded_and_packed(kind, attention)
    assert by_packing.shape == by_padding.shape == (sum(LENGTHS) - len(LENGTHS),)
    torch.testing.assert_close(by_packing, by_padding, **TOLERANCE)
    # The padded-token fraction: positions computed that hold no token.
    assert (padded["attention_mask"] == 0).float().mean() > 0.4
    assert packed["input_ids"].numel() == sum(LENGTHS)  # every position is a real token: fraction 0


def test_with_a_cache_transformers_does_not_see_the_packing():  # the check above can fail
    """Why CausalLM passes use_cache=False: with config.use_cache (True by default) the model builds a cache even in
    training, transformers skips packed-sequence detection, and later sequences attend to earlier ones."""
    _, _, by_padding, by_packing = padded_and_packed("llama", "sdpa", use_cache=True)
    assert not torch.allclose(by_packing, by_padding, **TOLERANCE)


def write_config(folder, model_type: str, **extra) -> str:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, **extra}))
    return str(folder)


def padding_free_messages(argv: list[str]) -> list[str]:
    args = arguments.parse_args(["--epochs", "1", "--lr", "1e-4", "--padding-free", *argv])
    return [m for m in rules.violations(args, RunContext(1, "cpu")) if m.startswith("--padding-free")]


def test_refused_where_the_model_would_mix_the_sequences(tmp_path):
    mamba = write_config(tmp_path / "mamba", "mamba")
    assert hf_config.packing_problem(mamba) is not None  # a state-space model carries state along the row
    (message,) = padding_free_messages(["--task", "causal_lm", "--pretrained-model-name-or-path", mamba])
    assert "attend across the packed sequences" in message and "Drop --padding-free" in message
    for model_type in ("gpt2", "llama", "mistral", "qwen2"):
        folder = write_config(tmp_path / model_type, model_type)
        assert hf_config.packing_problem(folder) is None
        assert padding_free_messages(["--task", "causal_lm", "--pretrained-model-name-or-path", folder]) == []


def test_refused_for_tasks_that_do_not_pack():
    (message,) = padding_free_messages(["--task", "masked_lm"])
    assert "--task masked_lm does not use it" in message


def test_the_plan_says_it():
    from rapidtrain.config.plan import from_args

    args = arguments.parse_args(["--task", "causal_lm", "--epochs", "1", "--lr", "1e-4", "--padding-free"])
    plan = from_args(args, RunContext(1, "cpu"))
    assert plan.data.padding_free
    assert any(choice.switch == "--padding-free" and "one row" in choice.engine for choice in plan.engines)
    default = from_args(arguments.parse_args(["--task", "causal_lm", "--epochs", "1", "--lr", "1e-4"]),
                        RunContext(1, "cpu"))
    assert not default.data.padding_free
    assert not any(choice.switch == "--padding-free" for choice in default.engines)
    assert not [n for n in plan.notes if n.startswith("--padding-free")]
    # A user script builds its own batches: the plan says the flag is the task's, not the script's.
    scripted = from_args(args, RunContext(1, "cpu", script="my_finetuner.py"))
    assert any(n.startswith("--padding-free") and "collate_fn" in n for n in scripted.notes)
