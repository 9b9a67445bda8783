"""Damaged data files a user gives rapidtrain: each reader, called as the product calls it, either works (the damage
left the file valid) or raises UserError naming the file, never another exception and never a hang.

Covered here: Megatron indexed data (.idx in both formats, .bin), the .npy index cache of a previous run, tokenizer
files of every kind, fine-tuning split files and preprocessing's JSON lines. Checkpoints and JSON configs:
test_reader_mutations_checkpoint.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rapidtrain.data.gpt_dataset import GPTDatasetConfig, build_gpt_datasets, open_indexed_dataset
from rapidtrain.data.indexed import IndexedDatasetBuilder, LegacyIndexedDatasetBuilder
from rapidtrain.data.tokenizer import TokenizerSettings, build_tokenizer
from tests.unit.mutations import (
    BOUNDED,
    byte_mutations,
    json_mutations,
    mutate,
    restore,
    works_or_names,
)

DOCUMENTS = [[5, 6, 7, 8, 1], [9, 10, 1], [11, 12, 13, 14, 15, 16, 1], [17, 1]]
VOCAB = 32


def write_indexed(prefix: Path, legacy: bool = False) -> str:
    builder = (LegacyIndexedDatasetBuilder if legacy else IndexedDatasetBuilder)(str(prefix) + ".bin",
                                                                                 np.int32 if legacy else np.uint16)
    for document in DOCUMENTS:
        builder.add_document([document])
    builder.finalize(str(prefix) + ".idx")
    return str(prefix)


def read_every_sequence(prefix: str, impl: str) -> list[list[int]]:
    """What pretraining does with --data-path: open (its checks), then read every sequence."""
    dataset = open_indexed_dataset(prefix, impl, VOCAB)
    return [dataset.get(i).tolist() for i in range(len(dataset))]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("indexed")
    return {"mmap": write_indexed(folder / "mmap"), "lazy": write_indexed(folder / "legacy", legacy=True)}


@pytest.mark.parametrize("impl", ["mmap", "lazy"])
@pytest.mark.parametrize("suffix", [".idx", ".bin"])
@BOUNDED
@given(mutation=byte_mutations)
def test_damaged_indexed_data_is_read_or_refused_naming_the_file(corpora, impl, suffix, mutation):
    prefix = corpora[impl]
    path = Path(prefix + suffix)
    original = path.read_bytes()
    mutate(path, mutation)
    try:
        read = works_or_names(lambda: read_every_sequence(prefix, impl), path, prefix)
        if read is not None and mutation[0] != "flip":  # a flipped token byte still reads, as other tokens
            assert read == DOCUMENTS
    finally:
        restore(path, original)


# ---- the .npy index cache a previous run left ----

SENTENCES = [[[20, 21, 22], [23, 24, 25, 26]], [[27, 28], [29, 30, 31], [20, 22]], [[23, 25, 27, 29], [21, 24]]] * 2


def every_sample(kind: str, prefixes: dict[str, str], cache: Path) -> list[list[int]]:
    """Every sample of the training split as pretraining builds it: a GPT prefix, a blend of two, or BERT."""
    if kind == "bert":
        from rapidtrain.data.bert_dataset import BERTDatasetConfig, build_bert_datasets

        config = BERTDatasetConfig(data_prefix=[prefixes["sentences"]], split="100,0,0", seq_length=12, seed=1,
                                   vocab_size=VOCAB, cls_id=2, sep_id=3, mask_id=4, pad_id=0, binary_head=True,
                                   cache_dir=str(cache))
        train = build_bert_datasets(config, [8, 0, 0])[0]
        return [train[i]["text"].tolist() for i in range(len(train))]
    data = [prefixes["mmap"]] if kind == "gpt" else ["1", prefixes["mmap"], "2", prefixes["lazy"]]
    config = GPTDatasetConfig(data_prefix=data, split="100,0,0", seq_length=4, seed=1, eod=1, cache_dir=str(cache),
                              vocab_size=VOCAB, data_impl="infer")
    train = build_gpt_datasets(config, [12, 0, 0])[0]
    return [train[i]["tokens"].tolist() for i in range(len(train))]


CACHED = {"gpt": ["document_index", "sample_index", "shuffle_index", "description"],
          "blend": ["BlendedDataset-dataset_index", "BlendedDataset-dataset_sample_index"],
          "bert": ["samples_mapping"]}


@pytest.mark.parametrize("kind", sorted(CACHED))
@BOUNDED
@given(data=st.data())
def test_damaged_index_cache_is_read_or_refused_naming_the_file(corpora, tmp_path_factory, kind, data):
    prefixes = {**corpora, "sentences": write_sentences(tmp_path_factory.mktemp("bert") / "s")}
    cache = tmp_path_factory.mktemp("cache")
    expected = every_sample(kind, prefixes, cache)
    name, mutation = data.draw(st.sampled_from(CACHED[kind]), label="file"), data.draw(byte_mutations, label="damage")
    path = next(cache.glob(f"*-{name}.*"))
    mutate(path, mutation)
    read = works_or_names(lambda: every_sample(kind, prefixes, cache), path, cache)
    if read is not None and mutation[0] != "flip" and kind != "bert":  # BERT's masking draws from the run's RNG
        assert read == expected


@pytest.mark.parametrize("name, row, value", [("sample_index", (2, 1), None), ("sample_index", (1, 0), None),
                                               ("shuffle_index", (0,), 10**6), ("document_index", (1,), 99)])
def test_cached_gpt_index_with_other_valid_values_is_refused_naming_it(corpora, tmp_path, name, row, value):
    """A well-formed .npy whose numbers break the index's invariant (a sample not seq_length tokens on, a sample
    or document that does not exist): refused before training reads past a document's end."""
    from rapidtrain.core.errors import UserError

    every_sample("gpt", corpora, tmp_path)
    path = next(tmp_path.glob(f"*-{name}.npy"))
    array = np.load(path)
    array[row] = array[row] + 1 if value is None else value  # None: one token or document further on
    np.save(path, array)
    with pytest.raises(UserError, match=rf"{path}.*is damaged \(.*\); delete these files"):
        every_sample("gpt", corpora, tmp_path)


def write_sentences(prefix: Path) -> str:
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", np.uint16)
    for document in SENTENCES:
        builder.add_document(document)
    builder.finalize(str(prefix) + ".idx")
    return str(prefix)


# ---- tokenizer files ----

CORPUS = ["the quick brown fox jumps over the lazy dog", "a tiny corpus for tiny tokenizers", "lorem ipsum dolor"] * 4


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory) -> Path:
    import sentencepiece
    from tokenizers import BertWordPieceTokenizer, ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tokenizers")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False)
    bpe.save_model(str(folder))
    wordpiece = BertWordPieceTokenizer()
    wordpiece.train_from_iterator(CORPUS, vocab_size=100, show_progress=False)
    wordpiece.save_model(str(folder))
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS), model_prefix=str(folder / "sp"),
                                             vocab_size=40, minloglevel=2)
    PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>").save_pretrained(
        str(folder / "hf"))
    return folder


TOKENIZER_FILES = {  # the file damaged: the tokenizer type that reads it, and its settings
    "vocab.json": ("GPT2BPETokenizer", {"vocab_file": "vocab.json", "merge_file": "merges.txt"}),
    "merges.txt": ("GPT2BPETokenizer", {"vocab_file": "vocab.json", "merge_file": "merges.txt"}),
    "vocab.txt": ("BertWordPieceLowerCase", {"vocab_file": "vocab.txt"}),
    "sp.model": ("SentencePieceTokenizer", {"tokenizer_model": "sp.model"}),
    "hf/tokenizer.json": ("HuggingFaceTokenizer", {"tokenizer_model": "hf"}),
    "hf/tokenizer_config.json": ("HuggingFaceTokenizer", {"tokenizer_model": "hf"}),
}


@pytest.mark.parametrize("name", sorted(TOKENIZER_FILES))
@BOUNDED
@given(mutation=json_mutations)
def test_damaged_tokenizer_files_load_or_are_refused_naming_the_file(tokenizer_files, name, mutation):
    kind, files = TOKENIZER_FILES[name]
    path = tokenizer_files / name
    if mutation[0].startswith("json") and path.suffix != ".json":
        mutation = ("empty",)
    settings = TokenizerSettings(kind, **{key: str(tokenizer_files / value) for key, value in files.items()})
    original = path.read_bytes()
    mutate(path, mutation)

    def load_and_use() -> list[int]:
        tokenizer = build_tokenizer(settings)
        ids = tokenizer.tokenize(CORPUS[0])
        tokenizer.detokenize(ids)
        return ids

    try:
        works_or_names(load_and_use, path, path.parent)
    finally:
        restore(path, original)


# ---- fine-tuning split files ----

RECORDS = [{"sentence": "good film", "label": 1}, {"sentence": "dull plot", "label": 0}]


def write_split(folder: Path, suffix: str) -> Path:
    path = folder / f"train{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    else:
        separator = "\t" if suffix == ".tsv" else ","
        path.write_text("sentence" + separator + "label\n"
                        + "".join(f"{r['sentence']}{separator}{r['label']}\n" for r in RECORDS))
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".tsv", ".csv"])
@BOUNDED
@given(mutation=byte_mutations)
def test_damaged_finetuning_files_load_or_are_refused_naming_the_file(tmp_path_factory, suffix, mutation):
    from rapidtrain.data.finetune import load_finetune_dataset

    folder = tmp_path_factory.mktemp("glue")
    path = write_split(folder, suffix)
    mutate(path, mutation)
    splits = works_or_names(lambda: load_finetune_dataset(str(folder)), path, folder)
    if splits is not None:
        assert all(isinstance(record, dict) for records in splits.values() for record in records)


# ---- a Hugging Face datasets folder written by save_to_disk ----

SAVED_FILES = {"dataset_dict.json": json_mutations, "train/state.json": json_mutations,
               "train/dataset_info.json": json_mutations, "train/data-00000-of-00001.arrow": byte_mutations}


def every_row(folder: Path) -> dict[str, list[dict]]:
    """What fine-tuning does with --data-dir: load the folder, then read every row of every split."""
    from rapidtrain.data.finetune import load_finetune_dataset

    return {name: list(split) for name, split in load_finetune_dataset(str(folder)).items()}


@pytest.fixture(scope="module")
def saved_dataset(tmp_path_factory) -> Path:
    import datasets

    folder = tmp_path_factory.mktemp("saved") / "glue"
    splits = {"train": RECORDS, "validation": RECORDS[:1]}
    datasets.DatasetDict({name: datasets.Dataset.from_list(rows) for name, rows in splits.items()}).save_to_disk(
        str(folder))
    return folder


@pytest.mark.parametrize("name", sorted(SAVED_FILES))
@BOUNDED
@given(data=st.data())
def test_damaged_saved_dataset_loads_or_is_refused_naming_the_folder(saved_dataset, name, data):
    path = saved_dataset / name
    original = path.read_bytes()
    mutate(path, data.draw(SAVED_FILES[name]))
    try:
        rows = works_or_names(lambda: every_row(saved_dataset), saved_dataset)
        if rows is not None:
            assert all(isinstance(row, dict) for split in rows.values() for row in split)
    finally:
        restore(path, original)


@pytest.mark.parametrize("name", sorted(SAVED_FILES))
def test_saved_dataset_missing_a_file_is_refused_naming_the_folder(saved_dataset, name):
    path = saved_dataset / name
    original = path.read_bytes()
    path.unlink()
    try:
        assert works_or_names(lambda: every_row(saved_dataset), saved_dataset) is None
    finally:
        restore(path, original)


# ---- preprocessing's --input JSON lines ----

@BOUNDED
@given(mutation=byte_mutations)
def test_damaged_preprocessing_input_is_read_or_refused_naming_the_file(tmp_path_factory, mutation):
    from rapidtrain.data.indexed import IndexedDataset
    from rapidtrain.data.preprocess import PreprocessSettings, preprocess

    folder = tmp_path_factory.mktemp("preprocess")
    source = folder / "in.jsonl"
    source.write_text("".join(json.dumps({"text": " ".join(map(str, d))}) + "\n" for d in DOCUMENTS))
    mutate(source, mutation)
    settings = PreprocessSettings(input=str(source), output_prefix=str(folder / "out" / "p"), progress=False,
                                  tokenizer=TokenizerSettings("NullTokenizer", vocab_size=VOCAB), append_eod=True)
    result = works_or_names(lambda: preprocess(settings), source)
    if result is not None:
        IndexedDataset(result.data_prefixes["text"])  # what it wrote reads back


# ---- the demo corpus cache a previous run built ----

MANIFEST = {"data_prefix": "corpus_text_document", "tokenizer_model": "tokenizer.model",
            "tokenizer_type": "SentencePieceTokenizer", "num_documents": 3, "num_tokens": 40,
            "sentence_prefix": "corpus_text_sentence"}


@BOUNDED
@given(mutation=json_mutations)
def test_damaged_demo_cache_manifest_is_read_or_refused_naming_it(tmp_path_factory, mutation):
    from rapidtrain.data.demo import prepare_demo_data

    cache = tmp_path_factory.mktemp("demo")
    path = cache / "manifest.json"
    path.write_text(json.dumps(MANIFEST))
    mutate(path, mutation)  # a folder in its place: no demo cache, refused before anything is built into it
    works_or_names(lambda: prepare_demo_data(str(cache), progress=False), path, cache)
