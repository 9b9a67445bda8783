"""Launch scripts of tests/compat/launch_scripts.json run for real, as their users run them, changed only in paths,
sizes and world size (two CPU processes with gloo at most): Megatron-LM's entry points for Megatron's scripts, and
user scripts written here in the shape of EasyNLP's Rapidformer examples for those (tests/compat/user_scripts/).

What these tests prove is what each script's flags do in training, not how a process starts (the entry points'
plain starts are tests/compat/test_megatron_tasks.py's, tests/e2e/test_pretrain.py's and the README test's): the
one-process runs share one Python process (run_launch_scripts.py, each run in a fresh single-rank process group,
a user script run as `python SCRIPT FLAGS` runs it), and the two-process runs one warm torchrun launch of 2 ranks
(tests/launch.py), one run after another. A start costs some 3-6 CPU-s of imports; the file started 19 before."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.compat.launch_data import BY_ID, LocalFiles, groups, tiny
from tests.compat.run_launch_scripts import results
from tests.launch import REPO, child_env, torchrun

USER_SCRIPTS = Path(__file__).resolve().parent / "user_scripts"
ENTRY = {name: REPO / "rapidtrain" / f"{name}.py" for name in ("pretrain_gpt", "pretrain_bert")}
RUNNER = Path(__file__).with_name("run_launch_scripts.py")


def log_lines(output: str) -> list[str]:
    return re.findall(r"\] iteration +\d+/ +\d+ \|[^\n]*", output)


def field(line: str, name: str) -> str | None:
    found = re.search(rf"\| {re.escape(name)}: +([^|]+?) \|", line)
    return found.group(1).strip() if found else None


def latest(folder: str) -> int:
    return int((Path(folder) / "latest_checkpointed_iteration.txt").read_text())


def value_of(argv: list[str], flag: str) -> str:
    return next(values[0] for name, values in groups(argv) if name == flag)


def python(script: Path, argv: list[str]) -> subprocess.CompletedProcess:
    """`python SCRIPT FLAGS`: one process, as the scripts launched with plain python run."""
    result = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, env=child_env(),
                            cwd=REPO, timeout=600)
    assert result.returncode == 0, f"{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
    return result


@dataclass
class Ran:
    argv: list[str]
    stdout: str  # the run's own output (its markers' lines), stdout and stderr together


class Runs:
    """The runs of one launch, by id: `add` them, `start` once, then `ran(id)` asserts that one finished."""

    def __init__(self) -> None:
        self.runs: list[dict] = []
        self.done: dict[str, tuple[int, str]] = {}
        self.output = ""

    def add(self, run_id: str, entry: str | Path, argv: list[str]) -> None:
        self.runs.append({"id": run_id, "entry": str(entry), "argv": argv})

    def ran(self, run_id: str) -> Ran:
        argv = next(run["argv"] for run in self.runs if run["id"] == run_id)
        status, stdout = self.done.get(run_id, (None, ""))
        assert status == 0, f"{run_id}: status {status}\n{stdout[-6000:]}\n{self.output[-6000:]}"
        return Ran(argv, stdout)


@pytest.fixture(scope="module")
def one_process(local_files: LocalFiles, tmp_path_factory) -> Runs:
    """Every one-process run of this file in one Python process (run_launch_scripts.py), in this order."""
    runs = Runs()
    gpt2021 = tiny(BY_ID["mlm-gpt-2021"], local_files)
    runs.add("mlm-gpt-2021", "pretrain_gpt", gpt2021)
    runs.add("mlm-gpt-2021:again", "pretrain_gpt", gpt2021)  # the same command again, after the first
    runs.add("mlm-bert-2020", "pretrain_bert", tiny(BY_ID["mlm-bert-2020"], local_files))
    bloom = {"--tensor-model-parallel-size": "1", "--pipeline-model-parallel-size": "1",
             "--pad-vocab-size-to": None, "--train-weighted-split-paths-path": None,
             "--valid-weighted-split-paths-path": None, "--data-path": local_files.gpt_prefix}
    runs.add("bsw-tr11b-1b3-2022", "pretrain_gpt", tiny(BY_ID["bsw-tr11b-1b3-2022"], local_files, bloom))
    runs.add("bmds-gpt-multilingual-2021", "pretrain_gpt", tiny(BY_ID["bmds-gpt-multilingual-2021"], local_files))
    qwen3 = {"--tensor-model-parallel-size": "1", "--pipeline-model-parallel-size": "1", "--kv-channels": "24",
             "--moe-layer-freq": "([1]*4)", "--padded-vocab-size": "1024"}
    runs.add("pai-qwen3-mcore-2025", "pretrain_gpt", tiny(BY_ID["pai-qwen3-mcore-2025"], local_files, qwen3))
    add_easynlp_bert_finetuning(runs, local_files, tmp_path_factory.mktemp("ez-bert-ft"))
    add_easynlp_gpt_moe_pretraining(runs, local_files)
    add_easynlp_zeroclue(runs, local_files, tmp_path_factory.mktemp("zeroclue"))
    for experts in (["0", "2", "0", "2"], ["0"]):
        add_easynlp_gpt_moe_finetuner(runs, local_files, tmp_path_factory.mktemp("moe-ft"), experts)
    add_easynlp_bert_pretraining(runs, local_files, tmp_path_factory.mktemp("ez-bert-pretrain"))
    path = tmp_path_factory.mktemp("one-process") / "runs.json"
    path.write_text(json.dumps(runs.runs))
    run = subprocess.run([sys.executable, str(RUNNER), str(path)], capture_output=True, text=True, env=child_env(),
                         cwd=REPO, timeout=900)
    runs.output, runs.done = run.stdout + run.stderr[-6000:], results(run.stdout)
    return runs


def add_easynlp_bert_finetuning(runs: Runs, local_files: LocalFiles, folder: Path) -> None:
    from rapidtrain.tasks import toy

    model, data = toy.make_task("sequence_classification", folder / "task", train=32, dev=16)
    shape = json.loads((model / "config.json").read_text())
    changes = {"--pretrained-model-name-or-path": str(model), "--data-dir": str(data.parent), "--data-name": data.name,
               "--user-defined-parameters": f"pretrain_model_name_or_path={model}", "--epochs": "2",
               "--num-layers": str(shape["num_hidden_layers"]), "--hidden-size": str(shape["hidden_size"]),
               "--num-attention-heads": str(shape["num_attention_heads"]),
               "--max-position-embeddings": str(shape["max_position_embeddings"])}
    runs.add("ez-rf-bert-ft-2022", USER_SCRIPTS / "easynlp_bert_finetune.py",
             tiny(BY_ID["ez-rf-bert-ft-2022"], local_files, changes))


def add_easynlp_gpt_moe_pretraining(runs: Runs, local_files: LocalFiles) -> None:
    script = USER_SCRIPTS / "rapidformer_gpt_moe.py"
    runs.add("ez-rf-gpt-moe-pretrain-2023", script, tiny(BY_ID["ez-rf-gpt-moe-pretrain-2023"], local_files,
                                                         {"--fp16": []}))
    dense = tiny(BY_ID["ez-rf-gpt-moe-pretrain-2023"], local_files, {"--num-experts": None, "--save": None,
                                                                     "--pretrained-model-name-or-path": None,
                                                                     "--use-expert-residual-network": None,
                                                                     "--fp16": None})
    runs.add("ez-rf-gpt-moe-pretrain-2023:dense", script, dense)


def write_prompt_rows(folder: Path) -> list[str]:
    """ZeroCLUE's tab-separated rows (16 to train on, 8 to validate) with the script's first three labels."""
    values = BY_ID["ez-rf-gpt-moe-ft-2022"]["argv"]
    labels = values[values.index("--label_enumerate_values") + 1].split(",")[:3]
    for name, count in (("train", 16), ("dev", 8)):
        rows = (f"sentence number {i} about {labels[i % 3]}\t{labels[i % 3]}\t{i}\n" for i in range(count))
        (folder / f"{name}.tsv").write_text("".join(rows))
    return labels


def add_easynlp_zeroclue(runs: Runs, local_files: LocalFiles, folder: Path) -> None:
    write_prompt_rows(folder)
    changes = {"--tokenizer-type": "GPT2BPETokenizer", "--vocab-file": local_files.gpt_vocab,
               "--merge-file": local_files.gpt_merges, "--num-experts": ["0", "2", "0", "2"], "--epochs": "2",
               "--pretrained-model-name-or-path": None, "--train-data": str(folder / "train.tsv"),
               "--valid-data": str(folder / "dev.tsv"), "--save": str(folder / "out"), "--micro-batch-size": "4"}
    runs.add("ez-rf-gpt-moe-ft-2022", USER_SCRIPTS / "rapidformer_gpt_prompts.py",
             tiny(BY_ID["ez-rf-gpt-moe-ft-2022"], local_files, changes))


def add_easynlp_gpt_moe_finetuner(runs: Runs, local_files: LocalFiles, folder: Path, experts: list[str]) -> None:
    write_prompt_rows(folder)
    changes = {"--tokenizer-type": "GPT2BPETokenizer", "--vocab-file": local_files.gpt_vocab,
               "--merge-file": local_files.gpt_merges, "--num-experts": experts, "--epochs": "1",
               "--pretrained-model-name-or-path": None, "--train-data": str(folder / "train.tsv"),
               "--valid-data": str(folder / "dev.tsv"), "--save": str(folder / "out"), "--micro-batch-size": "4",
               "--zero-2-memory-optimization": None, **({"--mlp-type": None} if experts == ["0"] else {})}
    runs.add(f"easynlp-gpt-moe-finetune:{'-'.join(experts)}", USER_SCRIPTS / "easynlp_gpt_moe_finetune.py",
             tiny(BY_ID["ez-rf-gpt-moe-ft-2022"], local_files, changes))


def add_easynlp_bert_pretraining(runs: Runs, local_files: LocalFiles, folder: Path) -> None:
    from transformers import BertConfig, BertForPreTraining

    rows = len(Path(local_files.bert_vocab).read_text().splitlines())  # the ids vocab.txt defines
    config = BertConfig(vocab_size=rows, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=256, max_position_embeddings=64)
    BertForPreTraining(config).save_pretrained(folder / "bert")
    changes = {"--pretrained-model-name-or-path": str(folder / "bert"), "--fsdp-memory-optimization": None}
    runs.add("ez-rf-bert-pretrain-2022", USER_SCRIPTS / "easynlp_bert_pretrain.py",
             tiny(BY_ID["ez-rf-bert-pretrain-2022"], local_files, changes))


def test_megatron_2021_gpt_script_trains_with_fp16_saves_and_finds_its_work_done(one_process):
    """Megatron-LM's examples/pretrain_gpt.sh (2021): one process, fp16 with Megatron's dynamic loss scale (an
    iteration that overflows is skipped and halves the scale), --save and --load the same folder; run again, it
    loads its checkpoint and has nothing to do."""
    run = one_process.ran("mlm-gpt-2021")
    lines = log_lines(run.stdout)
    assert len(lines) == 4 and "tokenizer GPT2BPETokenizer" in run.stdout
    scales = [float(field(line, "loss scale")) for line in lines]
    for line, scale, after in zip(lines, scales, scales[1:] + [None], strict=True):
        if field(line, "number of skipped iterations") == "1":
            assert field(line, "lm loss") is None and (after is None or after == scale / 2)
    assert latest(value_of(run.argv, "--save")) == 4 and "validation loss at iteration 2" in run.stdout
    again = one_process.ran("mlm-gpt-2021:again")
    assert "loaded checkpoint" in again.stdout and "nothing to do" in again.stdout


def test_megatron_2020_bert_script_with_its_2020_flag_names(one_process):
    """Megatron-LM's examples/pretrain_bert.sh (2020): --batch-size and --warmup, Megatron's names of that year,
    are the micro batch and the warm-up fraction; BERT trains with its sentence-order head."""
    run = one_process.ran("mlm-bert-2020")
    assert "--batch-size 2: Megatron 2020's name of --micro-batch-size" in run.stdout
    assert "--warmup 0.01: Megatron 2020's name of --lr-warmup-fraction" in run.stdout
    assert re.search(r"lm loss value: \S+ \| lm loss PPL: \S+ \| sop loss value: \S+", run.stdout)
    assert len(log_lines(run.stdout)) == 4


def test_bigscience_bloom_1b3_script_trains_with_alibi_and_the_embedding_layernorm(one_process):
    """BigScience's tr11b-1B3-ml.slurm (2022, BLOOM's architecture): one process, fp16, ALiBi and --embed-layernorm
    in the model that trains and in its checkpoint. Its --pad-vocab-size-to and weighted split-path files are not
    in rapidtrain (test_launch_scripts.py): the run pads by --make-vocab-size-divisible-by and reads --data-path."""
    from torch.distributed.checkpoint import FileSystemReader

    run = one_process.ran("bsw-tr11b-1b3-2022")
    assert "model: built-in GPT (BLOOM-style)" in run.stdout
    assert "ALiBi position biases (per-head slopes, no position embeddings)" in run.stdout
    assert "LayerNorm on the word embeddings" in run.stdout
    assert len(log_lines(run.stdout)) == 4 and latest(value_of(run.argv, "--save")) == 4
    saved = FileSystemReader(str(Path(value_of(run.argv, "--save")) / "iter_0000004")).read_metadata()
    names = set(saved.state_dict_metadata)
    assert any(name.endswith("embedding.word_embeddings_norm.weight") for name in names), sorted(names)[:20]
    assert not any("position_embeddings" in name for name in names)


def test_bigscience_multilingual_script_trains_on_its_weighted_split_paths(one_process):
    """BigScience's examples/pretrain_gpt_multilingual.sh (2021): one training blend of four document ranges (its
    commas left out, as the script writes it), five validation and five test groups, each evaluated on its own."""
    run = one_process.ran("bmds-gpt-multilingual-2021")
    assert len(log_lines(run.stdout)) == 4 and "--split 949,50,1: no effect here" in run.stdout
    for group in ("VALID_EN", "VALID_KR", "VALID_EN-AR-JP-KR_BALANCED"):
        assert re.search(rf"validation {group} loss at iteration \d+ \| lm loss value: \S+", run.stdout), group
    assert re.search(r"test TEST_EN-AR-JP-KR_BALANCED loss at iteration 4 \| lm loss value: \S+", run.stdout)


def test_easynlp_bert_finetuning_reads_its_application_flags(one_process):
    """EasyNLP's Rapidformer text classification (2022): --app-name and --user-defined-parameters reach the user
    script through get_args(); the shape flags are those of the local model's config.json."""
    run = one_process.ran("ez-rf-bert-ft-2022")
    assert "note: --app-name: for the user script" in run.stdout
    assert re.search(r"epoch 2 \| iteration 16 \| validation accuracy: [0-9.]+", run.stdout)


def test_easynlp_gpt_moe_pretraining_with_rapidformers_gpt_model(one_process):
    """EasyNLP's Rapidformer GPT-MoE pretraining (2023): --pretrained-model-name-or-path names its own --save
    folder (empty: training starts from scratch), experts with PR-MoE residual MLPs, the loss function's lm and
    moe losses in the log line, TensorBoard and --logging-path."""
    run = one_process.ran("ez-rf-gpt-moe-pretrain-2023")
    assert "holds no checkpoint yet, so training starts from scratch" in run.stdout
    lines = log_lines(run.stdout)
    assert len(lines) == 4 and all("moe loss:" in line for line in lines if "lm loss:" in line)
    assert "moe loss value:" in run.stdout and "load balancing loss:" in lines[0]
    assert list(Path(value_of(run.argv, "--tensorboard-dir")).rglob("events.out.tfevents.*"))
    assert latest(value_of(run.argv, "--save")) == 4
    dense = one_process.ran("ez-rf-gpt-moe-pretrain-2023:dense")  # per-token losses [b, s] with the loss mask
    assert [field(line, "lm loss") is not None for line in log_lines(dense.stdout)].count(True) >= 1


def test_easynlp_zeroclue_prompt_fine_tuning_under_deepspeed_zero2(one_process):
    """EasyNLP's Rapidformer ZeroCLUE example (2022): PETDataset prompts from tab-separated rows, experts with
    residual MLPs on alternate layers, DeepSpeed ZeRO-2, the script's own flags through its extra_args_provider.
    Its ChineseBPETokenizer is refused here (test_launch_scripts.py), so this run tokenizes with GPT-2's BPE."""
    run = one_process.ran("ez-rf-gpt-moe-ft-2022")
    assert "experts [0, 2, 0, 2]" in run.stdout and "DeepSpeed ZeRO stage 2" in run.stdout
    assert re.search(r"epoch 2 \| iteration 8 \| validation lm loss: \S+", run.stdout)  # 16 rows / 4 = 4 per epoch
    assert all("moe loss:" in line for line in log_lines(run.stdout) if "lm loss:" in line)


@pytest.mark.parametrize("experts", [["0", "2", "0", "2"], ["0"]])
def test_easynlp_gpt_moe_finetuner_runs_as_written(one_process, experts):
    """EasyNLP's ZeroCLUE GPT-MoE fine-tuning script as its users wrote it (user_scripts/easynlp_gpt_moe_finetune.py):
    Rapidformer's PETDataset signature, and a loss function that adds its layers' balancing losses, or the plain 0
    that `sum([])` gives without experts; validation and the log line both come out."""
    run = one_process.ran(f"easynlp-gpt-moe-finetune:{'-'.join(experts)}")
    assert re.search(r"epoch 1 \| iteration 4 \| validation lm loss: \S+", run.stdout)
    lines = [line for line in log_lines(run.stdout) if "lm loss:" in line]
    assert lines and all(("moe loss:" in line) == (experts != ["0"]) for line in lines)


def test_easynlp_bert_pretraining_of_a_hugging_face_model_on_megatron_data(one_process):
    """EasyNLP's Rapidformer BERT pretraining (2022): a Hugging Face BertForPreTraining trained on Megatron's
    sentence-split indexed data through build_pretrain_huggingface_bert_datasets."""
    run = one_process.ran("ez-rf-bert-pretrain-2022")
    losses = [float(field(line, "lm loss")) for line in log_lines(run.stdout)]
    assert len(losses) == 4 and all(loss > 0 for loss in losses)


# Two processes each: the script, what its flags change for two CPU ranks, and what the run must print.
TORCHRUN = {
    "mds-llama2-2024": ({"--pipeline-model-parallel-size": "1"}, [
        "DeepSpeed does not run this layout", "--normalization rmsnorm: RMSNorm",
        "--num-key-value-heads 2: --num-query-groups 2 --group-query-attention"]),
    "bsw-tr10-13b-2022": ({"--tensor-model-parallel-size": "1"}, [
        "--zero-stage 1: --zero-1-memory-optimization", "DeepSpeed does not run this layout (ZeRO stage 1 with "
        "tensor-parallel 1, pipeline 2", "--tokenizer-type PretrainedFromHF: HuggingFaceTokenizer",
        "sets fp16.loss_scale 0"]),
    "dse-3d-pipe-2021": ({"--model-parallel-size": "1"}, [
        "--pipe-parallel-size 2: DeepSpeed's name", "--gas 1: --global-batch-size 2", "torch.distributed.pipelining"]),
    "pai-llama3-mcore-2025": ({}, [
        "--patch-tokenizer-type LLama3Tokenizer: --tokenizer-type HuggingFaceTokenizer",
        "--dataset LLama-Pretrain-Idxmap: Megatron indexed data", "--extra-vocab-size 256: no effect here"]),
    "mds-rope-1.3b-2023": ({"--pipeline-model-parallel-size": "1"}, [
        "--lr-decay-tokens 1024: --lr-decay-samples 16", "--lr-warmup-tokens 128: --lr-warmup-samples 2"]),
    "mlm-mixtral-2026": ({"--pipeline-model-parallel-size": "1"}, [
        "--moe-grouped-gemm: no effect here", "--moe-router-load-balancing-type aux_loss"]),
}


@pytest.fixture(scope="module")
def two_processes(local_files: LocalFiles, tmp_path_factory) -> Runs:
    """TORCHRUN's scripts on one torchrun launch of 2 ranks, one after another on its process group."""
    runs = Runs()
    for script_id, (changes, _) in TORCHRUN.items():
        runs.add(script_id, "pretrain_bert" if "bert" in BY_ID[script_id]["entry"] else "pretrain_gpt",
                 tiny(BY_ID[script_id], local_files, changes))
    path = tmp_path_factory.mktemp("two-processes") / "runs.json"
    path.write_text(json.dumps(runs.runs))
    run = torchrun(2, RUNNER, [str(path)], warm=True, check=False)
    runs.output, runs.done = run.stdout + run.stderr[-6000:], results(run.stdout)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("script_id", list(TORCHRUN))
def test_launch_script_trains_on_two_processes(two_processes, script_id):
    run = two_processes.ran(script_id)
    missing = [text for text in TORCHRUN[script_id][1] if text not in run.stdout]
    assert not missing, f"{missing} not in:\n{run.stdout[-5000:]}"
    assert len(log_lines(run.stdout)) == 4


def test_pai_qwen3_script_trains_with_its_head_size_and_qk_norms(one_process):
    """Pai-Megatron-Patch's Qwen3-30B-A3B pretraining script (2025), shrunk to one process (TP 4 × PP 2 × EP 4
    become 1): 24-dimension heads apart from hidden 64 / 4 heads (as Qwen3's 128 apart from 2048 / 32), RMSNorm on
    each head's queries and keys, every layer MoE with --moe-ffn-hidden-size experts, --padded-vocab-size rows.
    The checkpoint it saves holds the q/k norms and projections of that head size."""
    from torch.distributed.checkpoint import FileSystemReader

    run = one_process.ran("pai-qwen3-mcore-2025")
    assert len(log_lines(run.stdout)) == 4
    assert "head size 24 (--kv-channels), q/k RMSNorm per head (--qk-layernorm)" in run.stdout
    assert "experts [2, 2, 2, 2]" in run.stdout and "ffn 128" in run.stdout and "padded vocab 1024" in run.stdout
    save = value_of(run.argv, "--save")
    folder = Path(save) / f"iter_{latest(save):07d}"
    shapes = {name: tuple(meta.size) for name, meta in FileSystemReader(str(folder)).read_metadata()
              .state_dict_metadata.items() if hasattr(meta, "size")}
    layer = next(name for name in shapes if name.endswith("layers.3.attention.q_norm.weight")).rsplit("q_norm", 1)[0]
    assert shapes[layer + "q_norm.weight"] == shapes[layer + "k_norm.weight"] == (24,)
    assert shapes[layer + "q_proj.weight"] == (4 * 24, 64) and shapes[layer + "o_proj.weight"] == (64, 4 * 24)
