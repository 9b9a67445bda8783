"""`--load` of a Megatron-LM legacy checkpoint (written as Megatron's save_checkpoint lays it out, at TP 2 × PP 2:
four model_optim_rng.pt), of a torch_dist one and of DeepSpeed checkpoints (written by real DeepSpeed engines: ZeRO
stage 1, the pipeline engine, ZeRO stage 3, and a universal checkpoint made from one by DeepSpeed's ds_to_universal)
into other layouts: the weights are the source's, iteration, consumed samples and the learning-rate schedule carry
over, and the next iteration's loss and gradient norm are the ones the source run had there.

The sources are rapidtrain runs (3 iterations, one process, saved at 2 and 3) whose iteration-2 weights are re-laid
in the other tools' layouts; the 2-rank loads share one torchrun launch (tests/distributed/pretrain_runs.py), the
one-process ones run here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from rapidtrain.checkpoint.checkpointer import read_common
from rapidtrain.checkpoint.megatron_layout import flatten, legacy_nested, split_for_megatron
from rapidtrain.checkpoint.megatron_legacy import megatron_args, write_megatron_legacy
from rapidtrain.checkpoint.reader import checkpoint_directory, consolidated_model_state
from rapidtrain.config.saved_checkpoint import saved_model_config
from tests.distributed.parallel_runs import RUNS, train_here
from tests.launch import PRETRAIN, REPO, child_env, read_grad_norms, read_losses, relative_difference, torchrun
from tests.unit.test_foreign_checkpoints import write_torch_dist

TOLERANCE = 1e-5  # fp32, relative: a layout's reductions in another order
GPT = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32").split()
LLAMA = GPT + ("--normalization RMSNorm --swiglu --group-query-attention --num-query-groups 2 --disable-bias-linear "
               "--position-embedding-type rope --untie-embeddings-and-output-weights").split()
# DeepSeek-V3's kind of model: MLA with a query LoRA, a dense first layer, then routed experts (sigmoid router with
# expert bias, top 2) beside shared experts
MOE_MLA = LLAMA[:LLAMA.index("--group-query-attention")] + (
    "--disable-bias-linear --position-embedding-type rope --untie-embeddings-and-output-weights "
    "--multi-latent-attention --q-lora-rank 16 --kv-lora-rank 16 --qk-head-dim 16 --qk-pos-emb-head-dim 8 "
    "--v-head-dim 16 --qk-layernorm --num-experts 4 --moe-layer-freq [0,1] --moe-ffn-hidden-size 32 "
    "--moe-router-topk 2 --moe-shared-expert-intermediate-size 64 --moe-router-score-function sigmoid "
    "--moe-router-enable-expert-bias").split()
TRAINING = ("--hidden-dropout 0 --attention-dropout 0 --num-workers 0 --eval-iters 0 --micro-batch-size 2 "
            "--global-batch-size 4 --lr 1e-3 --lr-warmup-iters 1 --lr-decay-iters 10 --log-interval 1").split()
WRITER = Path(__file__).with_name("write_deepspeed_checkpoint.py")


def data_flags(demo_data) -> list[str]:
    # The demo vocabulary (2,005 ids) pads to 2048 at TP 1 and 2.
    return ["--data-path", demo_data.data_prefix, "--tokenizer-type", demo_data.tokenizer_type,
            "--tokenizer-model", demo_data.tokenizer_model, "--make-vocab-size-divisible-by", "512"]


@dataclass
class Source:
    """A rapidtrain run's checkpoint at iteration 2: its weights, position and schedule."""

    state: dict[str, torch.Tensor]
    config: object
    common: dict


def source_run(out: Path, name: str, flags: list[str], iterations: int = 3) -> Source:
    """`iterations` iterations, saved every 2: iteration 2's checkpoint is the source, the later iterations' losses
    the reference (a run resumed from iteration 2 gives the same: tests/distributed/test_exact_resume.py)."""
    train_here(flags + ["--train-iters", str(iterations), "--save-interval", "2", "--save", str(out / name),
                        "--loss-log-file", str(out / f"{name}.txt")])
    directory = checkpoint_directory(out / name, 2)
    return Source(consolidated_model_state(directory), saved_model_config(directory), read_common(directory))


def adam_state(folder: Path, scratch: Path) -> dict:
    """The AdamW state (exp_avg, exp_avg_sq by parameter, and the step) of a rapidtrain checkpoint's iteration 2."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint_directory(folder, 2), scratch)
    state = torch.load(scratch, weights_only=False)["optimizer"]["state"]  # written by this test
    steps = {float(entry["step"]) for entry in state.values()}
    assert len(steps) == 1
    return {key: {name: entry[key] for name, entry in state.items()} for key in ("exp_avg", "exp_avg_sq")} | {
        "step": int(steps.pop())}


def write_megatron(source: Source, folder: Path) -> None:
    """Megatron-LM's legacy layout at TP 2 × PP 2 (the model's padded vocabulary is Megatron's at TP 2 too)."""
    write_megatron_legacy(folder, source.state, source.config, tensor_parallel=2, pipeline_parallel=2,
                          iteration=source.common["iteration"], consumed_samples=source.common["consumed_samples"],
                          vocab_rows=source.config.vocab_size, scheduler=source.common["lr_scheduler"],
                          extra_args={"make_vocab_size_divisible_by": 512, "lr": 1e-3, "min_lr": 0.0,
                                      "lr_decay_style": "linear", "lr_decay_iters": 10, "lr_warmup_iters": 1})


def legacy_names(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Built-in names → Megatron-DeepSpeed's GPT names (the legacy model's, fused q/k/v), one tensor rank."""
    return flatten(legacy_nested(split_for_megatron(state, config, 1, 1, config.vocab_size)[0][0]))


def universal_info(config) -> dict:
    """The universal_checkpoint_info Megatron-DeepSpeed's GPTModel saves at TP 1 (ds_to_universal needs it): the
    tokenizer's vocabulary, the padded one, and which parameters hold the vocabulary (the tied embedding); the
    writer adds DeepSpeed's universal_checkpoint_version."""
    from rapidtrain.data.demo import TOKENIZER_VOCAB_SIZE

    return {"original_vocab_size": TOKENIZER_VOCAB_SIZE, "padded_vocab_size": config.vocab_size,
            "vocabulary_parameter_patterns": ["language_model.embedding.word_embeddings.weight"],
            "parameter_with_2_sub_params_cat_dim_0": []}


def write_deepspeed(source: Source, scratch: Path, adam: dict | None, **folders: Path) -> None:
    """Megatron-DeepSpeed's GPT names through real DeepSpeed engines' save_checkpoint, one folder per kind (plain,
    pipeline, zero3), in a separate process: it starts its own process group. `adam`: the source's AdamW state,
    which the plain engine's optimizer is given before it saves."""
    config = source.config
    args = vars(megatron_args(config, 1, 1, config.vocab_size, make_vocab_size_divisible_by=512,
                              consumed_train_samples=source.common["consumed_samples"]))
    moments = None if adam is None else {key: legacy_names(adam[key], config) for key in ("exp_avg", "exp_avg_sq")}
    torch.save({"model": legacy_names(source.state, config), "args": args, "scheduler": source.common["lr_scheduler"],
                "moments": moments and moments | {"step": adam["step"]}, "universal_info": universal_info(config)},
               scratch)
    kinds = [f"{kind}={folder}" for kind, folder in folders.items()]
    result = subprocess.run([sys.executable, str(WRITER), str(scratch), str(source.common["iteration"]),
                             str(source.common["consumed_samples"]), *kinds], capture_output=True, text=True,
                            timeout=300, env=child_env(), cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]


def write_megatron_moe(source: Source, folder: Path, *, tensor: int, pipeline: int, expert: int, experts: str) -> None:
    """Megatron-Core's legacy layout of the MoE + MLA model, experts divided over `expert` ranks (`mp_rank_TT[_PPP]
    _EEE`) and spelled as the `experts` implementation saves them."""
    write_megatron_legacy(folder, source.state, source.config, tensor_parallel=tensor, pipeline_parallel=pipeline,
                          iteration=source.common["iteration"], consumed_samples=source.common["consumed_samples"],
                          vocab_rows=source.config.vocab_size, scheduler=source.common["lr_scheduler"],
                          expert_parallel=expert, experts=experts, extra_args={"make_vocab_size_divisible_by": 512})


@dataclass
class Runs:
    out: Path
    llama: Source
    gpt: Source
    moe: Source
    launch_output: str

    def losses(self, name: str) -> dict[int, float]:
        return read_losses(self.out / f"{name}.txt")

    def norms(self, name: str) -> dict[int, float]:
        return read_grad_norms(self.out / f"{name}.txt")

    def third(self, values: dict[int, float]) -> dict[int, float]:
        """A source run's iteration 3, the one after its saved iteration 2."""
        return {3: values[3]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, demo_data) -> Runs:
    out = tmp_path_factory.mktemp("foreign_checkpoints")
    llama_flags, gpt_flags = LLAMA + TRAINING + data_flags(demo_data), GPT + TRAINING + data_flags(demo_data)
    llama, gpt = source_run(out, "llama", llama_flags), source_run(out, "gpt", gpt_flags, iterations=4)
    moe_flags = MOE_MLA + TRAINING + data_flags(demo_data)
    moe = source_run(out, "moe", moe_flags)
    write_megatron(llama, out / "megatron")
    write_megatron_moe(moe, out / "megatron_moe", tensor=2, pipeline=1, expert=2, experts="sequential")
    write_megatron_moe(moe, out / "megatron_moe_pp", tensor=1, pipeline=2, expert=2, experts="legacy_grouped")
    write_deepspeed(gpt, out / "deepspeed_source.pt", adam_state(out / "gpt", out / "gpt_iteration2.pt"),
                    plain=out / "deepspeed", pipeline=out / "deepspeed_pipe", zero3=out / "deepspeed_zero3",
                    universal=out / "deepspeed_universal")
    write_torch_dist(out / "torch_dist", llama.state, llama.config, llama.common["iteration"],
                     llama.common["consumed_samples"])

    def load(flags: list[str], folder: str, name: str, *more: str) -> list[str]:
        return flags + ["--load", str(out / folder), "--train-iters", "3", "--loss-log-file", str(out / f"{name}.txt"),
                        *more]

    tp2 = ("--tensor-model-parallel-size", "2")
    two_ranks = [
        load(llama_flags, "megatron", "megatron_tp2", *tp2, "--save", str(out / "megatron_tp2")),
        load(llama_flags, "megatron", "megatron_dp2"),
        load(llama_flags, "megatron", "megatron_pp2", "--pipeline-model-parallel-size", "2"),
        load(gpt_flags, "deepspeed", "deepspeed_tp2", *tp2, "--train-iters", "4"),
        load(gpt_flags, "deepspeed", "deepspeed_zero1_dp2", "--zero-1-memory-optimization", "--train-iters", "4"),
        load(gpt_flags, "deepspeed_universal", "universal_zero1_dp2", "--universal-checkpoint",
             "--zero-1-memory-optimization", "--train-iters", "4"),
        load(gpt_flags, "deepspeed_universal", "universal_tp2", "--universal-checkpoint", *tp2, "--train-iters", "4"),
        # lr 0 (the saved schedule overridden): the weights saved at iteration 3 are the loaded ones
        load(llama_flags, "megatron", "megatron_lr0", *tp2, "--lr", "0", "--min-lr", "0",
             "--override-opt_param-scheduler", "--save", str(out / "megatron_lr0")),
        load(llama_flags, "megatron", "megatron_finetune", *tp2, "--finetune", "--save", str(out / "finetune")),
        load(moe_flags, "megatron_moe", "megatron_moe_ep2", "--expert-model-parallel-size", "2"),
        load(moe_flags, "megatron_moe_pp", "megatron_moe_pp_dp2"),
    ]
    (out / "runs.json").write_text(json.dumps(two_ranks))
    result = torchrun(2, RUNS, [str(out / "runs.json")], timeout=900, warm=True)
    train_here(load(llama_flags, "megatron", "megatron_tp1"))
    train_here(load(moe_flags, "megatron_moe", "megatron_moe_tp1"))
    train_here(load(llama_flags, "torch_dist", "torch_dist_tp1"))
    train_here(load(gpt_flags, "deepspeed", "deepspeed_tp1", "--train-iters", "4"))
    train_here(load(gpt_flags, "deepspeed_pipe", "deepspeed_pipe_tp1", "--train-iters", "4"))
    # the folder ds_to_universal was given (`latest`), and its universal checkpoint (`latest_universal`)
    train_here(load(gpt_flags, "deepspeed_universal", "universal_source_tp1", "--train-iters", "4"))
    train_here(load(gpt_flags, "deepspeed_universal", "universal_tp1", "--universal-checkpoint", "--train-iters", "4"),
               out / "universal_tp1.log")
    return Runs(out, llama, gpt, moe, result.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["megatron_tp1", "megatron_tp2", "megatron_dp2", "megatron_pp2", "torch_dist_tp1"])
def test_megatron_checkpoint_continues_as_its_source_in_any_layout(runs, name):
    """Saved at TP 2 × PP 2, loaded at TP 1, TP 2, DP 2 and PP 2 (and a torch_dist folder at TP 1): iteration 3 is
    the next one (the position carried over), and its loss and gradient norm are the source run's own iteration 3."""
    assert sorted(runs.losses(name)) == [3]
    assert relative_difference(runs.losses(name), runs.third(runs.losses("llama"))) < TOLERANCE
    assert relative_difference(runs.norms(name), runs.third(runs.norms("llama"))) < TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("name", ["megatron_moe_tp1", "megatron_moe_ep2", "megatron_moe_pp_dp2"])
def test_megatron_core_moe_mla_checkpoint_continues_as_its_source(runs, name):
    """A DeepSeek-V3-like model (MLA, a dense first layer, routed experts with expert bias, shared experts) saved in
    Megatron-Core's layout at TP 2 × EP 2 (SequentialMLP's names) and at PP 2 × EP 2 (the legacy GroupedMLP's),
    loaded at TP 1, EP 2 and DP 2: iteration 3's loss and gradient norm are the source run's."""
    assert sorted(runs.losses(name)) == [3]
    assert relative_difference(runs.losses(name), runs.third(runs.losses("moe"))) < TOLERANCE
    assert relative_difference(runs.norms(name), runs.third(runs.norms("moe"))) < TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepspeed_tp1", "deepspeed_tp2", "deepspeed_zero1_dp2"])
def test_deepspeed_checkpoint_continues_as_its_source_adam_state_included(runs, name):
    """Saved by DeepSpeed's engine (ZeRO stage 1, data parallel 2) with the source's AdamW state in its optimizer,
    loaded at TP 1, TP 2 and into rapidtrain's own ZeRO-1 over 2 ranks (DeepSpeed's partitions): iterations 3 and 4
    are the source's, the 4th only because Adam's moments and step count carried over."""
    assert sorted(runs.losses(name)) == [3, 4]
    later = {i: runs.losses("gpt")[i] for i in (3, 4)}
    assert relative_difference(runs.losses(name), later) < TOLERANCE
    assert relative_difference(runs.norms(name), {i: runs.norms("gpt")[i] for i in (3, 4)}) < TOLERANCE
    assert "DeepSpeed / Megatron-DeepSpeed checkpoint, global_step2" in runs.launch_output
    assert "Adam's moments and step count (2) loaded from its optimizer files" in runs.launch_output


@pytest.mark.slow
def test_deepspeed_pipeline_engine_checkpoint_gives_the_weights(runs):
    """DeepSpeed's pipeline engine (layer_LL-model_states.pt files): the weights, hence iteration 3, are the
    source's; its optimizer files are not read, so iteration 4 (after a fresh Adam's first step) is not."""
    losses, source = runs.losses("deepspeed_pipe_tp1"), runs.losses("gpt")
    assert relative_difference({3: losses[3]}, {3: source[3]}) < TOLERANCE
    assert relative_difference({4: losses[4]}, {4: source[4]}) > 1e-4


@pytest.mark.slow
def test_loaded_weights_are_the_sources_and_the_schedule_goes_on(runs):
    """The TP 2 run trained at rate 0 saves exactly the Megatron checkpoint's weights; the one at the flags' rate
    saves the position and schedule the source run saved at iteration 3 (12 samples)."""
    saved = consolidated_model_state(checkpoint_directory(runs.out / "megatron_lr0"))
    assert sorted(saved) == sorted(runs.llama.state)
    for name, value in runs.llama.state.items():
        assert torch.equal(saved[name], value), name
    common = read_common(checkpoint_directory(runs.out / "megatron_tp2"))
    reference = read_common(checkpoint_directory(runs.out / "llama", 3))
    assert (common["iteration"], common["consumed_samples"]) == (3, 12)
    assert common["lr_scheduler"] == reference["lr_scheduler"]
    assert "model weights only: its optimizer state is not mapped" in runs.launch_output


@pytest.mark.slow
def test_finetune_takes_the_weights_from_iteration_zero(runs):
    common = read_common(checkpoint_directory(runs.out / "finetune"))
    assert (common["iteration"], common["consumed_samples"]) == (3, 12)
    assert sorted(runs.losses("megatron_finetune")) == [1, 2, 3]
    assert runs.losses("megatron_finetune")[1] != pytest.approx(runs.losses("llama")[3])


@pytest.mark.slow
def test_other_model_flags_and_unknown_folders_are_refused_in_one_line(runs, tmp_path, demo_data):
    """A process started on the Megatron checkpoint with another --num-layers, and one on a folder of model files
    of no known kind: exit 2, one message naming the flag or what the folder holds, no traceback."""
    flags = LLAMA + TRAINING + data_flags(demo_data) + ["--train-iters", "3"]
    wrong = [a if a != "2" or flags[i - 1] != "--num-layers" else "4" for i, a in enumerate(flags)]
    result = one_process(wrong + ["--load", str(runs.out / "megatron")])
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--num-layers (checkpoint 2, now 4)" in result.stderr
    assert "Traceback" not in result.stderr
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    result = one_process(flags + ["--load", str(tmp_path)])
    assert result.returncode == 2 and "no checkpoint of a known kind there, but it holds pytorch_model.bin" in (
        result.stderr)
    assert "Traceback" not in result.stderr


def one_process(args: list[str]) -> subprocess.CompletedProcess:
    """`python rapidtrain/pretrain.py ARGS`, as a user starts one process (torchrun would report its own status)."""
    return subprocess.run([sys.executable, str(PRETRAIN), *args], capture_output=True, text=True, timeout=300,
                          env=child_env(), cwd=REPO)


@pytest.mark.slow
def test_zero3_deepspeed_checkpoint_is_refused_naming_the_way_round(runs):
    """ZeRO stage 3 keeps the weights only in its partitions (DeepSpeed 0.19 names the model file
    zero_pp_rank_0_mp_rank_00_model_states.pt): refused, naming stage 1/2 and zero_to_fp32.py."""
    from rapidtrain.checkpoint.checkpointer import CheckpointError
    from rapidtrain.checkpoint.deepspeed_folder import read_deepspeed
    from rapidtrain.checkpoint.foreign_formats import detect_foreign

    with pytest.raises(CheckpointError, match="ZeRO stage 3 checkpoint.*stage 1 or 2.*zero_to_fp32.py"):
        read_deepspeed(detect_foreign(runs.out / "deepspeed_zero3"))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["universal_tp1", "universal_zero1_dp2", "universal_tp2"])
def test_deepspeed_universal_checkpoint_continues_as_the_folder_it_was_made_from(runs, name):
    """ds_to_universal's output (--universal-checkpoint: latest_universal), loaded at TP 1, into ZeRO-1 over 2 ranks
    and at TP 2: iterations 3 and 4 are those of a load of the ZeRO-1 folder it was made from (latest), the 4th only
    because Adam's moments and step count carried over."""
    assert sorted(runs.losses(name)) == [3, 4]
    assert relative_difference(runs.losses(name), runs.losses("universal_source_tp1")) < TOLERANCE
    assert relative_difference(runs.norms(name), runs.norms("universal_source_tp1")) < TOLERANCE
    for output in (runs.launch_output, (runs.out / "universal_tp1.log").read_text()):
        assert "DeepSpeed universal checkpoint (ds_to_universal), global_step2_universal" in output
        assert "Adam's moments and step count (2) loaded" in output


@pytest.mark.slow
def test_universal_checkpoint_reads_as_the_folder_it_was_made_from(runs, tmp_path):
    """The weights and moments read from the universal folder are, tensor for tensor, those of the ZeRO-1 folder
    ds_to_universal read: the source's own on the tokenizer's rows, zeros on the vocabulary's padding (which the
    conversion drops). A folder holding only latest_universal is read as universal (before, it was taken for an
    empty folder: a silent start from scratch); --universal-checkpoint on a folder without one is refused."""
    import shutil

    from rapidtrain.checkpoint.checkpointer import CheckpointError
    from rapidtrain.checkpoint.foreign import read_foreign, whole_model, whole_moments
    from rapidtrain.checkpoint.foreign_formats import detect_foreign
    from rapidtrain.data.demo import TOKENIZER_VOCAB_SIZE

    root, config = runs.out / "deepspeed_universal", runs.gpt.config
    universal, plain = detect_foreign(root, universal=True), detect_foreign(root)
    assert (universal.kind, universal.tag, plain.kind, plain.tag) == (
        "deepspeed-universal", "global_step2_universal", "deepspeed", "global_step2")
    read, reference = read_foreign(universal), read_foreign(plain)
    assert (read.iteration, read.consumed_samples, read.optimizer_step, read.scheduler) == (
        reference.iteration, reference.consumed_samples, reference.optimizer_step, reference.scheduler)
    weights, moments = whole_model(read, config), whole_moments(read, config)
    assert sorted(weights) == sorted(whole_model(reference, config))
    for name, value in whole_model(reference, config).items():
        assert torch.equal(weights[name], value), name
    for key, values in whole_moments(reference, config).items():
        for name, value in values.items():
            assert torch.equal(moments[key][name], value), (key, name)
    embedding = weights["embedding.word_embeddings.weight"]
    source = runs.gpt.state["embedding.word_embeddings.weight"]
    assert torch.equal(embedding[:TOKENIZER_VOCAB_SIZE], source[:TOKENIZER_VOCAB_SIZE])
    assert not embedding[TOKENIZER_VOCAB_SIZE:].any() and source[TOKENIZER_VOCAB_SIZE:].any()
    assert torch.equal(weights["layers.1.attention.q_proj.weight"], runs.gpt.state["layers.1.attention.q_proj.weight"])

    alone = tmp_path / "universal_only"
    shutil.copytree(root / "global_step2_universal", alone / "global_step2_universal")
    shutil.copy(root / "latest_universal", alone / "latest_universal")
    assert detect_foreign(alone).kind == "deepspeed-universal"
    with pytest.raises(CheckpointError, match="--universal-checkpoint: no latest_universal in --load"):
        detect_foreign(runs.out / "deepspeed", universal=True)
