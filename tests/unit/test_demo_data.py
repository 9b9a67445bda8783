"""The built-in demo corpus: built once from the installed Python's documentation, the same bytes on
every build, and shared safely by processes that ask for it at the same time."""

import filecmp
import json
import os
import subprocess
import sys
from pathlib import Path
from pydoc_data.topics import topics

import numpy as np
import pytest

from rapidtrain.data.demo import DEMO_VERSION, DemoData, default_cache_dir, prepare_demo_data
from rapidtrain.data.indexed import IndexedDataset
from rapidtrain.data.tokenizer import build_tokenizer

ROOT = Path(__file__).resolve().parents[2]
FILES = ("demo_text_document.bin", "demo_text_document.idx", "demo_text_sentence.bin", "demo_text_sentence.idx",
         "tokenizer.model", "manifest.json")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return prepare_demo_data(str(tmp_path_factory.mktemp("cache") / DEMO_VERSION), progress=False)


def test_demo_corpus_is_the_documentation_tokenized_with_eod(demo):
    corpus = Path(demo.data_prefix).parent / "corpus.jsonl"  # demo_documents(), as the build wrote them
    documents = [json.loads(line)["text"] for line in corpus.read_text(encoding="utf-8").splitlines()]
    assert documents[0] == topics["assert"] and documents[len(topics)].startswith("Record of phased-in")
    assert demo.tokenizer_type == "SentencePieceTokenizer"
    assert demo.num_documents == len(documents) > 4000
    assert 2_000_000 < sum(map(len, documents)) <= 4_000_000 + max(map(len, documents))
    tokenizer = build_tokenizer(demo.tokenizer_settings())
    assert (
        tokenizer.vocab_size == 2000 + 5
    )  # the model's pieces, then Megatron's <CLS> <SEP> <EOD> <MASK> <PAD>
    ds = IndexedDataset(demo.data_prefix)
    assert ds.dtype == np.uint16 and len(ds) == demo.num_documents
    assert int(ds.sequence_lengths.sum()) == demo.num_tokens
    assert ds.document_indices.tolist() == list(range(len(ds) + 1))
    for i in range(0, len(documents), 97):
        assert ds[i].tolist() == tokenizer.tokenize(documents[i]) + [tokenizer.eod]
    first = tokenizer.detokenize(ds[0][:-1].tolist())  # the "assert" help topic
    assert first.split() == topics["assert"].split()


def test_second_call_reads_the_cache_without_rebuilding(demo):
    folder = os.path.dirname(demo.data_prefix)
    stamps = [os.stat(os.path.join(folder, name)).st_mtime_ns for name in FILES]
    assert prepare_demo_data(folder) == demo
    assert [os.stat(os.path.join(folder, name)).st_mtime_ns for name in FILES] == stamps


CHILD = """
import dataclasses, json, sys
from rapidtrain.data.demo import prepare_demo_data
print(json.dumps(dataclasses.asdict(prepare_demo_data(sys.argv[1], progress=True))))
"""


@pytest.mark.slow  # a second full build (about 10 s on an idle 2-core machine)
def test_concurrent_processes_build_once_and_the_same_bytes(demo, tmp_path):
    cache = tmp_path / DEMO_VERSION
    (tmp_path / f"{DEMO_VERSION}.tmp-999999").mkdir()  # left by a builder that was killed
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    children = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(cache)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [child.communicate(timeout=300) for child in children]
    assert [child.returncode for child in children] == [0, 0], outputs
    results = [DemoData(**json.loads(stdout)) for stdout, _ in outputs]
    assert results[0] == results[1]
    assert sum("preprocess" in stderr for _, stderr in outputs) == 1  # one progress bar: one builder
    assert sorted(os.listdir(tmp_path)) == [DEMO_VERSION, f"{DEMO_VERSION}.lock"]
    built_before = os.path.dirname(demo.data_prefix)
    for name in FILES:
        assert filecmp.cmp(cache / name, os.path.join(built_before, name), shallow=False), name
    assert results[0].num_tokens == demo.num_tokens


def test_cache_folder_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv("RAPIDTRAIN_CACHE", str(tmp_path / "cache"))
    assert default_cache_dir() == str(tmp_path / "cache" / DEMO_VERSION)
    monkeypatch.delenv("RAPIDTRAIN_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_dir() == str(tmp_path / ".cache" / "rapidtrain" / DEMO_VERSION)


def test_a_folder_that_is_not_a_demo_cache_is_left_alone(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a demo cache"):
        prepare_demo_data(str(tmp_path / "mine"), progress=False)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
