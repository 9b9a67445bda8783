"""Pai-Megatron-Patch's JiebaBPETokenizer (--tokenizer-type JiebaBPETokenizer --vocab-file tokenizer.json): jieba's
words encoded as pre-split input by a BPE trained here, <|endoftext|> the end of document; without a jieba
package, one message saying which to install."""

from __future__ import annotations

import sys

import pytest

from rapidtrain.config.arguments import parse_args
from rapidtrain.data.tokenizer import TokenizerSettings, TokenizerSettingsError, build_tokenizer

TEXT = ["我们中出了一个叛徒", "今天天气很好，我们去公园散步", "机器学习是人工智能的一个分支"]


def train_bpe(folder, cut) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<|endoftext|>", "<sep>"])
    core.train_from_iterator([" ".join(cut(line)) for line in TEXT * 5], trainer)
    path = folder / "tokenizer.json"
    core.save(str(path))
    return str(path)


def test_text_is_cut_by_jieba_then_encoded_by_the_bpe(tmp_path):
    rjieba = pytest.importorskip("rjieba")
    from tokenizers import Tokenizer

    path = train_bpe(tmp_path, rjieba.cut)
    tokenizer = build_tokenizer(TokenizerSettings("JiebaBPETokenizer", vocab_file=path))
    core = Tokenizer.from_file(path)
    assert tokenizer.eod == core.token_to_id("<|endoftext|>") and tokenizer.vocab_size == core.get_vocab_size()
    for line in TEXT:
        ids = tokenizer.tokenize(line)
        assert ids == core.encode(rjieba.cut(line), is_pretokenized=True).ids
        assert tokenizer.detokenize(ids).replace(" ", "") == line


def test_without_a_jieba_package_the_message_says_what_to_install(tmp_path, monkeypatch):
    path = train_bpe(tmp_path, list)  # a real tokenizer.json (characters for words)
    monkeypatch.setitem(sys.modules, "rjieba", None)
    monkeypatch.setitem(sys.modules, "jieba", None)
    with pytest.raises(TokenizerSettingsError, match="neither rjieba nor jieba is installed: `pip install rjieba`"):
        build_tokenizer(TokenizerSettings("JiebaBPETokenizer", vocab_file=path))
    args = parse_args(["--tokenizer-type", "JiebaBPETokenizer", "--vocab-file", "tokenizer.json", "--lr", "1e-3",
                       "--train-iters", "1"])
    assert args.tokenizer_type == "JiebaBPETokenizer"
    pai = parse_args(["--patch-tokenizer-type", "JiebaBPETokenizer", "--vocab-file", "tokenizer.json", "--lr", "1e-3",
                      "--train-iters", "1"])
    assert pai.tokenizer_type == "JiebaBPETokenizer" and pai.vocab_file == "tokenizer.json"
