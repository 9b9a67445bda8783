"""Pai-Megatron-Patch's raw JSON datasets (--dataset LLama-Pretrain-Raw / LLama-SFT): instruction/output records
tokenized with a real tokenizer (the demo corpus's SentencePiece model), the prompt masked out of the loss, padded to
--max-padding-length; the plan says so, and what they cannot serve is refused by name."""

from __future__ import annotations

import json

import pytest

from rapidtrain.config.arguments import parse_args
from rapidtrain.config.flag_surface import FlagRefused
from rapidtrain.data.chat_sft import build_raw_json_datasets
from rapidtrain.data.raw_json import RawJsonError, read_records
from rapidtrain.data.tokenizer import build_tokenizer

RECORDS = [
    {"instruction": "Name a colour.", "input": "", "output": "Blue is a colour."},
    {"instruction": "Add the numbers", "input": " two and three.", "output": "Five."},
    {"instruction": "Write a long answer.", "input": "", "output": "word " * 200},  # longer than the padding
]


@pytest.fixture(scope="module")
def tokenizer(demo_data):
    return build_tokenizer(demo_data.tokenizer_settings())


def test_records_are_read_from_a_json_array_or_json_lines(tmp_path, tokenizer):
    array, lines = tmp_path / "array.json", tmp_path / "lines.json"
    array.write_text(json.dumps(RECORDS))
    lines.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    assert read_records(str(array)) == read_records(str(lines)) == RECORDS
    (tmp_path / "bad.json").write_text(json.dumps([{"instruction": "no answer"}]))
    with pytest.raises(RawJsonError, match="bad.json record 1: no answer; a record needs one of output"):
        build_raw_json_datasets([[str(tmp_path / "bad.json")], None, None], "LLama-SFT", 32, tokenizer, [4, 0, 0], 1)


def test_only_the_answer_and_its_end_carry_loss_padded_to_the_length(tmp_path, tokenizer):
    path = tmp_path / "records.json"
    path.write_text(json.dumps(RECORDS))
    train, valid, test = build_raw_json_datasets([[str(path)], None, None], "LLama-Pretrain-Raw", 32, tokenizer,
                                                 [10, 2, 0], seed=5)
    assert len(train.ids) == 2 and train.dropped == 1  # the long record does not fit 32 + 1 tokens
    assert len(train) == 10 and len(valid) == 2 and test is None  # validation reads the training file, as Pai
    for index, record in enumerate(RECORDS[:2]):
        prompt = record["instruction"] + record["input"]
        whole = tokenizer.tokenize(prompt + record["output"]) + [tokenizer.eod]
        row = next(i for i in range(len(train)) if train._record(i) == index)
        sample = train[row]
        assert sample["tokens"].shape == sample["labels"].shape == sample["loss_mask"].shape == (32,)
        assert sample["labels"][:len(whole) - 1].tolist() == whole[1:]
        carrying = sample["labels"][sample["loss_mask"] == 1].tolist()
        assert carrying == whole[len(tokenizer.tokenize(prompt)):]  # the answer's tokens and the end of document
        assert tokenizer.detokenize(carrying[:-1]).strip() == record["output"].strip()
        assert not sample["loss_mask"][len(whole) - 1:].any()  # padding carries none


def test_passes_over_the_records_are_reshuffled_by_the_seed(tmp_path, tokenizer):
    path = tmp_path / "records.json"
    path.write_text(json.dumps(RECORDS[:2] * 5))  # 10 records
    train, *_ = build_raw_json_datasets([[str(path)], None, None], "LLama-SFT", 32, tokenizer, [30, 0, 0], seed=5)
    passes = [[train._record(i) for i in range(start, start + 10)] for start in (0, 10, 20)]
    assert all(sorted(order) == list(range(10)) for order in passes)
    assert passes[0] != passes[1]
    again, *_ = build_raw_json_datasets([[str(path)], None, None], "LLama-SFT", 32, tokenizer, [30, 0, 0], seed=5)
    assert [again._record(i) for i in range(30)] == sum(passes, [])
    assert train[0]["tokens"].shape == (31,)  # the SFT kind pads to --max-padding-length itself, then shifts


def test_the_plan_names_the_dataset_and_what_it_leaves_unused(tmp_path):
    path = tmp_path / "records.json"
    path.write_text(json.dumps(RECORDS))
    base = ["--seq-length", "64", "--dataset", "LLama-Pretrain-Raw", "--train-data-path", str(path)]
    args = parse_args([*base, "--data-path", str(path), "--max-padding-length", "48", "--eod-mask-loss",
                       "--split", "99,1,0"])
    notes = "\n".join(args.compat_notes)
    assert "--dataset LLama-Pretrain-Raw: Pai's raw JSON records tokenized at start" in notes
    assert "48 tokens a sample" in notes and args.data_path is None and not args.eod_mask_loss
    assert "--data-path " in notes and "--eod-mask-loss: no effect here" in notes and "--split 99,1,0: no eff" in notes
    with pytest.raises(FlagRefused, match="--max-padding-length 128: samples longer than --seq-length 64"):
        parse_args([*base, "--max-padding-length", "128"])
    with pytest.raises(FlagRefused, match="--dataset LLama-Pretrain-Raw: give the JSON file"):
        parse_args(["--dataset", "LLama-Pretrain-Raw"])
    with pytest.raises(FlagRefused, match="--dataset LLava-Pretrain-Raw: not read by rapidtrain"):
        parse_args(["--dataset", "LLava-Pretrain-Raw"])
    assert "--max-padding-length 64: no effect here" in "\n".join(
        parse_args(["--max-padding-length", "64"]).compat_notes)
