"""scripts/preprocess_data.py: JSON lines to Megatron .bin/.idx per key, the same bytes at any worker count,
bad lines reported as file:line, and nothing published under the final names by a failed run."""

import filecmp
import gzip
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from pydoc_data.topics import topics

import numpy as np
import pytest
import sentencepiece

from rapidtrain.data.indexed import IndexedDataset
from rapidtrain.data.preprocess import PreprocessError, PreprocessSettings, preprocess
from rapidtrain.data.tokenizer import TokenizerSettings

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "preprocess_data.py"
NULL_TOKENIZER = TokenizerSettings("NullTokenizer", vocab_size=100)


def write_lines(path, records):
    opener = gzip.open if str(path).endswith(".gz") else open
    path.parent.mkdir(parents=True, exist_ok=True)
    with opener(path, "wt", encoding="utf-8") as out:
        for record in records:
            out.write((record if isinstance(record, str) else json.dumps(record)) + "\n")
    return str(path)


def run(tmp_path, records, name="in.jsonl", **options):
    settings = dict(tokenizer=NULL_TOKENIZER, append_eod=True, progress=False)
    settings.update(options)
    source = write_lines(tmp_path / name, records)
    return preprocess(PreprocessSettings(input=source, output_prefix=str(tmp_path / "out" / "p"), **settings))


def contents(prefix):
    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))], ds.document_indices.tolist(), ds.dtype


def test_each_key_gets_its_own_files_with_megatron_documents(tmp_path):
    records = [
        {"text": "1 2 3", "title": "7"},
        {"text": "", "title": "8 9"},  # an empty document: a boundary, no eod
        {"text": ["4 5", "", "6"], "title": "1"},  # a list: one sequence per non-empty string
    ]
    result = run(tmp_path, records, json_keys=["text", "title"])
    prefix = str(tmp_path / "out" / "p")
    assert result.data_prefixes == {"text": prefix + "_text_document", "title": prefix + "_title_document"}
    assert contents(prefix + "_text_document") == ([[1, 2, 3, 100], [4, 5], [6, 100]], [0, 1, 1, 3], "uint16")
    assert contents(prefix + "_title_document") == ([[7, 100], [8, 9, 100], [1, 100]], [0, 1, 2, 3], "uint16")
    assert (result.num_documents, result.num_tokens) == (3, 15)


def test_without_append_eod_documents_end_with_their_last_token(tmp_path):
    run(tmp_path, [{"text": "1 2"}, {"text": "3"}], append_eod=False)
    assert contents(str(tmp_path / "out" / "p_text_document"))[0] == [[1, 2], [3]]


def test_blank_lines_are_not_documents(tmp_path):
    result = run(tmp_path, [{"text": "1"}, "", "   ", {"text": "2"}])
    assert result.num_documents == 2
    assert contents(str(tmp_path / "out" / "p_text_document"))[1] == [0, 1, 2]


@pytest.fixture(scope="module")
def sentencepiece_corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    texts = [topics[name] for name in sorted(topics)[:40]]
    lines = [line for text in texts for line in text.splitlines() if line.strip()]
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(folder / "sp"), vocab_size=400, minloglevel=2
    )
    records = [{"text": line} for line in lines[:3000]]
    return TokenizerSettings("SentencePieceTokenizer", tokenizer_model=str(folder / "sp.model")), records


def test_two_workers_write_the_same_bytes_as_one(tmp_path, sentencepiece_corpus):
    tokenizer, records = sentencepiece_corpus
    prefixes = []
    for workers in (1, 2):
        result = run(
            tmp_path / str(workers), records, tokenizer=tokenizer, workers=workers, lines_per_chunk=37
        )
        prefixes.append(result.data_prefixes["text"])
        assert result.num_documents == len(records)
    for suffix in (".bin", ".idx"):
        assert filecmp.cmp(prefixes[0] + suffix, prefixes[1] + suffix, shallow=False)
    ds = IndexedDataset(prefixes[0])
    assert len(ds) == len(records) and ds[0][-1] == 402  # eod: <EOD> after 400 pieces, <CLS>, <SEP>


def test_gzip_input_gives_the_same_bytes(tmp_path):
    records = [{"text": f"{i} {i + 1}"} for i in range(50)]
    plain = run(tmp_path / "plain", records).data_prefixes["text"]
    packed = run(tmp_path / "gz", records, name="in.jsonl.gz").data_prefixes["text"]
    for suffix in (".bin", ".idx"):
        assert filecmp.cmp(plain + suffix, packed + suffix, shallow=False)


BAD_LINES = [
    ('{"text": "1 2"', "in.jsonl:2: malformed JSON: Expecting ',' delimiter at column 15"),
    ('{"body": "1 2"}', "in.jsonl:2: missing key 'text' (keys present: 'body')"),
    ('{"text": 12}', "in.jsonl:2: key 'text' holds int; expected a string or a list of strings"),
    ("[1, 2]", "in.jsonl:2: expected a JSON object, found list"),
    ('{"text": "1 two"}', "in.jsonl:2: NullTokenizer: text must be integers"),
]


@pytest.mark.parametrize(("line", "message"), BAD_LINES)
def test_bad_line_stops_naming_file_and_line(tmp_path, line, message):
    with pytest.raises(PreprocessError, match="^" + re.escape(f"{tmp_path}/{message}")):
        run(tmp_path, [{"text": "1"}, line, {"text": "2"}])
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []


def test_skip_bad_lines_skips_and_counts(tmp_path):
    result = run(
        tmp_path, [{"text": "1"}, "oops", {"text": "2"}, {"x": 1}], skip_bad_lines=True, lines_per_chunk=2
    )
    assert (result.num_documents, result.skipped_lines) == (2, 2)
    assert [m.split(": ")[0] for m in result.bad_line_examples] == [
        f"{tmp_path}/in.jsonl:{n}" for n in (2, 4)
    ]
    assert contents(result.data_prefixes["text"])[0] == [[1, 100], [2, 100]]


def test_failed_run_keeps_the_previous_files_and_leaves_no_temporaries(tmp_path):
    first = run(tmp_path, [{"text": "1 2"}]).data_prefixes["text"]
    before = {suffix: Path(first + suffix).read_bytes() for suffix in (".bin", ".idx")}
    records = [{"text": "3"}] * 500 + ["not json"]
    for workers in (1, 2):
        with pytest.raises(PreprocessError, match="in.jsonl:501"):
            run(tmp_path, records, workers=workers, lines_per_chunk=16)
        assert sorted(os.listdir(tmp_path / "out")) == ["p_text_document.bin", "p_text_document.idx"]
        assert {suffix: Path(first + suffix).read_bytes() for suffix in before} == before


def test_append_eod_needs_a_tokenizer_with_eod(tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nhello\n")
    bert = TokenizerSettings("BertWordPieceLowerCase", vocab_file=str(vocab))
    with pytest.raises(PreprocessError, match="--append-eod: BertWordPieceLowerCase has no end-of-document"):
        run(tmp_path, [{"text": "hello"}], tokenizer=bert)
    assert contents(
        run(tmp_path, [{"text": "hello"}], tokenizer=bert, append_eod=False).data_prefixes["text"]
    )[0] == [[5]]


def script(tmp_path, *args):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the script must find rapidtrain itself
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_script_runs_from_any_folder_and_reports_progress(tmp_path):
    write_lines(tmp_path / "in.jsonl", [{"text": "1 2 3"}, {"text": "4"}])
    done = script(
        tmp_path,
        *("--input", "in.jsonl", "--output-prefix", "data/corpus", "--tokenizer-type", "NullTokenizer"),
        *("--vocab-size", "10", "--append-eod", "--workers", "2", "--log-interval", "1"),
    )
    assert done.returncode == 0, done.stderr
    assert "--data-path data/corpus_text_document" in done.stdout
    assert "2 documents, 6 tokens" in done.stdout
    assert "tokens/s" in done.stderr and "docs" in done.stderr  # the tqdm bar
    assert contents(str(tmp_path / "data" / "corpus_text_document"))[0] == [[1, 2, 3, 10], [4, 10]]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--input", "in.jsonl", "--tokenizer-type", "NullTokenizer", "--vocab-size", "10"],
            "in.jsonl:2: malformed",
        ),
        (
            ["--input", "nope.jsonl", "--tokenizer-type", "NullTokenizer", "--vocab-size", "10"],
            "--input nope.jsonl",
        ),
        (["--input", "in.jsonl", "--tokenizer-type", "GPT2BPETokenizer"], "needs --vocab-file"),
    ],
)
def test_script_user_errors_exit_2_without_traceback(tmp_path, args, message):
    write_lines(tmp_path / "in.jsonl", [{"text": "1"}, "{bad"])
    done = script(tmp_path, *args, "--output-prefix", "out")
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


@pytest.mark.parametrize(
    ("sig", "workers"),
    [(signal.SIGINT, "1"), (signal.SIGTERM, "2")],
    ids=["sigint-1-worker", "sigterm-2-workers"],
)
def test_interrupted_script_removes_its_partial_files(tmp_path, sig, workers):
    line = json.dumps({"text": " ".join(["7"] * 200)}) + "\n"
    (tmp_path / "in.jsonl").write_text(line * 50_000)  # 10M tokens: still being written when signalled
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    args = ["--input", "in.jsonl", "--output-prefix", "out/p", "--tokenizer-type", "NullTokenizer"]
    child = subprocess.Popen(
        [sys.executable, str(SCRIPT), *args, "--vocab-size", "10", "--workers", workers],
        cwd=tmp_path,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        # As a user's Ctrl-C finds it: a process started with SIGINT ignored (a background job of a
        # non-interactive shell, as a suite launched with `nohup ... &` passes down) keeps ignoring it, by design.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    out = tmp_path / "out"
    while child.poll() is None and not (out.exists() and os.listdir(out)):
        time.sleep(0.01)  # wait until the temporary files exist
    child.send_signal(sig)
    _, stderr = child.communicate(timeout=120)
    assert child.returncode == 130, stderr
    assert "interrupted; no output was written" in stderr and "Traceback" not in stderr
    assert os.listdir(out) == []


def test_killed_run_leaves_temporaries_that_the_next_run_removes(tmp_path):
    """SIGKILL runs no cleanup: the `.tmp-PID` files stay until the next run for that output removes them."""
    line = json.dumps({"text": " ".join(["7"] * 200)}) + "\n"
    (tmp_path / "in.jsonl").write_text(line * 50_000)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    args = ["--input", "in.jsonl", "--output-prefix", "out/p", "--tokenizer-type", "NullTokenizer", "--vocab-size",
            "10"]
    child = subprocess.Popen([sys.executable, str(SCRIPT), *args], cwd=tmp_path, env=env, stderr=subprocess.PIPE)
    out = tmp_path / "out"
    while child.poll() is None and not (out.exists() and os.listdir(out)):
        time.sleep(0.01)
    child.kill()
    child.wait(timeout=60)
    stale = sorted(os.listdir(out))
    assert stale == [f"p_text_document.bin.tmp-{child.pid}", f"p_text_document.idx.tmp-{child.pid}"][: len(stale)]
    (tmp_path / "in.jsonl").write_text(line * 3)
    done = script(tmp_path, *args)
    assert done.returncode == 0, done.stderr
    assert f"removed {out / stale[0]}, left by an earlier run that was killed" in done.stdout
    assert sorted(os.listdir(out)) == ["p_text_document.bin", "p_text_document.idx"]


def test_temporaries_of_a_living_writer_are_refused_not_removed(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    living = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        partial = out / f"p_text_document.bin.tmp-{living.pid}"
        partial.write_bytes(b"\0" * 10)
        with pytest.raises(PreprocessError, match=rf"is being written by another preprocess \(pid {living.pid}\)"):
            run(tmp_path, [{"text": "1 2"}])
        assert partial.exists()
    finally:
        living.kill()
        living.wait()


def test_input_without_documents_writes_nothing(tmp_path):
    with pytest.raises(PreprocessError, match=r"--input .*in\.jsonl: no documents \(every line blank\): nothing"):
        run(tmp_path, ["", "  "])
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []


def test_output_prefix_under_a_regular_file_is_named(tmp_path):
    (tmp_path / "file").write_text("x")
    write_lines(tmp_path / "in.jsonl", [{"text": "1"}])
    done = script(tmp_path, "--input", "in.jsonl", "--output-prefix", "file/p", "--tokenizer-type", "NullTokenizer",
                  "--vocab-size", "10")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--output-prefix file/p: cannot create the folder" in done.stderr


def test_split_sentences_writes_sentences_grouped_by_document_that_bert_reads(tmp_path, sentencepiece_corpus):
    from rapidtrain.data.bert_dataset import BERTDatasetConfig, build_bert_datasets
    from rapidtrain.data.tokenizer import build_tokenizer

    settings = sentencepiece_corpus[0]
    texts = ["Mr. Smith reads the manual. He finds the answer! Then he writes code.",
             "One sentence only.",
             "The list, e.g. files and folders, is long. Is it complete? Not yet. We check it again."]
    records = [{"text": text} for text in texts * 10]
    result = run(tmp_path, records, tokenizer=settings, split_sentences=True)
    prefix = result.data_prefixes["text"]
    assert prefix.endswith("p_text_sentence")
    dataset = IndexedDataset(prefix)
    assert np.diff(dataset.document_indices).tolist()[:3] == [3, 1, 4]  # sentences per document
    tokenizer = build_tokenizer(settings)
    assert tokenizer.detokenize(dataset[0].tolist()) == "Mr. Smith reads the manual."
    assert dataset[2].tolist()[-1] == tokenizer.eod  # --append-eod ends the document's last sentence
    config = BERTDatasetConfig(data_prefix=[prefix], split="1,0,0", seq_length=32, seed=1,
                               vocab_size=tokenizer.vocab_size, cls_id=tokenizer.cls, sep_id=tokenizer.sep,
                               mask_id=tokenizer.mask, pad_id=tokenizer.pad, binary_head=True,
                               cache_dir=str(tmp_path / "cache"))
    train, _, _ = build_bert_datasets(config, (20, 0, 0))
    sample = train[0]
    assert sample["types"].max() == 1 and sample["is_random"] in (0, 1)  # a sentence pair: segments A and B


def test_keep_newlines_keeps_the_whitespace_after_each_sentence(tmp_path):
    from rapidtrain.data.sentences import split_sentences

    text = "First one.\nSecond one. Third."
    assert split_sentences(text) == ["First one.", "Second one.", "Third."]
    assert split_sentences(text, keep_newlines=True) == ["First one.\n", "Second one. ", "Third."]


def test_a_file_size_limit_is_named_and_leaves_nothing(tmp_path):
    import resource

    def small_file_limit() -> None:  # as `ulimit -f` would: writes past 64 KiB fail with EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    line = json.dumps({"text": " ".join(["7"] * 200)}) + "\n"
    (tmp_path / "in.jsonl").write_text(line * 2_000)  # 400k tokens: far past the limit
    args = ["--input", "in.jsonl", "--output-prefix", "out/p", "--tokenizer-type", "NullTokenizer"]
    done = subprocess.run([sys.executable, str(SCRIPT), *args, "--vocab-size", "10"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, preexec_fn=small_file_limit)
    assert done.returncode == 2, done.stderr
    assert "--output-prefix out/p: writing the output failed (File too large)" in done.stderr
    assert "Traceback" not in done.stderr and os.listdir(tmp_path / "out") == []
