"""Data that would train on wrong tokens, or fail deep inside a run, is refused when it is opened: a wrong
dtype code in the .idx, token ids beyond the vocabulary, an empty dataset, a --split with no training documents,
a --data-path with a space, index arrays larger than memory."""

from __future__ import annotations

import numpy as np
import pytest

from rapidtrain.data.blending import DataPathError, parse_data_path
from rapidtrain.data.gpt_dataset import GPTDatasetConfig, build_gpt_datasets, build_gpt_indices
from rapidtrain.data.index_cache import DataConfigError, check_index_memory
from rapidtrain.data.indexed import DataFileError, IndexedDataset, IndexedDatasetBuilder, check_token_ids
from rapidtrain.data.inputs import check_pretraining_inputs
from rapidtrain.data.tokenizer import TokenizerSettings


def write(prefix, documents, dtype=np.uint16) -> str:
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype)
    for tokens in documents:
        builder.add_document([tokens])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def documents(count=40, high=100, seed=0):
    rng = np.random.RandomState(seed)
    return [list(rng.randint(0, high, size=rng.randint(5, 30))) for _ in range(count)]


def set_dtype_code(prefix: str, code: int) -> None:
    with open(prefix + ".idx", "r+b") as index:
        index.seek(17)  # magic (9) + version (8)
        index.write(bytes([code]))


@pytest.mark.parametrize("code, named", [(4, "int32"), (1, "uint8")])
def test_a_changed_dtype_code_is_refused_naming_the_size_that_fits(tmp_path, code, named):
    prefix = write(tmp_path / "d", documents())
    set_dtype_code(prefix, code)
    message = (rf"d\.bin: \d+ bytes, but its index describes \d+ tokens of {named}.*"
               r"the size fits (int16 or )?uint16.*dtype code in the \.idx header is wrong")
    with pytest.raises(DataFileError, match=message):
        IndexedDataset(prefix)


def test_a_dtype_of_the_same_width_is_caught_by_the_token_check(tmp_path):
    prefix = write(tmp_path / "d", [[40000, 5, 6], [7, 8]])
    set_dtype_code(prefix, 3)  # int16: 40000 reads as a negative id
    dataset = IndexedDataset(prefix)
    with pytest.raises(DataFileError, match=r"token id -25536 in sequence 0 is outside the vocabulary \[0, 50304\)"):
        check_token_ids(dataset, 50304)


def test_token_ids_beyond_the_vocabulary_are_refused_when_the_dataset_opens(tmp_path):
    prefix = write(tmp_path / "d", documents(high=300))
    config = GPTDatasetConfig(data_prefix=[prefix], split="8,1,1", seq_length=8, seed=1, eod=0, vocab_size=128)
    with pytest.raises(DataFileError, match=r"token id 2\d\d in sequence \d+ is outside the vocabulary \[0, 128\).*"
                                            r"preprocessed with another tokenizer"):
        build_gpt_datasets(config, (10, 2, 2))
    check_token_ids(IndexedDataset(prefix), 384)  # the right (padded) vocabulary passes


def test_an_empty_dataset_is_named(tmp_path):
    prefix = write(tmp_path / "empty", [])
    config = GPTDatasetConfig(data_prefix=[prefix], split="8,1,1", seq_length=8, seed=1, eod=0)
    with pytest.raises(DataConfigError, match=r"--data-path .*empty: the dataset holds no tokens \(0 documents\)"):
        build_gpt_datasets(config, (10, 2, 2))


def test_a_split_that_leaves_no_training_documents_is_named(tmp_path):
    prefix = write(tmp_path / "d", documents(count=5))
    config = GPTDatasetConfig(data_prefix=[prefix], split="1,1000,0", seq_length=8, seed=1, eod=0)
    with pytest.raises(DataConfigError, match=r"--split leaves no training documents in --data-path .*d"):
        build_gpt_datasets(config, (10, 2, 0))


def test_a_path_with_a_space_stays_whole_when_it_names_a_dataset(tmp_path):
    folder = tmp_path / "my data"
    folder.mkdir()
    prefix = write(folder / "corpus", documents())
    assert parse_data_path([prefix]) == ([prefix], [1.0])
    with pytest.raises(DataPathError, match=r"item 1, '.*/my', should be a number: the weight of the prefix after "
                                            r"it \('data/nothing'\).*has a space and no dataset"):
        parse_data_path([str(tmp_path / "my data/nothing")])


def test_a_blend_quoted_as_one_string_still_splits(tmp_path):
    a, b = write(tmp_path / "a", documents()), write(tmp_path / "b", documents(seed=1))
    assert parse_data_path([f"0.7 {a} 0.3 {b}"]) == ([a, b], [0.7, 0.3])


def test_index_larger_than_memory_is_refused_before_allocating():
    with pytest.raises(DataConfigError, match=r"would need 1,048,576\.0 GiB of memory .* Lower --train-iters"):
        check_index_memory(2**50, "a GPT split")
    sizes = np.full(10, 20, dtype=np.int32)
    with pytest.raises(DataConfigError, match=r"a GPT split of 1,000,000,000,000 samples"):
        build_gpt_indices(sizes, np.arange(10, dtype=np.int32), 10**12, 16, seed=1)


def test_pretraining_inputs_are_checked_together(tmp_path):
    prefix = write(tmp_path / "d", documents(high=100))
    null = TokenizerSettings("NullTokenizer", vocab_size=99)  # vocab 100, padded to 128
    summary = check_pretraining_inputs([prefix], "mmap", null)
    assert (summary[0].documents, summary[0].tokens) == (40, sum(len(d) for d in documents()))
    with pytest.raises(DataFileError, match=r"nope\.idx and .*nope\.bin not found"):
        check_pretraining_inputs([str(tmp_path / "nope")], "mmap", null)
    with pytest.raises(Exception, match=r"--vocab-file .*vocab\.json: no such file"):
        check_pretraining_inputs([prefix], "mmap", TokenizerSettings("GPT2BPETokenizer", str(tmp_path / "vocab.json"),
                                                                     str(tmp_path / "merges.txt")))


@pytest.mark.parametrize("name, text", [("alpaca.json", '[{"instruction": "a", "output": "b"}]'),
                                        ("records", '{"text": "one"}\n{"text": "two"}\n')])
def test_a_json_file_given_as_data_path_is_refused_naming_both_ways_to_read_it(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    with pytest.raises(DataFileError, match=rf"--data-path .*{name}: a JSON file, not Megatron indexed data "
                                            r".*scripts/preprocess_data\.py --input .*--dataset LLama-Pretrain-Raw"):
        check_pretraining_inputs([str(tmp_path / name)], "mmap", None)
