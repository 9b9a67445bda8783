#!/usr/bin/env python
"""Throughput of scripts/preprocess_data.py's engine on a synthetic corpus, at 1 and 2 workers.

python bench/preprocess.py                      # 100k documents, GPT-2 BPE trained on the corpus
python bench/preprocess.py --tokenizer-type SentencePieceTokenizer --workers 1 2 4
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import resource
import sys
import tempfile

import numpy as np

if __package__ in (None, ""):
    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.isdir(os.path.join(_root, "rapidtrain")) and _root not in sys.path:
        sys.path.insert(0, _root)

from rapidtrain.data.preprocess import PreprocessSettings, preprocess  # noqa: E402
from rapidtrain.data.tokenizer import TokenizerSettings  # noqa: E402

SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "pe", "da", "qu", "ex", "on", "ar", "is", "um"]


def synthetic_documents(count: int, seed: int = 0) -> list[str]:
    """`count` documents of 20–200 pseudo-words drawn from a Zipf-like vocabulary of 20k words."""
    rng = np.random.default_rng(seed)
    words = ["".join(rng.choice(SYLLABLES, size=rng.integers(1, 5))) for _ in range(20000)]
    weights = 1.0 / np.arange(1, len(words) + 1)
    weights /= weights.sum()
    lengths = rng.integers(20, 201, size=count)
    picks = rng.choice(len(words), size=int(lengths.sum()), p=weights)
    documents, start = [], 0
    for length in lengths:
        documents.append(" ".join(words[i] for i in picks[start : start + length]) + ".")
        start += length
    return documents


def train_tokenizer(kind: str, documents: list[str], folder: str) -> TokenizerSettings:
    """A small tokenizer of `kind` trained on the first documents of the corpus."""
    sample = documents[:5000]
    if kind == "GPT2BPETokenizer":
        from tokenizers import ByteLevelBPETokenizer

        bpe = ByteLevelBPETokenizer()
        bpe.train_from_iterator(
            sample, vocab_size=8000, special_tokens=["<|endoftext|>"], show_progress=False
        )
        bpe.save_model(folder)
        return TokenizerSettings(
            kind, vocab_file=os.path.join(folder, "vocab.json"), merge_file=os.path.join(folder, "merges.txt")
        )
    if kind == "SentencePieceTokenizer":
        import sentencepiece

        prefix = os.path.join(folder, "sp")
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(sample), model_prefix=prefix, vocab_size=8000, minloglevel=2
        )
        return TokenizerSettings(kind, tokenizer_model=prefix + ".model")
    raise SystemExit(
        f"--tokenizer-type {kind}: this benchmark trains GPT2BPETokenizer or SentencePieceTokenizer"
    )


def _cpu_seconds() -> float:
    # This process plus its finished pool workers: the work done, whatever else loads the machine.
    return sum(
        usage.ru_utime + usage.ru_stime
        for usage in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--documents", type=int, default=100_000)
    parser.add_argument("--tokenizer-type", default="GPT2BPETokenizer")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        documents = synthetic_documents(args.documents)
        corpus = os.path.join(folder, "corpus.jsonl")
        with open(corpus, "w") as out:
            out.writelines(json.dumps({"text": text}) + "\n" for text in documents)
        tokenizer = train_tokenizer(args.tokenizer_type, documents, folder)
        size_mb = os.path.getsize(corpus) / 1e6
        print(
            f"corpus: {len(documents):,} documents, {size_mb:.1f} MB; tokenizer {args.tokenizer_type}; "
            f"{os.cpu_count()} CPUs"
        )
        rows, outputs = [], []
        for workers in args.workers:
            settings = PreprocessSettings(
                input=corpus,
                output_prefix=os.path.join(folder, f"out{workers}"),
                tokenizer=tokenizer,
                append_eod=True,
                workers=workers,
                progress=False,
            )
            before = _cpu_seconds()
            result = preprocess(settings)
            rows.append((workers, result, _cpu_seconds() - before))
            outputs.append(result.data_prefixes["text"])
        print(
            f"{'workers':>7} | {'seconds':>8} | {'documents/s':>12} | {'tokens/s':>12} | {'tokens':>12} | CPU s"
        )
        for workers, result, cpu in rows:
            print(
                f"{workers:>7} | {result.seconds:>8.2f} | {result.documents_per_second:>12,.0f} | "
                f"{result.tokens_per_second:>12,.0f} | {result.num_tokens:>12,} | {cpu:.1f}"
            )
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        print(f"load average now: {load} (other work on the machine slows the wall-clock columns, not CPU s)")
        same = all(
            filecmp.cmp(outputs[0] + suffix, other + suffix, shallow=False)
            for other in outputs[1:]
            for suffix in (".bin", ".idx")
        )
        print(f".bin/.idx byte-identical across worker counts: {same}")


if __name__ == "__main__":
    main()
