"""scripts/convert_checkpoint.py: one consolidated state dict from any checkpoint, and the built-in GPT as a
Hugging Face GPT2LMHeadModel with the same logits (Llama-family, MoE and BERT exports: test_hf_weights.py and
tests/distributed/test_llama_layouts.py)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.launch import REPO, TINY_GPT_SHAPE, child_env, pretrain

SCRIPT = REPO / "scripts" / "convert_checkpoint.py"
TINY = [
    *TINY_GPT_SHAPE,
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--num-workers",
    "0",
    "--log-interval",
    "1",
    "--eval-iters",
    "0",
    "--lr",
    "1e-3",
    "--lr-warmup-iters",
    "1",
    "--train-iters",
    "2",
]


def load_script():
    spec = importlib.util.spec_from_file_location("convert_checkpoint", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train_and_save(folder: Path, extra: list[str] | None = None) -> Path:
    from rapidtrain.pretrain import main

    main(TINY + (extra or []) + ["--save", str(folder)])
    return folder


@pytest.fixture(scope="module")
def exported(tmp_path_factory, demo_data) -> tuple[Path, Path]:
    """A one-process checkpoint and its export with --hf, through the script as users run it."""
    root = tmp_path_factory.mktemp("convert")
    folder = train_and_save(root / "ck")
    out = root / "export"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--load", str(folder), "--output", str(out), "--hf"],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return folder, out


def test_export_equals_torch_consolidation_of_the_checkpoint(exported, tmp_path):
    """Every model tensor equals what torch's own dcp_to_torch_save makes of the same iter_* folder."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder, out = exported
    dcp_to_torch_save(folder / "iter_0000002", tmp_path / "whole.pt")
    reference = torch.load(tmp_path / "whole.pt", weights_only=False)["model"]
    state = load_file(out / "model.safetensors")
    assert sorted(state) == sorted(reference)
    assert all(torch.equal(state[name], reference[name]) for name in state)
    assert state["output.weight"].data_ptr() != state["embedding.word_embeddings.weight"].data_ptr()
    assert torch.equal(state["output.weight"], state["embedding.word_embeddings.weight"])  # tied


def test_hf_gpt2_gives_the_builtin_gpt_logits(exported):
    """GPT2LMHeadModel.from_pretrained(OUT/hf) and the built-in GPT loaded from the consolidated file agree on
    logits (fp32, within 1e-4) and on the language-model loss."""
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel

    from rapidtrain.models import ModelConfig, build_model

    _, out = exported
    saved = json.loads((out / "rapidtrain_config.json").read_text())
    config = ModelConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})
    ours = build_model(config, seed=None)
    ours.load_state_dict(load_file(out / "model.safetensors"))
    theirs = GPT2LMHeadModel.from_pretrained(out / "hf")
    ours.eval(), theirs.eval()
    tokens = torch.randint(
        0, config.vocab_size, (2, config.seq_length), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        our_logits, their_logits = ours(tokens), theirs(tokens).logits
        our_loss = ours(tokens[:, :-1], labels=tokens[:, 1:]).mean()
        their_loss = theirs(tokens, labels=tokens).loss  # transformers shifts the labels itself
    assert their_logits.shape == our_logits.shape == (2, config.seq_length, config.vocab_size)
    assert (their_logits - our_logits).abs().max() < 1e-4
    assert abs(float(our_loss) - float(their_loss)) < 1e-5
    assert theirs.lm_head.weight.data_ptr() == theirs.transformer.wte.weight.data_ptr()  # tied, as in GPT-2


def test_torch_format_and_iteration_choice(exported, tmp_path):
    folder, _ = exported
    script = load_script()
    assert (
        script.main(
            ["--load", str(folder), "--iteration", "2", "--output", str(tmp_path), "--format", "torch"]
        )
        == 0
    )
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert state["layers.1.mlp.fc2.weight"].shape == (64, 256)


def test_missing_or_incomplete_checkpoint_is_refused(exported, tmp_path, capsys):
    folder, _ = exported
    script = load_script()
    for argv, message in ((["--load", str(folder), "--iteration", "7", "--output", str(tmp_path)],
                           "iter_0000007 does not exist"),
                          (["--load", str(tmp_path), "--output", str(tmp_path / "out")],
                           "no latest_checkpointed_iteration.txt")):
        with pytest.raises(SystemExit) as raised:
            script.main(argv)
        assert raised.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("convert_checkpoint: error: ") and message in err and "Traceback" not in err


def test_hf_export_of_a_hugging_face_fine_tuning_checkpoint_is_refused(tmp_path):
    script = load_script()
    with pytest.raises(ValueError, match="built-in models"):
        script.export_hf({}, None, tmp_path, tmp_path / "hf", "5GB")


@pytest.mark.slow
def test_fsdp_two_rank_checkpoint_exports_the_one_process_weights(tmp_path, demo_data):
    """Sharded parameters (FSDP on 2 ranks, DTensor shards in the files) consolidate to the weights one
    process reaches with the same global batch (within fp32 reduction-order noise)."""
    script = load_script()
    flags = TINY + ["--hidden-dropout", "0", "--attention-dropout", "0"]
    # Ranks forked from an agent that imported the training stack (tests/launch.py): the launch is not the subject.
    pretrain(2, flags + ["--fsdp-memory-optimization", "--save", str(tmp_path / "fsdp")], warm=True)
    pretrain(1, flags + ["--save", str(tmp_path / "single")], warm=True)
    for name in ("fsdp", "single"):
        assert script.main(["--load", str(tmp_path / name), "--output", str(tmp_path / f"{name}_out")]) == 0
    from safetensors.torch import load_file

    sharded, single = (
        load_file(tmp_path / "fsdp_out" / "model.safetensors"),
        load_file(tmp_path / "single_out" / "model.safetensors"),
    )
    assert sorted(sharded) == sorted(single)
    assert max(float((sharded[k] - single[k]).abs().max()) for k in single) < 1e-5


@pytest.mark.parametrize("layout", [(2, 2), (1, 1)], ids=["tp2pp2", "tp1pp1"])
def test_megatron_layout_round_trips_the_weights_exactly(exported, tmp_path, layout):
    """--megatron at a chosen TP × PP: Megatron-LM's legacy folder (one model_optim_rng.pt per rank, the tracker),
    which rapidtrain's reader merges back into exactly the checkpoint's weights, iteration and consumed samples."""
    from rapidtrain.checkpoint.foreign import whole_model
    from rapidtrain.checkpoint.foreign_formats import detect_foreign
    from rapidtrain.checkpoint.megatron_legacy import read_megatron_legacy
    from rapidtrain.checkpoint.reader import checkpoint_directory, consolidated_model_state
    from rapidtrain.config.saved_checkpoint import saved_model_config

    folder, _ = exported
    tensor, pipeline = layout
    script = load_script()
    assert script.main(["--load", str(folder), "--output", str(tmp_path), "--megatron",
                        "--target-tensor-parallel-size", str(tensor),
                        "--target-pipeline-parallel-size", str(pipeline)]) == 0
    found = detect_foreign(tmp_path / "megatron")
    ranks = sorted(p.name for p in found.directory.iterdir())
    assert len(ranks) == tensor * pipeline and all((found.directory / r / "model_optim_rng.pt").is_file()
                                                   for r in ranks)
    saved = read_megatron_legacy(found)
    assert (saved.iteration, saved.consumed_samples) == (2, 8)
    directory = checkpoint_directory(folder)
    source = consolidated_model_state(directory)
    whole = whole_model(saved, saved_model_config(directory))
    assert sorted(whole) == sorted(source)
    assert all(torch.equal(whole[name], source[name]) for name in source)


# DeepSeek-V3's kind of model, tiny: MLA with a query bottleneck, a dense first layer, routed and shared experts
MOE_MLA = ["--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear", "--position-embedding-type", "rope",
           "--untie-embeddings-and-output-weights", "--multi-latent-attention", "--q-lora-rank", "16",
           "--kv-lora-rank", "16", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16",
           "--qk-layernorm", "--num-experts", "4", "--moe-layer-freq", "[0,1]", "--moe-ffn-hidden-size", "32",
           "--moe-router-topk", "2", "--moe-shared-expert-intermediate-size", "64", "--moe-router-score-function",
           "sigmoid", "--moe-router-enable-expert-bias"]


def test_a_moe_mla_model_goes_to_megatron_at_any_expert_parallel_size_and_back_exactly(demo_data, tmp_path):
    """--megatron of a mixture-of-experts model with MLA: Megatron-Core's names, routed experts divided over
    --target-expert-parallel-size (folders mp_rank_TT_EEE), which rapidtrain's reader merges back into exactly the
    checkpoint's weights; an expert-parallel size that does not divide the experts is refused by name."""
    from rapidtrain.checkpoint.foreign import whole_model
    from rapidtrain.checkpoint.foreign_formats import detect_foreign
    from rapidtrain.checkpoint.megatron_legacy import read_megatron_legacy
    from rapidtrain.checkpoint.reader import checkpoint_directory, consolidated_model_state
    from rapidtrain.config.saved_checkpoint import saved_model_config

    folder = train_and_save(tmp_path / "ck", MOE_MLA)
    script = load_script()
    directory = checkpoint_directory(folder)
    source = consolidated_model_state(directory)
    assert script.main(["--load", str(folder), "--output", str(tmp_path / "out"), "--megatron",
                        "--target-tensor-parallel-size", "2", "--target-expert-parallel-size", "2"]) == 0
    found = detect_foreign(tmp_path / "out" / "megatron")
    assert sorted(p.name for p in found.directory.iterdir()) == [f"mp_rank_{t:02d}_{e:03d}" for t in (0, 1)
                                                                 for e in (0, 1)]
    whole = whole_model(read_megatron_legacy(found), saved_model_config(directory))
    assert sorted(whole) == sorted(source)
    assert all(torch.equal(whole[name], source[name]) for name in source)
    with pytest.raises(SystemExit) as refused:
        script.main(["--load", str(folder), "--output", str(tmp_path / "out3"), "--megatron",
                     "--target-expert-parallel-size", "3"])
    assert refused.value.code == 2
