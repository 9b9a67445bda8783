"""A model folder that would run code to load is refused in one line, whichever command reads it: a config.json that
maps the model to Python files in the folder (trust_remote_code), and a pytorch_model.bin holding pickled objects."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch

from rapidtrain.models.hf_config import UnsafeModelFolder
from rapidtrain.tasks import toy
from rapidtrain.tasks.base import load_model


class Payload:
    """Unpickling this would run os.system: torch's weights_only loader must refuse it before."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    tokenizer = toy.train_tokenizer(toy.texts_of(toy.text_records(40, 0)), root / "tok")
    return toy.save_tiny_model("gpt2", root / "model", tokenizer)


def test_a_folder_that_needs_remote_code_is_refused_in_one_line(gpt2_folder, tmp_path):
    folder = tmp_path / "remote"
    folder.mkdir()
    for file in gpt2_folder.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomModel"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsafeModelFolder, match=r"auto_map: AutoModelForCausalLM.*trust_remote_code"):
        load_model("AutoModelForCausalLM", str(folder))


def test_pickled_weights_are_refused_and_nothing_runs(gpt2_folder, tmp_path):
    folder = tmp_path / "pickled"
    folder.mkdir()
    for file in gpt2_folder.iterdir():
        if not file.name.endswith(".safetensors"):
            (folder / file.name).write_bytes(file.read_bytes())
    marker = tmp_path / "ran"
    with open(folder / "pytorch_model.bin", "wb") as handle:
        pickle.dump({"transformer.wte.weight": torch.zeros(2), "x": Payload(str(marker))}, handle)
    with pytest.raises(UnsafeModelFolder, match=r"refused, it holds pickled objects beyond plain tensors") as refused:
        load_model("AutoModelForCausalLM", str(folder))
    assert str(refused.value).startswith(f"{folder / 'pytorch_model.bin'}: refused")  # the file, not the folder
    assert not marker.exists()


def test_the_pickled_shard_of_a_sharded_folder_is_the_one_named(gpt2_folder, tmp_path):
    """Two .bin shards, the second holding an object: the message names that shard (transformers' error names
    neither), found by weights-only reading again, which runs nothing."""
    from rapidtrain.models.hf_config import refuse_pickled_weights

    folder = tmp_path / "sharded"
    folder.mkdir()
    marker = tmp_path / "ran"
    torch.save({"a": torch.zeros(2)}, folder / "pytorch_model-00001-of-00002.bin")
    torch.save({"b": torch.zeros(2), "x": Payload(str(marker))}, folder / "pytorch_model-00002-of-00002.bin")
    error = refuse_pickled_weights(folder, pickle.UnpicklingError("Weights only load failed"))
    assert str(error).startswith(f"{folder / 'pytorch_model-00002-of-00002.bin'}: refused")
    assert not marker.exists()
