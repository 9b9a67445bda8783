"""BigScience's --train/valid/test-weighted-split-paths (and their -path files): parsed into named groups, each a blend
of its prefixes' documents between two fractions; the plan says so, malformed groups are refused naming the flag."""

from __future__ import annotations

import numpy as np
import pytest

from rapidtrain.config.arguments import parse_args
from rapidtrain.config.flag_surface import FlagRefused
from rapidtrain.data.blending import BlendedDataset
from rapidtrain.data.gpt_dataset import GPTDatasetConfig, build_weighted_group
from rapidtrain.data.indexed import IndexedDatasetBuilder
from rapidtrain.data.weighted_splits import DataPathError, WeightedComponent, parse_group, read_groups_file

EOD = 0


def write_corpus(prefix: str, first_token: int, documents: int = 20) -> str:
    """Document i holds token first_token + i (five of them, then EOD): a sample's tokens name its documents."""
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for index in range(documents):
        builder.add_item([first_token + index] * 5 + [EOD])
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def test_a_group_is_a_name_and_weight_range_prefix_triples_with_or_without_commas():
    group = parse_group("TRAIN: 0.3 0:0.6 a, 1 0.6:1 b", "--train-weighted-split-paths")
    assert group.name == "TRAIN"
    assert group.components == (WeightedComponent(0.3, 0.0, 0.6, "a"), WeightedComponent(1.0, 0.6, 1.0, "b"))
    # BigScience's own multilingual example leaves the commas out; each component is still three words.
    assert parse_group("TRAIN: 0.3 0:0.6 a 1 0.6:1 b", "--train-weighted-split-paths") == group
    assert WeightedComponent(1, 0.25, 0.5, "a").document_range(10) == (2, 5)  # round(2.5) = 2, as Python's round


@pytest.mark.parametrize("text, what", [
    ("TRAIN 1 0:1 a", "a group is written"),  # no NAME:
    ("TRAIN: 1 0:1", "a group is written"),  # two words
    ("TRAIN: 1 0.6:0.2 a", "START < END"),
    ("TRAIN: x 0:1 a", "WEIGHT START:END PREFIX"),
    ("TRAIN: 1 0:1.5 a", "END ≤ 1"),
])
def test_a_malformed_group_is_refused_naming_the_flag_and_the_form(text, what):
    with pytest.raises(DataPathError, match="--valid-weighted-split-paths") as error:
        parse_group(text, "--valid-weighted-split-paths")
    assert what in str(error.value)


def test_the_path_file_holds_one_line_of_quoted_groups(tmp_path):
    good = tmp_path / "valid.txt"
    good.write_text('"VALID_EN: 1 0.6:0.8 en" "VALID_ALL: 1 0.6:0.8 en, 1 0.6:0.8 ar"\n')
    assert read_groups_file(str(good), "--valid-weighted-split-paths-path") == [
        "VALID_EN: 1 0.6:0.8 en", "VALID_ALL: 1 0.6:0.8 en, 1 0.6:0.8 ar"]
    bad = tmp_path / "two_lines.txt"
    bad.write_text('"A: 1 0:1 a"\n"B: 1 0:1 b"\n')
    with pytest.raises(DataPathError, match="two_lines.txt: the file holds one line of quoted groups"):
        read_groups_file(str(bad), "--valid-weighted-split-paths-path")


def test_a_group_blends_only_its_ranges_documents_by_its_weights(tmp_path):
    first = write_corpus(str(tmp_path / "first"), first_token=1)
    second = write_corpus(str(tmp_path / "second"), first_token=101)
    config = GPTDatasetConfig(data_prefix=[], split="1,0,0", seq_length=8, seed=3, eod=EOD)
    group = parse_group(f"TRAIN: 1 0:0.5 {first}, 3 0.25:1 {second}", "--train-weighted-split-paths")
    blend = build_weighted_group(group, config, 400, "train")
    assert isinstance(blend, BlendedDataset) and len(blend) == 400
    assert np.bincount(blend.dataset_index).tolist() == [100, 300]
    tokens = {int(t) for i in range(len(blend)) for t in blend[i]["tokens"]} - {EOD}
    assert tokens == set(range(1, 11)) | set(range(106, 121))  # documents [0, 10) and [5, 20)


def _flags(tmp_path) -> list[str]:
    prefix = write_corpus(str(tmp_path / "corpus"), first_token=1)
    return ["--train-iters", "4", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200",
            "--train-weighted-split-paths", f"TRAIN: 1 0:0.8 {prefix}",
            "--valid-weighted-split-paths", f"V1: 1 0.8:0.9 {prefix}", f"V2: 1 0.9:1 {prefix}"]


def test_the_plan_notes_each_split_and_the_split_flag_it_replaces(tmp_path):
    from rapidtrain.config.describe import describe_plan
    from rapidtrain.config.plan import from_args
    from rapidtrain.config.settings import RunContext

    args = parse_args([*_flags(tmp_path), "--split", "949,50,1"])
    text = describe_plan(from_args(args, RunContext()))
    assert "data: Megatron indexed data, weighted splits train: TRAIN: 1 × " in text
    assert "valid: V1: 1 × " in text and "; V2: 1 × " in text
    assert "--valid-weighted-split-paths: V1: " in text and "(each group evaluated and logged on its own)" in text
    assert "--split 949,50,1: no effect here" in text


def test_weighted_paths_exclude_data_path_and_take_one_training_group(tmp_path):
    flags = _flags(tmp_path)
    with pytest.raises(FlagRefused, match="with --data-path or --\\*-data-path"):
        parse_args([*flags, "--data-path", "x"])
    with pytest.raises(FlagRefused, match="--train-weighted-split-paths: 2 groups"):
        parse_args([*flags, "--train-weighted-split-paths", "A: 1 0:1 a", "B: 1 0:1 b"])
    with pytest.raises(FlagRefused, match="--train-weighted-split-paths and --train-weighted-split-paths-path"):
        parse_args([*flags, "--train-weighted-split-paths-path", "groups.txt"])
