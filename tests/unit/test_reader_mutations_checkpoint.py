"""Damaged checkpoint folders and JSON configs: each reader, called as the product calls it, either works (the
damage left the file valid) or raises UserError naming the file, never another exception and never a hang.

Checkpoints: a real torch.distributed.checkpoint folder written by `save_checkpoint`; every file in it is damaged
in turn, with its manifest left as written (the damage happened after the save) or rewritten to match (it happened
before the checksums, or the checkpoint predates manifests), and read by a resume, by `rapidtrain plan` (which
takes the model shape from a Megatron-format folder) and by the reader behind `rapidtrain generate`. Configs: a
DeepSpeed config and a Hugging Face config.json given to `rapidtrain plan`, and the text files that compat and
generation read.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rapidtrain.checkpoint.checkpointer import LATEST_FILE, MANIFEST_FILE, iteration_dir, save_checkpoint
from rapidtrain.core.errors import UserError
from tests.unit.mutations import BOUNDED, byte_mutations, json_mutations, mutate, restore, works_or_names
from tests.unit.test_checkpoint_safety import ARGS, MODEL, ModelAndOptimizer, rewrite_manifest, schedule

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning",
                                        "ignore:Detected pickle protocol:UserWarning")  # a flipped byte in a .bin
PLANNED = settings(BOUNDED, max_examples=20)  # each example plans in full: fewer, so the file stays bounded
tracker_mutations = st.one_of(json_mutations, st.tuples(st.just("text"), st.sampled_from(
    ["", " 3 ", "3\n3", "-1", "7", "²", "٣", "03", "9" * 30, "3.0", "iter_0000003"])))
CHECKPOINT_FILES = {LATEST_FILE: tracker_mutations, f"iter_0000003/{MANIFEST_FILE}": json_mutations,
                    "iter_0000003/common.json": json_mutations, "iter_0000003/.metadata": byte_mutations,
                    "iter_0000003/rng/rank_0.pt": byte_mutations, "iter_0000003/__0_0.distcp": byte_mutations}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ck") / "save"
    runner = ModelAndOptimizer()
    save_checkpoint(root, 3, runner, schedule(runner), consumed_samples=12, config=ARGS, extra={"epoch": 1})
    return root


def damaged_copy(checkpoint: Path, name: str, mutation: tuple, checked_before: bool) -> tuple[Path, Path]:
    """A copy of the checkpoint with `name` damaged; `checked_before`: its manifest rewritten to match."""
    root = checkpoint.parent / f"copy-{uuid.uuid4().hex[:8]}"
    shutil.copytree(checkpoint, root)
    path = root / name
    if mutation[0] == "text":
        path.write_text(mutation[1])
    else:
        mutate(path, mutation)
    if checked_before and MANIFEST_FILE not in name and path.is_file():
        rewrite_manifest(iteration_dir(root, 3))
    return root, path


def resume(root: Path) -> object:
    runner = ModelAndOptimizer(seed=1)
    return works_or_names(lambda: _load(root, runner), root)


def _load(root: Path, runner: ModelAndOptimizer) -> object:
    from rapidtrain.checkpoint.checkpointer import load_checkpoint

    return load_checkpoint(root, runner, schedule(runner), MODEL, flags=ARGS["args"])


@pytest.mark.parametrize("checked_before", [False, True], ids=["damaged-after-save", "damaged-before-checksums"])
@pytest.mark.parametrize("name", sorted(CHECKPOINT_FILES))
@BOUNDED
@given(data=st.data())
def test_damaged_checkpoint_resumes_or_is_refused_naming_it(checkpoint, name, checked_before, data):
    from rapidtrain.checkpoint.reader import checkpoint_directory, consolidated_model_state
    from rapidtrain.config.saved_checkpoint import saved_model_config
    from rapidtrain.core.stopped_run import last_checkpoint

    mutation = data.draw(CHECKPOINT_FILES[name], label="mutation")
    root, path = damaged_copy(checkpoint, name, mutation, checked_before)
    try:
        resume(root)
        assert isinstance(last_checkpoint(str(root)), str)  # the line a stopped run prints never fails

        def generate_reads() -> None:  # what `rapidtrain generate --load` and the export read
            directory = checkpoint_directory(root)
            saved_model_config(directory)
            consolidated_model_state(directory)

        works_or_names(generate_reads, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ---- `rapidtrain plan`: the tracker and common.json of a Megatron-format folder, a DeepSpeed config, config.json --

TINY = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
        "--max-position-embeddings", "8", "--micro-batch-size", "1", "--train-iters", "2"]


def plan(argv: list[str]) -> object:
    """`rapidtrain plan ARGV` in this process: its UserError as raised; the rules' exit 2 (they print every problem,
    then exit) as a UserError of what they printed."""
    from rapidtrain import cli
    from rapidtrain.core.errors import UserError

    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(printed):
            return cli.main.__wrapped__(["plan", *argv])
    except SystemExit as stop:
        assert stop.code == 2, printed.getvalue()
        raise UserError(printed.getvalue()) from None


@pytest.mark.parametrize("name", [LATEST_FILE, "iter_0000003/common.json"])
@PLANNED
@given(data=st.data())
def test_plan_of_a_damaged_megatron_folder_works_or_names_it(checkpoint, name, data):
    root, _ = damaged_copy(checkpoint, name, data.draw(CHECKPOINT_FILES[name], label="mutation"), True)
    try:
        works_or_names(lambda: plan([*TINY, "--pretrained-model-name-or-path", str(root)]), root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def saved_args_changed(checkpoint: Path, args: dict) -> Iterator[tuple[Path, Path]]:
    """A copy of `checkpoint` whose iteration-3 common.json saved `args` (root, common.json), removed afterwards."""
    root = checkpoint.parent / f"args-{uuid.uuid4().hex[:8]}"
    shutil.copytree(checkpoint, root)
    common = iteration_dir(root, 3) / "common.json"
    common.write_text(json.dumps(json.loads(common.read_text()) | {"args": args}))
    try:
        yield root, common
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("value", ["x", [1], True, -3, {"a": 1}, 3.5, None])
@pytest.mark.parametrize("key", ["num_layers", "num_experts"])
def test_plan_refuses_a_saved_shape_of_the_wrong_kind_naming_common_json(checkpoint, key, value):
    """Valid JSON with a wrong value where the shape is read: named, not a TypeError deep in the plan."""
    with saved_args_changed(checkpoint, {key: value}) as (root, common):
        works_or_names(lambda: plan([*TINY, "--pretrained-model-name-or-path", str(root)]), common)


HUGE = [("hidden_size", 10**9), ("num_layers", 10**6), ("num_attention_heads", 2**40)]


@pytest.mark.parametrize("key, value", HUGE)
def test_plan_refuses_a_huge_saved_shape_naming_common_json_and_the_value(checkpoint, key, value):
    """Valid JSON, a count past any real model's: refused where it is read, not when the model is built."""
    with saved_args_changed(checkpoint, {key: value}) as (root, _):
        flag = "--" + key.replace("_", "-")
        argv = [a for i, a in enumerate(TINY) if flag not in (a, TINY[i - 1])]  # not given: taken from common.json
        with pytest.raises(UserError, match=rf"common\.json: damaged: its saved {key} is {value}"):
            plan([*argv, "--pretrained-model-name-or-path", str(root)])


@pytest.mark.parametrize("key, value", HUGE)
def test_a_huge_saved_model_shape_is_refused_before_generate_builds_it(checkpoint, key, value):
    from rapidtrain.config.saved_checkpoint import saved_model_config

    root = checkpoint.parent / f"huge-model-{uuid.uuid4().hex[:8]}"
    shutil.copytree(checkpoint, root)
    common = iteration_dir(root, 3) / "common.json"
    saved = json.loads(common.read_text())
    saved["plan"]["model"][key] = value
    common.write_text(json.dumps(saved))
    try:
        with pytest.raises(UserError, match=rf"common\.json: damaged: .*{key} = {value} \(at most"):
            saved_model_config(iteration_dir(root, 3))
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("key, value", [("n_embd", 10**9), ("n_layer", 10**6), ("vocab_size", 10**12)])
def test_plan_refuses_a_huge_hugging_face_config_naming_the_folder_and_the_value(tmp_path, key, value):
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG | {key: value}))
    argv = ["--pretrained-model-name-or-path", str(tmp_path), "--micro-batch-size", "1", "--train-iters", "2",
            "--seq-length", "8"]
    with pytest.raises(UserError, match=rf"{tmp_path}: config\.json gives \w+ = {value} \(at most"):
        plan(argv)


DEEPSPEED = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0, "zero_optimization": {"stage": 2},
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


@pytest.mark.parametrize("launcher", [[], ["--deepspeed"]], ids=["rapidformer", "megatron-deepspeed"])
@PLANNED
@given(mutation=json_mutations)
def test_damaged_deepspeed_config_plans_or_is_refused_naming_it(tmp_path_factory, launcher, mutation):
    path = tmp_path_factory.mktemp("ds") / "ds_config.json"
    path.write_text(json.dumps(DEEPSPEED))
    mutate(path, mutation)
    works_or_names(lambda: plan([*TINY, "--zero-2-memory-optimization", *launcher, "--deepspeed_config", str(path)]),
                   path)


HF_CONFIG = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 2, "n_embd": 16, "n_head": 2,
             "n_positions": 32, "vocab_size": 64, "torch_dtype": "float32"}


@PLANNED
@given(mutation=json_mutations)
def test_damaged_hugging_face_config_plans_or_is_refused_naming_it(tmp_path_factory, mutation):
    folder = tmp_path_factory.mktemp("hf")
    path = folder / "config.json"
    path.write_text(json.dumps(HF_CONFIG))
    mutate(path, mutation)
    argv = ["--pretrained-model-name-or-path", str(folder), "--micro-batch-size", "1", "--train-iters", "2",
            "--seq-length", "8"]
    works_or_names(lambda: plan(argv), folder)


@BOUNDED
@given(mutation=json_mutations)
def test_damaged_lora_adapter_config_is_read_or_refused_naming_it(tmp_path_factory, mutation):
    from rapidtrain.train.generation.loading import _adapter_base

    base, adapter = tmp_path_factory.mktemp("base"), tmp_path_factory.mktemp("adapter")
    (base / "config.json").write_text(json.dumps(HF_CONFIG))
    path = adapter / "adapter_config.json"
    path.write_text(json.dumps({"base_model_name_or_path": str(base), "r": 8, "target_modules": ["c_attn"]}))
    mutate(path, mutation)
    found = works_or_names(lambda: _adapter_base(adapter), path, adapter)
    assert found in (None, base)


# ---- text files read line by line: generation prompts, Rapidformer's GPT and PET data ----

@BOUNDED
@given(mutation=byte_mutations)
def test_damaged_prompt_file_is_read_or_refused_naming_it(tmp_path_factory, mutation):
    from rapidtrain.train.generation.command import read_prompts

    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text('{"prompt": "once upon"}\n{"prompt": "a time"}\n')
    mutate(path, mutation)
    prompts = works_or_names(lambda: read_prompts(str(path)), path)
    assert prompts is None or all(isinstance(p, str) for p in prompts)


@BOUNDED
@given(mutation=byte_mutations)
def test_damaged_rapidformer_text_data_is_read_or_refused_naming_it(tmp_path_factory, mutation):
    from rapidtrain.compat.rapidformer import GPTDataset
    from rapidtrain.data.tokenizer import NullTokenizer

    path = tmp_path_factory.mktemp("rapidformer") / "train.txt"
    path.write_text("1 2 3\n4 5\n")
    mutate(path, mutation)
    works_or_names(lambda: GPTDataset(str(path), NullTokenizer(64), seq_length=4), path)


# ---- Hugging Face weights that start the built-in model: sharded safetensors and their index, pytorch_model.bin --

HF_CONFIG_ARGS = {"vocab_size": 64, "n_embd": 16, "n_layer": 2, "n_head": 2, "n_positions": 32, "n_inner": 32}
WEIGHT_FILES = ["safetensors/model-00001-of-*.safetensors", "safetensors/model.safetensors.index.json",
                "bin/pytorch_model.bin"]


@pytest.fixture(scope="module")
def weight_folders(tmp_path_factory) -> dict[str, Path]:
    """A tiny GPT-2 saved as sharded safetensors (with their index) and as a pytorch_model.bin."""
    import torch
    import transformers

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**HF_CONFIG_ARGS))
    sharded, pickled = tmp_path_factory.mktemp("safetensors"), tmp_path_factory.mktemp("bin")
    model.save_pretrained(sharded, max_shard_size="8KB")
    model.config.save_pretrained(pickled)
    torch.save(model.state_dict(), pickled / "pytorch_model.bin")
    return {"safetensors": sharded, "bin": pickled}


@pytest.mark.parametrize("name", WEIGHT_FILES)
@BOUNDED
@given(data=st.data())
def test_damaged_hugging_face_weights_load_or_are_refused_naming_them(weight_folders, name, data):
    from rapidtrain.config import arguments, resolve
    from rapidtrain.models import build_model

    kind, file = name.split("/")
    folder = weight_folders[kind]
    path = next(folder.glob(file))
    mutation = data.draw(json_mutations if path.suffix == ".json" else byte_mutations, label="mutation")
    original = path.read_bytes()
    mutate(path, mutation)

    def build() -> object:  # the built-in model started from the folder, as --pretrained-model-name-or-path does
        args = arguments.parse_args(["--pretrained-model-name-or-path", str(folder), "--data-path", "unused",
                                     "--train-iters", "1", "--seq-length", "16"])
        return build_model(resolve.model_config_from_args(args, resolve.builtin_vocab_size(args, None)), seed=1)

    try:
        works_or_names(build, folder)
    finally:
        restore(path, original)


def test_a_saved_schedule_with_a_fractional_warm_up_is_not_called_damaged():
    """--lr-warmup-fraction keeps the warm-up in samples as a float (Megatron's product): a resume reads it back."""
    import torch

    from rapidtrain.checkpoint.resume import _damaged_schedule
    from rapidtrain.optim.lr_schedule import LRScheduler, lr_schedule_from_iters

    settings = lr_schedule_from_iters(lr=1e-3, min_lr=1e-4, style="cosine", train_iters=20, lr_decay_iters=None,
                                      lr_warmup_iters=0, lr_warmup_fraction=0.03, global_batch_size=8)
    state = LRScheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3), settings).state_dict()
    assert isinstance(state["lr_warmup_steps"], float) and _damaged_schedule(state) == []
    assert _damaged_schedule(state | {"lr_warmup_steps": -1.5}) == ["lr_warmup_steps"]
