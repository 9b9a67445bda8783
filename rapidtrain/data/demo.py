"""The built-in demo corpus: Python's own documentation, tokenized once into a cache for `pretrain.py`
runs that give no `--data-path`. Nothing is downloaded: the text is the installed standard library's.
"""

from __future__ import annotations

import ast
import fcntl
import glob
import io
import json
import os
import shutil
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rapidtrain.core.errors import UserError
from rapidtrain.data.preprocess import PreprocessSettings, preprocess
from rapidtrain.data.tokenizer import TokenizerSettings, build_tokenizer

DEMO_VERSION = "demo-v3"  # v2: the sentence-split corpus for BERT's binary head; v3: 2,000 pieces
# SentencePiece pieces. The corpus is small (2.2M characters): 2,000 pieces leave each one seen often enough that a
# few CPU minutes of training get well past word frequencies (held-out bigram statistics sit 1.15 nats under the
# unigram entropy at 2,000 pieces, 0.94 at 8,000: docs/first-hour.md), and the output layer costs a quarter of 8,000's.
VOCAB_SIZE = 2000
# The SentencePieceTokenizer's size over them (Megatron's <CLS> <SEP> <EOD> <MASK> <PAD> appended): the plan
# sizes the model by it before the corpus is first built; the build checks it.
TOKENIZER_VOCAB_SIZE = 2005
SEED = 1234
MIN_DOCSTRING_CHARS = 80  # shorter docstrings ("Return self.") teach little and bloat the count
MAX_CORPUS_CHARS = 4_000_000  # bounds the build time whatever the Python version
_MANIFEST = "manifest.json"
_SKIPPED_FOLDERS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclass
class DemoData:
    """Where the demo corpus lies and what it holds; train with `--data-path {data_prefix}`."""

    data_prefix: str
    tokenizer_model: str
    tokenizer_type: str = "SentencePieceTokenizer"
    num_documents: int = 0
    num_tokens: int = 0
    # The same documents split into sentences (PREFIX_text_sentence), which BERT's binary head needs.
    sentence_prefix: str = ""

    def tokenizer_settings(self) -> TokenizerSettings:
        """The tokenizer flags that read this corpus."""
        return TokenizerSettings(self.tokenizer_type, tokenizer_model=self.tokenizer_model)


def demo_tokenizer_settings(cache_dir: str | None = None) -> TokenizerSettings:
    """The tokenizer flags that read the demo corpus (its model is in the cache once the corpus is built)."""
    model = os.path.join(os.path.abspath(cache_dir or default_cache_dir()), "tokenizer.model")
    return TokenizerSettings("SentencePieceTokenizer", tokenizer_model=model, known_vocab_size=TOKENIZER_VOCAB_SIZE)


def default_cache_dir() -> str:
    """`$RAPIDTRAIN_CACHE/demo-v3`, or `~/.cache/rapidtrain/demo-v3`."""
    root = os.environ.get("RAPIDTRAIN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "rapidtrain")
    return os.path.join(root, DEMO_VERSION)


def prepare_demo_data(cache_dir: str | None = None, progress: bool = True) -> DemoData:
    """The demo corpus in `cache_dir`, built there first if absent.

    Concurrent callers (every rank of a run on one machine) wait on a file lock; one builds into a
    temporary folder and renames it into place, the others then read what it built.
    """
    cache_dir = os.path.abspath(cache_dir or default_cache_dir())
    manifest = os.path.join(cache_dir, _MANIFEST)
    if not os.path.isfile(manifest):
        os.makedirs(os.path.dirname(cache_dir), exist_ok=True)
        with open(cache_dir + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not os.path.isfile(manifest):  # else another process built it while we waited
                _build_in_place(cache_dir, progress)
    return _read_manifest(cache_dir)


def _build_in_place(cache_dir: str, progress: bool) -> None:
    """Build into a temporary folder beside `cache_dir`, then rename it; the caller holds the lock."""
    if os.path.isdir(cache_dir) and os.listdir(cache_dir):
        raise DemoCacheError(
            f"{cache_dir} exists but holds no {_MANIFEST}; it is not a demo cache: remove it, or "
            "point RAPIDTRAIN_CACHE elsewhere"
        )
    for stale in glob.glob(glob.escape(cache_dir) + ".tmp-*"):  # left by a killed builder
        shutil.rmtree(stale, ignore_errors=True)
    building = f"{cache_dir}.tmp-{os.getpid()}"
    if progress:
        print(f"rapidtrain: building the demo corpus in {cache_dir} (once)", file=sys.stderr)
    try:
        _build(building, progress)
        if os.path.isdir(cache_dir):
            os.rmdir(cache_dir)  # empty, checked above
        os.rename(building, cache_dir)
    finally:
        shutil.rmtree(building, ignore_errors=True)


class DemoCacheError(UserError, FileExistsError):
    """The demo corpus cache holds something other than what rapidtrain wrote there."""


def _read_manifest(cache_dir: str) -> DemoData:
    path = os.path.join(cache_dir, _MANIFEST)
    fix = f"remove {cache_dir} (the demo corpus is built again) or point RAPIDTRAIN_CACHE elsewhere"
    try:
        with open(path) as manifest:
            saved = json.load(manifest)
        paths = [saved[key] for key in ("data_prefix", "tokenizer_model", "tokenizer_type", "sentence_prefix")]
        counts = [saved[key] for key in ("num_documents", "num_tokens")]
    except (OSError, ValueError, KeyError, TypeError) as error:  # ValueError: not JSON, or not UTF-8
        raise DemoCacheError(f"{path}: damaged ({type(error).__name__}: {error}); {fix}") from None
    if not all(isinstance(p, str) for p in paths) or not all(type(n) is int and n >= 0 for n in counts):
        raise DemoCacheError(f"{path}: damaged (a value of the wrong type); {fix}")
    return DemoData(
        data_prefix=os.path.join(cache_dir, saved["data_prefix"]),
        tokenizer_model=os.path.join(cache_dir, saved["tokenizer_model"]),
        tokenizer_type=saved["tokenizer_type"],
        num_documents=saved["num_documents"],
        num_tokens=saved["num_tokens"],
        sentence_prefix=os.path.join(cache_dir, saved["sentence_prefix"]),
    )


def _build(folder: str, progress: bool) -> None:
    os.makedirs(folder)
    documents = list(demo_documents())
    corpus = os.path.join(folder, "corpus.jsonl")
    with open(corpus, "w", encoding="utf-8") as lines:
        for text in documents:
            lines.write(json.dumps({"text": text}) + "\n")
    _train_sentencepiece(documents, os.path.join(folder, "tokenizer.model"))
    vocab = build_tokenizer(TokenizerSettings("SentencePieceTokenizer", tokenizer_model=os.path.join(
        folder, "tokenizer.model"))).vocab_size
    if vocab != TOKENIZER_VOCAB_SIZE:
        raise RuntimeError(f"the demo tokenizer has {vocab} tokens, not the {TOKENIZER_VOCAB_SIZE} the plan sizes the "
                           "model by: update demo.TOKENIZER_VOCAB_SIZE (and DEMO_VERSION)")
    result = preprocess(
        PreprocessSettings(
            input=corpus,
            output_prefix=os.path.join(folder, "demo"),
            tokenizer=TokenizerSettings(
                "SentencePieceTokenizer", tokenizer_model=os.path.join(folder, "tokenizer.model")
            ),
            append_eod=True,
            progress=progress,
        )
    )
    sentences = preprocess(
        PreprocessSettings(
            input=corpus,
            output_prefix=os.path.join(folder, "demo"),
            tokenizer=TokenizerSettings(
                "SentencePieceTokenizer", tokenizer_model=os.path.join(folder, "tokenizer.model")
            ),
            split_sentences=True,
            progress=progress,
        )
    )
    manifest = {
        "version": DEMO_VERSION,
        "data_prefix": os.path.basename(result.data_prefixes["text"]),
        "sentence_prefix": os.path.basename(sentences.data_prefixes["text"]),
        "tokenizer_model": "tokenizer.model",
        "tokenizer_type": "SentencePieceTokenizer",
        "num_documents": result.num_documents,
        "num_tokens": result.num_tokens,
        "python": sys.version.split()[0],  # the text comes from this Python's standard library
    }
    with open(os.path.join(folder, _MANIFEST), "w") as out:
        json.dump(manifest, out, indent=1)


def unigram_entropy(data_prefix: str) -> float:
    """The entropy in nats of the corpus's token frequencies (end-of-document tokens included): the loss of a model
    that knows only how often each token occurs, the baseline a trained model's loss must fall clearly under."""
    from rapidtrain.data.indexed import IndexedDataset

    dtype = IndexedDataset(data_prefix).dtype
    counts = np.bincount(np.fromfile(data_prefix + ".bin", dtype=dtype))  # the .bin holds every token, in order
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def demo_documents() -> Iterator[str]:
    """pydoc's help topics, then the stdlib's docstrings in a fixed order, up to MAX_CORPUS_CHARS."""
    from pydoc_data.topics import topics

    total = 0
    for text in [topics[name] for name in sorted(topics)] + list(_stdlib_docstrings()):
        if total >= MAX_CORPUS_CHARS:
            return
        total += len(text)
        yield text


def _stdlib_docstrings() -> Iterator[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if _SKIPPED_FOLDERS & set(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError):  # a few files are deliberately broken examples
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                text = ast.get_docstring(node)
                if text and len(text) >= MIN_DOCSTRING_CHARS:
                    yield text


def _train_sentencepiece(documents: list[str], model_path: str) -> None:
    import sentencepiece

    lines = [line for text in documents for line in text.splitlines() if line.strip()]
    model = io.BytesIO()
    # One thread and a fixed seed give the same model on every machine with the same Python.
    sentencepiece.set_random_generator_seed(SEED)
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        vocab_size=VOCAB_SIZE,
        model_type="unigram",
        byte_fallback=True,
        num_threads=1,
        minloglevel=2,
    )
    with open(model_path, "wb") as out:
        out.write(model.getvalue())
