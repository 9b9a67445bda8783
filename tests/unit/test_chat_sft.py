"""Pai-Megatron-Patch's chat-template SFT (--dataset JSON-SFT --train-mode finetune): a tokenizer trained here with a
chat template renders each conversation; only the assistant's turns carry loss, each conversation weighs the same;
packing keeps conversations apart; epoch-based runs of the built-in GPT train on it end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rapidtrain.config.arguments import parse_args
from rapidtrain.config.flag_surface import FlagRefused
from rapidtrain.data.chat_sft import SampleLayout, build_raw_json_datasets, conversation_of
from rapidtrain.data.raw_json import RawJsonError
from rapidtrain.data.tokenizer import TokenizerSettings, build_tokenizer

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|> {% endif %}")
WORDS = "a colour is blue red the sum of two and three five name add numbers what say hello hi there".split()
RECORDS = [
    {"instruction": "name a colour", "input": "", "output": "blue is a colour"},
    {"messages": [{"role": "system", "content": "say hi"}, {"role": "user", "content": "hello"},
                  {"role": "assistant", "content": "hi there"}, {"role": "user", "content": "add two and three"},
                  {"role": "assistant", "content": "five"}]},
    {"conversations": [{"from": "human", "value": "what is the sum"}, {"from": "gpt", "value": "five"}]},
    {"query": "add the numbers", "input": " two and three", "response": "five"},
]


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    """A word-level tokenizer trained here, with a chat template and end/pad tokens, saved as a folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
    core = Tokenizer(models.WordLevel(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.train_from_iterator([" ".join(WORDS)] * 4, trainers.WordLevelTrainer(special_tokens=specials))
    hf = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", eos_token="<|end|>")
    hf.chat_template = TEMPLATE
    folder = tmp_path_factory.mktemp("chat_tokenizer")
    hf.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_folder):
    return build_tokenizer(TokenizerSettings("HuggingFaceTokenizer", tokenizer_model=tokenizer_folder))


def write_records(tmp_path, records=RECORDS):
    path = tmp_path / "sft.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return str(path)


def test_every_record_shape_becomes_chat_messages():
    assert conversation_of(RECORDS[0], "r") == [{"role": "user", "content": "name a colour"},
                                                {"role": "assistant", "content": "blue is a colour"}]
    assert [m["role"] for m in conversation_of(RECORDS[1], "r")] == ["system", "user", "assistant", "user", "assistant"]
    assert conversation_of(RECORDS[2], "r")[1] == {"role": "assistant", "content": "five"}
    assert conversation_of(RECORDS[3], "r")[0]["content"] == "add the numbers two and three"
    with pytest.raises(RawJsonError, match="r: no assistant turn"):
        conversation_of({"messages": [{"role": "user", "content": "hello"}]}, "r")
    with pytest.raises(RawJsonError, match="turn 1: a turn needs a role"):
        conversation_of({"conversations": [{"from": "narrator", "value": "x"}]}, "r")


def test_only_assistant_turns_carry_loss_each_conversation_weighing_one(tmp_path, tokenizer):
    train, _, _ = build_raw_json_datasets([[write_records(tmp_path)], None, None], "JSON-SFT", 40, tokenizer,
                                          [4, 0, 0], seed=3)
    assert train.ids.shape == (4, 41) and train.dropped == 0
    end = tokenizer.eod
    for row in range(4):
        sample = train[next(i for i in range(4) if train._record(i) == row)]
        assert sample["tokens"].shape == sample["labels"].shape == sample["loss_mask"].shape == (40,)
        assert sample["loss_mask"].sum() == pytest.approx(1.0)  # Pai's per-sequence average
        targets = sample["labels"][sample["loss_mask"] > 0]
        text = tokenizer.detokenize(targets)
        assert "<|user|>" not in text and "<|system|>" not in text and targets[-1] == end
    # The two-turn conversation: both answers (with their end tokens) and nothing of the prompts.
    sample = train[next(i for i in range(4) if train._record(i) == 1)]
    assert tokenizer.detokenize(sample["labels"][sample["loss_mask"] > 0]).split() == [
        "hi", "there", "<|end|>", "five", "<|end|>"]


def test_a_prompt_past_the_padding_drops_its_record_a_long_answer_is_cut(tmp_path, tokenizer):
    records = [{"instruction": "a " * 30, "output": "five"}, {"instruction": "hello", "output": "hi " * 30}]
    train, _, _ = build_raw_json_datasets([[write_records(tmp_path, records)], None, None], "JSON-SFT", 16,
                                          tokenizer, [1, 0, 0], seed=1)
    assert train.dropped == 1 and train.ids.shape == (1, 17)
    assert (train.ids[0, :16] != tokenizer.pad).all()  # cut at the padded length, not dropped


def test_packing_restarts_positions_and_keeps_attention_within_each_conversation(tmp_path, tokenizer):
    layout = SampleLayout(reset_position_ids=True, reset_attention_mask=True)
    train, _, _ = build_raw_json_datasets([[write_records(tmp_path)], None, None], "JSON-SFT", 48, tokenizer,
                                          [2, 0, 0], seed=0, layout=layout)
    assert len(train.ids) < len(RECORDS)  # several conversations a row
    sample = train[0]
    segments = train.segments[train._record(0)][:-1]
    starts = np.flatnonzero(np.diff(segments, prepend=-1))
    assert len(starts) >= 2 and (sample["position_ids"][starts] == 0).all()
    mask = sample["attention_mask"][0]  # True: masked out
    first, second = starts[0], starts[1]
    assert mask[second, first] and not mask[second, second] and not mask[second - 1, first]
    # A conversation's last token never learns the next one's first.
    assert sample["loss_mask"][second - 1] == 0
    assert sample["loss_mask"].sum() == pytest.approx(len(set(segments[sample["loss_mask"] > 0].tolist())))


def test_a_tokenizer_without_a_chat_template_is_refused_by_name(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.train_from_iterator(WORDS, trainers.WordLevelTrainer(special_tokens=["<unk>", "</s>"]))
    folder = tmp_path / "plain"
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="</s>").save_pretrained(folder)
    plain = build_tokenizer(TokenizerSettings("HuggingFaceTokenizer", tokenizer_model=str(folder)))
    with pytest.raises(RawJsonError, match="the tokenizer has no chat template"):
        build_raw_json_datasets([[write_records(tmp_path)], None, None], "JSON-SFT", 32, plain, [1, 0, 0], seed=0)


def test_the_plan_takes_pais_sft_flags_and_refuses_what_it_cannot_serve(tmp_path):
    path = write_records(tmp_path)
    base = ["--seq-length", "64", "--dataset", "JSON-SFT", "--train-data-path", path]
    args = parse_args([*base, "--train-mode", "finetune", "--max-padding-length", "48", "--eod-mask-loss",
                       "--reset-position-ids", "--reset-attention-mask", "--epochs", "2"])
    notes = "\n".join(args.compat_notes)
    assert "--dataset JSON-SFT: Pai's chat-template SFT" in notes and "conversations packed to a row" in notes
    assert "--eod-mask-loss: no effect here" in notes and not args.eod_mask_loss
    assert args.reset_position_ids and args.reset_attention_mask and args.max_padding_length == 48
    assert "--train-mode finetune: supervised fine-tuning on --dataset JSON-SFT" in notes
    with pytest.raises(FlagRefused, match="add --train-mode finetune"):
        parse_args(base)
    # Pai's SFT idxmap reads --data-path (tests/unit/test_pai_script_features.py): without it, nothing to read
    with pytest.raises(FlagRefused, match="--train-mode finetune with --dataset MMAP: Pai fine-tunes on --dataset MMAP "
                                          "--data-path PREFIX"):
        parse_args(["--dataset", "MMAP", "--train-mode", "finetune"])


def test_epoch_based_json_sft_trains_the_builtin_gpt(tmp_path, tokenizer_folder, capsys):
    """Two epochs over 8 conversations at a global batch of 4: 2 iterations an epoch, 4 in all, the loss falling;
    packed and unpacked both run."""
    from rapidtrain.pretrain import main
    from tests.launch import TINY_GPT_SHAPE

    path = write_records(tmp_path, RECORDS * 2)
    flags = [*TINY_GPT_SHAPE, "--micro-batch-size", "2", "--global-batch-size", "4", "--num-workers", "0",
             "--eval-iters", "0", "--lr", "3e-3", "--log-interval", "1", "--tokenizer-type", "HuggingFaceTokenizer",
             "--tokenizer-model", tokenizer_folder, "--dataset", "JSON-SFT", "--train-mode", "finetune",
             "--train-data-path", path, "--max-padding-length", "32", "--epochs", "2", "--seed", "3"]
    main([*flags, "--save", str(tmp_path / "sft"), "--save-interval", "4"])
    out = capsys.readouterr().out
    assert "--epochs 2: 8 samples an epoch, 2 iterations of 4 each (0 left out), 4 iterations in all" in out
    losses = lm_losses(out)
    assert len(losses) == 4 and losses[-1] < losses[0]
    # --finetune: the saved weights, from iteration 0 with a fresh optimizer and schedule: packed this time.
    main([*flags, "--load", str(tmp_path / "sft"), "--finetune", "--reset-position-ids", "--reset-attention-mask"])
    out = capsys.readouterr().out
    assert "--epochs 2: 4 samples an epoch, 1 iterations of 4 each" in out
    assert f"iteration {1:8d}/{2:8d}" in out and f"iteration {5:8d}/" not in out
    assert lm_losses(out)[0] < losses[0]


def lm_losses(out: str) -> list[float]:
    return [float(line.split("lm loss: ")[1].split()[0]) for line in out.splitlines() if "lm loss: " in line]
