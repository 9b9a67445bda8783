"""Fine-tuning data from local folders: .tsv / .csv / .jsonl split files, save_to_disk folders, errors."""

from __future__ import annotations

import json

import pytest

from rapidtrain.data.finetune import DatasetNotFoundLocallyError, load_finetune_dataset
from rapidtrain.data.indexed import DataFileError

ROWS = [
    {"sentence1": 'He said "yes', "sentence2": "It's fine", "label": 1},
    {"sentence1": "No", "sentence2": "Maybe, later", "label": 0},
]


def write_tsv(path, rows):
    header = list(rows[0])
    lines = ["\t".join(header)] + ["\t".join(str(r[k]) for k in header) for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def test_glue_style_tsv_folder_with_dev_as_validation(tmp_path):
    folder = tmp_path / "glue" / "mrpc"
    folder.mkdir(parents=True)
    write_tsv(folder / "train.tsv", ROWS)
    write_tsv(folder / "dev.tsv", ROWS[:1])
    data = load_finetune_dataset(str(tmp_path), "glue/mrpc")
    assert sorted(data) == ["train", "validation"]
    # The unbalanced quote survives: tabs are the only structure of a GLUE .tsv.
    assert data["train"] == ROWS
    assert data["validation"][0]["label"] == 1 and isinstance(data["validation"][0]["label"], int)


def test_csv_with_quoted_commas_in_data_dir_itself(tmp_path):
    (tmp_path / "train.csv").write_text('text,score\n"a, b",0.5\nc,2\n', encoding="utf-8")
    (tmp_path / "test.csv").write_text("text,score\nd,1\n", encoding="utf-8")
    data = load_finetune_dataset(str(tmp_path), "not-a-subfolder")
    assert data["train"] == [{"text": "a, b", "score": 0.5}, {"text": "c", "score": 2.0}]
    assert data["test"] == [{"text": "d", "score": 1}]


def test_jsonl_splits(tmp_path):
    folder = tmp_path / "sst2"
    folder.mkdir()
    (folder / "train.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n", encoding="utf-8")
    (folder / "validation.jsonl").write_text(json.dumps(ROWS[1]) + "\n", encoding="utf-8")
    data = load_finetune_dataset(str(tmp_path), "sst2")
    assert data == {"train": ROWS, "validation": [ROWS[1]]}


def test_bad_rows_name_file_and_line(tmp_path):
    (tmp_path / "train.tsv").write_text("a\tb\n1\t2\n3\n", encoding="utf-8")
    with pytest.raises(DataFileError, match=r"train.tsv, line 3: 1 fields but the header has 2"):
        load_finetune_dataset(str(tmp_path), None)
    (tmp_path / "train.tsv").unlink()
    (tmp_path / "train.jsonl").write_text('{"a": 1}\n{oops\n', encoding="utf-8")
    with pytest.raises(DataFileError, match=r"train.jsonl, line 2: not valid JSON"):
        load_finetune_dataset(str(tmp_path), None)


def test_save_to_disk_folder_loads_as_dataset_dict(tmp_path):
    datasets = pytest.importorskip("datasets")
    saved = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(ROWS),
            "validation": datasets.Dataset.from_list(ROWS[:1]),
        }
    )
    saved.save_to_disk(str(tmp_path / "glue_mrpc"))
    data = load_finetune_dataset(str(tmp_path), "glue_mrpc")
    assert isinstance(data, datasets.DatasetDict)
    assert data["train"].num_rows == 2 and data["validation"][0] == ROWS[0]
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "single"))
    single = load_finetune_dataset(str(tmp_path / "single"), None)
    assert list(single) == ["train"] and single["train"]["label"] == [1, 0]


def test_hub_name_missing_locally_is_a_clear_error(tmp_path):
    with pytest.raises(DatasetNotFoundLocallyError) as error:
        load_finetune_dataset(str(tmp_path), "glue/mrpc")
    message = str(error.value)
    assert "'glue/mrpc' not found locally" in message
    assert "never downloads" in message
    assert "datasets.load_dataset('glue', 'mrpc').save_to_disk('DIR')" in message
    assert "--data-dir DIR" in message and str(tmp_path / "glue" / "mrpc") in message
    assert isinstance(error.value, ValueError)
    with pytest.raises(DatasetNotFoundLocallyError):
        load_finetune_dataset(None, "imdb")
