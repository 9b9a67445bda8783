"""Local data for the compatibility tests, made once per session the way a Megatron user makes theirs: tiny
GPT-2 BPE (vocab.json + merges.txt) and BERT WordPiece (vocab.txt) tokenizers trained on Python's help topics,
and indexed data written by our scripts/preprocess_data.py (document level for GPT, sentence-split for BERT).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.launch import REPO, child_env


@dataclass
class MegatronData:
    folder: Path
    gpt_vocab: Path  # gpt2-vocab.json
    gpt_merges: Path  # gpt2-merges.txt
    bert_vocab: Path  # bert-vocab.txt
    gpt_prefix: str  # my-gpt2_text_document
    bert_prefix: str  # my-bert_text_sentence
    gpt_parts: list[str]  # three smaller corpora, for blends
    train_text: Path  # text lines, for fine-tuning
    valid_text: Path


def _documents() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def _preprocess(corpus: Path, prefix: Path, *flags: str) -> None:
    subprocess.run([sys.executable, str(REPO / "scripts" / "preprocess_data.py"), "--input", str(corpus),
                    "--output-prefix", str(prefix), "--workers", "1", *flags],
                   check=True, capture_output=True, env=child_env(), cwd=REPO, timeout=600)


@pytest.fixture(scope="session")
def megatron_data(tmp_path_factory) -> MegatronData:
    from tokenizers import BertWordPieceTokenizer, ByteLevelBPETokenizer

    folder = tmp_path_factory.mktemp("megatron-data")
    documents = _documents()
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(documents, vocab_size=600, special_tokens=["<|endoftext|>"], show_progress=False)
    bpe.save_model(str(folder))
    (folder / "vocab.json").rename(folder / "gpt2-vocab.json")
    (folder / "merges.txt").rename(folder / "gpt2-merges.txt")
    wordpiece = BertWordPieceTokenizer(lowercase=True)
    wordpiece.train_from_iterator(documents, vocab_size=500, min_frequency=2, show_progress=False,
                                  special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    wordpiece.save_model(str(folder))
    (folder / "vocab.txt").rename(folder / "bert-vocab.txt")
    corpus = folder / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    gpt = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(folder / "gpt2-vocab.json"),
           "--merge-file", str(folder / "gpt2-merges.txt"), "--append-eod"]
    _preprocess(corpus, folder / "my-gpt2", *gpt)
    _preprocess(corpus, folder / "my-bert", "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file",
                str(folder / "bert-vocab.txt"), "--split-sentences")
    parts = []
    for index in range(3):  # three corpora for the GPT-3 scripts' weighted blend
        part = folder / f"part{index}.jsonl"
        part.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents[index::3]))
        _preprocess(part, folder / f"part{index}", *gpt)
        parts.append(str(folder / f"part{index}_text_document"))
    lines = [line.strip() for d in documents for line in d.splitlines() if len(line.strip()) > 40]
    (folder / "train.txt").write_text("\n".join(lines[:64]) + "\n")
    (folder / "valid.txt").write_text("\n".join(lines[64:80]) + "\n")
    return MegatronData(folder, folder / "gpt2-vocab.json", folder / "gpt2-merges.txt", folder / "bert-vocab.txt",
                        str(folder / "my-gpt2_text_document"), str(folder / "my-bert_text_sentence"), parts,
                        folder / "train.txt", folder / "valid.txt")


@pytest.fixture(scope="session")
def local_files(megatron_data, demo_data, tmp_path_factory):
    """The files a launch script of tests/compat/launch_scripts.json names, made here: Megatron data and
    tokenizers, a SentencePiece model, a Hugging Face tokenizer folder, JSON text."""
    from transformers import PreTrainedTokenizerFast

    from tests.compat.launch_data import LocalFiles

    folder = tmp_path_factory.mktemp("launch")
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer(str(megatron_data.gpt_vocab), str(megatron_data.gpt_merges))
    hf = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>",
                                 bos_token="<|endoftext|>", unk_token="<|endoftext|>")
    hf.save_pretrained(folder / "hf-tokenizer")
    text = folder / "text.json"
    text.write_text("".join(json.dumps({"text": line}) + "\n" for line in megatron_data.train_text.read_text()
                            .splitlines()))
    return LocalFiles(folder, megatron_data.gpt_prefix, megatron_data.bert_prefix, str(megatron_data.gpt_vocab),
                      str(megatron_data.gpt_merges), str(megatron_data.bert_vocab), demo_data.tokenizer_model,
                      str(folder / "hf-tokenizer"), str(text), _tiny_bert(folder / "hf-bert", megatron_data.bert_vocab))


def _tiny_bert(folder, vocab) -> str:
    """A Hugging Face BERT folder in bert-base-uncased's shape (config.json and the test's WordPiece vocabulary; no
    weights: planning reads the config only)."""
    from transformers import BertConfig, BertTokenizerFast

    tokenizer = BertTokenizerFast(vocab_file=str(vocab), do_lower_case=True)
    BertConfig(vocab_size=len(vocab.read_text().splitlines())).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)
