"""The efficient-training techniques side by side, in one run and one table: what each costs and saves.

Each row runs in a process of its own (allocator state, compiled kernels and peak memory do not leak from one into
the next) and reports what it measured; the table puts rapidtrain's switch beside Hugging Face Trainer's equivalent
option where one exists. Rows:

  pretraining, the demo GPT (pretrain.py's demo: 4 layers, hidden 256, seq 256, micro batch 8, lr 1e-3 cosine):
    fused AdamW          --optimizer adamw            vs Trainer optim="adamw_torch_fused"
    8-bit AdamW          --optimizer adamw_8bit       vs Trainer optim="adamw_bnb_8bit"
  fine-tuning, the local sentiment classification task (rapidtrain.tasks.toy, a tiny BERT trained from scratch):
    full fine-tuning     (no flag)
    LoRA                 --lora-rank 8
    QLoRA (4-bit base)   --lora-rank 8 --load-in-4bit
    LoRA on 8-bit base   --lora-rank 8 --load-in-8bit
  recompute (demo GPT): none, --recompute-granularity selective / op / full (Trainer gradient_checkpointing=True
    is full); the result adds the activation bytes one micro batch's forward keeps alive for backward
  the Trainer's other switches beside rapidtrain's (demo GPT): gradient_checkpointing=True (full recompute, its
    activation bytes too); --torch-compile vs torch_compile=True (inductor; tokens/s after the warm-up steps);
    --auto-micro-batch-size --memory-budget-gb (fits the plan's estimate to the budget, keeps the global batch by
    accumulation) vs auto_find_batch_size=True (accelerate halves the batch only after an allocation fails: a CUDA
    "out of memory", or on CPU a malloc failure, which Linux's overcommit rarely reports before its OOM killer acts;
    there is no budget, so here it keeps the batch it was given)
  fine-tuning a causal LM (a tiny GPT-2 on texts of 13 to 110 tokens, --seq-length 128, micro batch 16): padded to
    --seq-length, padded to each batch's longest (--data-iterator dynamic-shape; Trainer group_by_length=True), and
    --padding-free (one packed row per micro batch; Trainer's DataCollatorWithFlattening); the result adds the
    padded-token fraction, and tokens/s counts real tokens only. On CPU (sdpa) the packed row's attention is one
    masked [row, row] block: the padding saved is paid back in attention over the whole row (flash_attention_2's
    varlen kernel on CUDA computes each sequence alone). Each row trains its own toy tokenizer, whose vocabulary
    can differ between processes, so dev losses differ by ~0.01 from run to run; tests/e2e/test_padding_free.py
    shows packed and padded losses equal per iteration
  ZeRO-3 parameter placement (demo GPT, one process, --optimizer via DeepSpeedCPUAdam):
    ZeRO-3 + --cpu-offload, + --cpu-offload-params, --nvme-offload-dir (where libaio lets DeepSpeed's async_io build)

Columns: tokens/s (steady steps; fine-tuning: padded training tokens over the whole run's wall time), peak RSS of
the process (includes Python and torch, ~0.5 GB), model-state bytes measured on the live objects (parameters as held
in memory, fp32 gradients of trainable ones, optimizer state in memory: NVMe-swapped state is not counted), optimizer
state bytes per trained parameter, trainable parameters, and the result: the mean lm loss of the last 10 iterations
(Trainer: its last logged 10-step mean), or the classification accuracy on the dev split.

    python bench/efficient_training.py [--iters 300] [--epochs 3] [--only ROW ...]

Add a technique by adding a Row to ROWS (and, if it needs a new kind of run, a runner function).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from rapidtrain.optim.state_bytes import measured_state_bytes  # noqa: E402

WARMUP_STEPS = 5  # excluded from tokens/s (first-step allocation, torchao/inductor compilation)


@dataclass(frozen=True)
class Row:
    key: str
    technique: str
    system: str
    run: Callable[[argparse.Namespace, list[str]], dict]
    flags: tuple[str, ...] = ()
    hf_option: str = "—"


# ---- measurements shared by the runners ----


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def model_state_bytes(module: torch.nn.Module, optimizer: object) -> tuple[int, int, int]:
    """(bytes of parameters as stored, of trainable parameters' gradients, of optimizer state), measured."""
    from rapidtrain.optim.state_bytes import _storages

    params = {}
    for p in module.parameters():
        # ZeRO-3 keeps a parameter's shard apart from its (released) full tensor; count what is in memory.
        for held in (p.data, getattr(p, "ds_tensor", None)):
            for tensor in _storages(held):
                params[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate / DeepSpeed wrappers
    return sum(params.values()), 4 * trained_parameters(module), measured_state_bytes(inner)


def trained_parameters(module: torch.nn.Module) -> int:
    """Trainable parameters, full size even where ZeRO-3 has released them (ds_numel)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters() if p.requires_grad)


def steady_tokens_per_second(stamps: list[float], tokens_per_step: int) -> float:
    steady = stamps[WARMUP_STEPS:]
    return tokens_per_step * (len(steady) - 1) / (steady[-1] - steady[0]) if len(steady) > 1 else float("nan")


# ---- pretraining the demo GPT ----


def rapidtrain_pretrain(o: argparse.Namespace, flags: list[str]) -> dict:
    result, trainer = pretrain_demo(o, flags)
    if "--auto-micro-batch-size" in flags:
        batches = trainer.engine.plan.batches
        result["result"] += (f"; micro batch {batches.micro_batch_size} × {batches.accumulation_steps} "
                             f"accumulated = global {batches.global_batch_size}")
    return result


def pretrain_demo(o: argparse.Namespace, flags: list[str]) -> tuple[dict, object]:
    """The demo GPT through rapidtrain's PreTrainer; the measurements and the trainer (its engine stays alive)."""
    from rapidtrain.config.arguments import DEMO_DEFAULTS
    from rapidtrain.pretrain import MegatronPreTrainer
    from rapidtrain.train.engine import Engine
    from tests.launch import read_losses

    stamps: list[float] = []

    class Timed(MegatronPreTrainer):
        def train_step(self, micro_batches, **kwargs):
            result = super().train_step(micro_batches, **kwargs)
            stamps.append(time.perf_counter())
            return result

    with tempfile.TemporaryDirectory() as work:
        log = Path(work) / "losses.txt"
        argv = ["--train-iters", str(o.iters), "--num-workers", "0", "--log-interval", str(10**6), "--eval-iters",
                "0", "--loss-log-file", str(log), *flags]
        trainer = Timed(Engine(argv=argv, defaults=DEMO_DEFAULTS))
        trainer.train()
        losses = read_losses(log)
    plan, runner = trainer.engine.plan, trainer.engine.runner
    module = runner.module
    params, grads, state = model_state_bytes(module, runner.optimizer)
    trained = trained_parameters(module)
    last = [losses[i] for i in sorted(losses)[-10:]]
    return {"tokens/s": steady_tokens_per_second(stamps, plan.batches.global_batch_size * plan.model.seq_length),
            "peak RSS MiB": peak_rss_mib(), "model state MiB": (params + grads + state) / 2**20,
            "state B/param": state / trained, "trainable": trained, "result": f"loss {sum(last) / len(last):.3f}",
            "engine": plan.engine_for("optimizer").engine}, trainer


def hf_trainer_pretrain(o: argparse.Namespace, flags: list[str]) -> dict:
    """Trainer on GPT2LMHeadModel of the demo GPT's shape, the same demo samples, schedule and clipping."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from rapidtrain.config.arguments import DEMO_DEFAULTS
    from rapidtrain.data.demo import prepare_demo_data
    from rapidtrain.data.gpt_dataset import GPTDatasetConfig, build_gpt_datasets
    from rapidtrain.data.tokenizer import TokenizerSettings, build_tokenizer, padded_vocab_size

    optim, *options = flags  # then Trainer options as name=value (gradient_checkpointing=True, ...)
    extra = {name: ast.literal_eval(value) for name, value in (option.split("=", 1) for option in options)}
    seq, batch, hidden = DEMO_DEFAULTS["seq_length"], DEMO_DEFAULTS["micro_batch_size"], DEMO_DEFAULTS["hidden_size"]
    demo = prepare_demo_data(progress=False)
    tokenizer = build_tokenizer(TokenizerSettings("SentencePieceTokenizer", tokenizer_model=demo.tokenizer_model))
    dataset, _, _ = build_gpt_datasets(GPTDatasetConfig([demo.data_prefix], "969, 30, 1", seq, 1234, tokenizer.eod),
                                       [o.iters * batch, 0, 0])
    config = GPT2Config(vocab_size=padded_vocab_size(tokenizer.vocab_size), n_positions=seq, n_embd=hidden, n_layer=4,
                        n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(1234)
    model = GPT2LMHeadModel(config)
    stamps: list[float] = []
    logged: list[float] = []

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                logged.append(logs["loss"])

    class Samples(torch.utils.data.Dataset):
        def __len__(self):
            return len(dataset)

        def __getitem__(self, i):
            tokens = torch.as_tensor(dataset[i]["tokens"])
            return {"input_ids": tokens, "labels": tokens}

    with tempfile.TemporaryDirectory() as work:
        arguments = TrainingArguments(
            output_dir=work, per_device_train_batch_size=batch, max_steps=o.iters,
            learning_rate=DEMO_DEFAULTS["lr"], adam_beta2=DEMO_DEFAULTS["adam_beta2"], weight_decay=0.01,
            max_grad_norm=1.0, warmup_steps=10, lr_scheduler_type="cosine", optim=optim,
            use_cpu=True, report_to=[], logging_steps=10, save_strategy="no", dataloader_num_workers=0,
            disable_tqdm=True, **extra)
        trainer = Trainer(model=model, args=arguments, train_dataset=Samples(), callbacks=[Record()])
        trainer.train()
    params, grads, state = model_state_bytes(model, trainer.optimizer)
    trained = sum(p.numel() for p in model.parameters())
    ran_batch = trainer._train_batch_size  # what auto_find_batch_size settled on (the given batch otherwise)
    result = f"loss {logged[-1]:.3f}" if logged else "no loss logged (fewer than 10 steps)"
    if extra.get("gradient_checkpointing"):
        result += f"; activations kept {hf_saved_activations(model, batch, seq) / 2**20:.1f} MiB per micro batch"
    if extra.get("auto_find_batch_size"):
        result += f"; batch {ran_batch} (started at {batch}; it halves only after an allocation fails)"
    return {"tokens/s": steady_tokens_per_second(stamps, ran_batch * seq), "peak RSS MiB": peak_rss_mib(),
            "model state MiB": (params + grads + state) / 2**20, "state B/param": state / trained,
            "trainable": trained, "result": result,
            "engine": _class_name(getattr(trainer.optimizer, "optimizer", trainer.optimizer))
            + "".join(f", {name}={value}" for name, value in extra.items())}


def hf_saved_activations(model: torch.nn.Module, batch: int, seq: int) -> int:
    """The activation bytes one micro batch's forward leaves for backward in the Trainer's (wrapped) model."""
    from rapidtrain.parallel.recompute import count_saved_activations

    model.train()
    tokens = torch.randint(0, model.config.vocab_size, (batch, seq))
    with count_saved_activations(model.parameters()) as kept:
        loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    return kept["bytes"]


def _class_name(value: object) -> str:
    return f"{type(value).__module__.split('.')[0]} {type(value).__name__}"


# ---- fine-tuning the local classification task ----


def classification_task(root: Path) -> tuple[Path, Path]:
    from rapidtrain.tasks import toy

    return toy.make_task("sequence_classification", root, train=1024, dev=256, hidden=128, dropout=0.0)


def rapidtrain_finetune(o: argparse.Namespace, flags: list[str]) -> dict:
    from rapidtrain.finetune import TaskFinetuner
    from rapidtrain.train.engine import Engine

    with tempfile.TemporaryDirectory() as work:
        model_dir, data = classification_task(Path(work))
        argv = ["--task", "sequence_classification", "--pretrained-model-name-or-path", str(model_dir), "--data-dir",
                str(data.parent), "--data-name", data.name, "--micro-batch-size", "32", "--seq-length", "32",
                "--lr", "1e-3" if "--lora-rank" not in flags else "5e-3", "--num-workers", "0", "--log-interval",
                str(10**6), "--epochs", str(o.epochs), *flags]
        start = time.perf_counter()
        tuner = TaskFinetuner(Engine(argv=argv))
        results = tuner.train()
        seconds = time.perf_counter() - start
    runner = tuner.engine.runner
    params, grads, state = model_state_bytes(runner.module, runner.optimizer)
    trained = trained_parameters(runner.module)
    tokens = 1024 * 32 * o.epochs  # padded tokens seen in training (1024 samples × seq 32 per epoch)
    return {"tokens/s": tokens / seconds, "peak RSS MiB": peak_rss_mib(),
            "model state MiB": (params + grads + state) / 2**20, "state B/param": state / trained,
            "trainable": trained, "result": f"accuracy {results['accuracy']:.3f}",
            "engine": "; ".join(c.engine.split(" (")[0] for c in tuner.engine.plan.engines
                                if c.switch in ("--lora-rank", "--load-in-4bit", "--load-in-8bit")) or "full"}


# ---- fine-tuning a causal LM: padded batches against padding-free packing ----


def varied_texts(count: int, seed: int) -> list[dict]:
    """Rows of 1 to 8 of the toy grammar's sentences (about 13 to 110 tokens): lengths vary as in real data."""
    import random

    from rapidtrain.tasks import toy

    rng = random.Random(seed)
    sentences = [row["text"] for row in toy.text_records(8 * count, seed)]
    return [{"text": " ".join(rng.sample(sentences, rng.randint(1, 8)))} for _ in range(count)]


def rapidtrain_causal_lm(o: argparse.Namespace, flags: list[str]) -> dict:
    """A tiny GPT-2 (hidden 64) fine-tuned on texts of varied length, --seq-length 128, micro batch 16. tokens/s
    counts real tokens (not padding) over the train steps' time; padded = positions computed that hold no token."""
    from rapidtrain.finetune import TaskFinetuner
    from rapidtrain.tasks import toy
    from rapidtrain.train.engine import Engine

    counts = {"positions": 0, "tokens": 0, "seconds": 0.0}

    class Counted(TaskFinetuner):
        def train_step(self, micro_batches, **kwargs):
            for batch in micro_batches:
                counts["positions"] += batch["input_ids"].numel()
                mask = batch.get("attention_mask")
                counts["tokens"] += int(mask.sum()) if mask is not None else batch["input_ids"].numel()
            start = time.perf_counter()
            result = super().train_step(micro_batches, **kwargs)
            counts["seconds"] += time.perf_counter() - start
            return result

    with tempfile.TemporaryDirectory() as work:
        model_dir, data = toy.make_task("casual_lm", Path(work), train=8, dev=8, hidden=64, dropout=0.0)
        texts = varied_texts(512 + 64, seed=3)  # the tokenizer's vocabulary is the same grammar's words
        toy.write_jsonl(data / "train.jsonl", texts[:512])
        toy.write_jsonl(data / "dev.jsonl", texts[512:])
        argv = ["--task", "casual_lm", "--pretrained-model-name-or-path", str(model_dir), "--data-dir",
                str(data.parent), "--data-name", data.name, "--micro-batch-size", "16", "--seq-length", "128",
                "--lr", "3e-3", "--num-workers", "0", "--log-interval", str(10**6), "--epochs", str(o.epochs), *flags]
        tuner = Counted(Engine(argv=argv))
        results = tuner.train()
    runner = tuner.engine.runner
    params, grads, state = model_state_bytes(runner.module, runner.optimizer)
    trained = trained_parameters(runner.module)
    padded = 1 - counts["tokens"] / counts["positions"]
    return {"tokens/s": counts["tokens"] / counts["seconds"], "peak RSS MiB": peak_rss_mib(),
            "model state MiB": (params + grads + state) / 2**20, "state B/param": state / trained,
            "trainable": trained, "result": f"dev loss {results['loss']:.3f}; padded tokens {padded:.1%}",
            "engine": "padding-free" if "--padding-free" in flags else
            "dynamic shape" if "--data-iterator" in flags else "padded to --seq-length 128"}


# ---- ZeRO-3 parameter placement ----


def rapidtrain_zero3(o: argparse.Namespace, flags: list[str]) -> dict:
    """The demo GPT under ZeRO-3 for a few iterations; where its parameters live afterwards (parameter_residency)."""
    from rapidtrain.parallel.deepspeed import parameter_residency

    with tempfile.TemporaryDirectory() as nvme:
        flags = [nvme if f == "NVME" else f for f in flags]
        short = argparse.Namespace(**{**vars(o), "iters": o.offload_iters})
        # The demo's 10 warm-up iterations would not fit in a short run.
        result, trainer = pretrain_demo(short, ["--zero-3-memory-optimization", "--lr-warmup-iters", "2", *flags])
        engine = trainer.engine
        where = parameter_residency(engine.runner.engine.module, engine.plan.zero.offload_params)
    device = (where["gathered on device"] + where["shard on device"]) / 2**20
    result["result"] += (f"; parameters: device {device:.2f} MiB, host {where['shard in host memory'] / 2**20:.2f} "
                         f"MiB, nvme {where['shard on nvme'] / 2**20:.2f} MiB")
    return result


def rapidtrain_recompute(o: argparse.Namespace, flags: list[str]) -> dict:
    """The demo GPT with a recompute granularity; beside its loss, the activation bytes one micro batch's forward
    leaves alive for backward (parallel/recompute.count_saved_activations)."""
    from rapidtrain.parallel.recompute import count_saved_activations

    result, trainer = pretrain_demo(o, flags)
    plan, module = trainer.engine.plan, trainer.engine.runner.module
    tokens = torch.randint(0, plan.model.vocab_size, (plan.batches.micro_batch_size, plan.model.seq_length + 1))
    with count_saved_activations(module.parameters()) as kept:
        loss = module(tokens[:, :-1], labels=tokens[:, 1:]).mean()
    loss.backward()
    result["result"] += f"; activations kept {kept['bytes'] / 2**20:.1f} MiB per micro batch"
    result["engine"] = plan.switches.recompute.granularity
    return result


def async_io_builds() -> bool:
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return AsyncIOBuilder().is_compatible(verbose=False)


ROWS = (
    Row("adamw", "fused AdamW", "rapidtrain", rapidtrain_pretrain, ("--optimizer", "adamw"),
        'optim="adamw_torch_fused"'),
    Row("adamw-hf", "fused AdamW", "HF Trainer", hf_trainer_pretrain, ("adamw_torch_fused",),
        'optim="adamw_torch_fused"'),
    Row("adamw8", "8-bit AdamW", "rapidtrain", rapidtrain_pretrain, ("--optimizer", "adamw_8bit"),
        'optim="adamw_bnb_8bit"'),
    Row("adamw8-hf", "8-bit AdamW", "HF Trainer", hf_trainer_pretrain, ("adamw_bnb_8bit",), 'optim="adamw_bnb_8bit"'),
    Row("full-ft", "full fine-tuning", "rapidtrain", rapidtrain_finetune),
    Row("lora", "LoRA r=8", "rapidtrain", rapidtrain_finetune, ("--lora-rank", "8")),
    Row("qlora", "QLoRA 4-bit base r=8", "rapidtrain", rapidtrain_finetune, ("--lora-rank", "8", "--load-in-4bit")),
    Row("lora8", "LoRA 8-bit base r=8", "rapidtrain", rapidtrain_finetune, ("--lora-rank", "8", "--load-in-8bit")),
    Row("recompute-none", "no recompute", "rapidtrain", rapidtrain_recompute),
    Row("recompute-selective", "recompute selective (attention core)", "rapidtrain", rapidtrain_recompute,
        ("--recompute-granularity", "selective")),
    Row("recompute-op", "recompute op level (keep matmuls)", "rapidtrain", rapidtrain_recompute,
        ("--recompute-granularity", "op")),
    Row("recompute-full", "recompute full layers", "rapidtrain", rapidtrain_recompute,
        ("--recompute-granularity", "full"), "gradient_checkpointing=True"),
    Row("recompute-full-hf", "recompute full layers", "HF Trainer", hf_trainer_pretrain,
        ("adamw_torch_fused", "gradient_checkpointing=True"), "gradient_checkpointing=True"),
    Row("compile", "torch.compile (inductor)", "rapidtrain", rapidtrain_pretrain, ("--torch-compile",),
        "torch_compile=True"),
    Row("compile-hf", "torch.compile (inductor)", "HF Trainer", hf_trainer_pretrain,
        ("adamw_torch_fused", "torch_compile=True"), "torch_compile=True"),
    Row("auto-batch", "auto micro batch (budget 0.2 GB)", "rapidtrain", rapidtrain_pretrain,
        ("--auto-micro-batch-size", "--memory-budget-gb", "0.2"), "auto_find_batch_size=True"),
    Row("auto-batch-hf", "auto batch size (halve on OOM)", "HF Trainer", hf_trainer_pretrain,
        ("adamw_torch_fused", "auto_find_batch_size=True"), "auto_find_batch_size=True"),
    Row("clm-padded", "causal LM, padded to seq length", "rapidtrain", rapidtrain_causal_lm),
    Row("clm-dynamic", "causal LM, padded to batch longest", "rapidtrain", rapidtrain_causal_lm,
        ("--data-iterator", "dynamic-shape"), "group_by_length=True"),
    Row("clm-packed", "causal LM, padding-free packing", "rapidtrain", rapidtrain_causal_lm, ("--padding-free",),
        "DataCollatorWithFlattening"),
    Row("zero3", "ZeRO-3 (+ --cpu-offload)", "rapidtrain", rapidtrain_zero3, ("--cpu-offload",)),
    Row("zero3-params", "ZeRO-3 + --cpu-offload-params", "rapidtrain", rapidtrain_zero3,
        ("--cpu-offload", "--cpu-offload-params")),
    Row("zero-infinity", "ZeRO-Infinity (--nvme-offload-dir)", "rapidtrain", rapidtrain_zero3,
        ("--nvme-offload-dir", "NVME")),
)


def run_child(o: argparse.Namespace, row: Row) -> dict:
    if os.environ.get("RAPIDTRAIN_BENCH_SMOKE_IN_PROCESS") == "1":  # the smoke tests: see pretrain_throughput.py
        torch.manual_seed(1234)
        return row.run(o, list(row.flags))
    command = [sys.executable, __file__, "--row", row.key, "--iters", str(o.iters), "--epochs", str(o.epochs),
               "--offload-iters", str(o.offload_iters)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        return {"error": (result.stderr.strip().splitlines() or ["failed"])[-1][:100]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=300, help="pretraining iterations (the demo's 300)")
    parser.add_argument("--epochs", type=int, default=3, help="fine-tuning epochs")
    parser.add_argument("--offload-iters", type=int, default=20, help="iterations of the ZeRO-3 placement rows")
    parser.add_argument("--only", nargs="+", default=None, choices=[row.key for row in ROWS], metavar="ROW",
                        help="row keys to run (default: all): " + ", ".join(row.key for row in ROWS))
    parser.add_argument("--row", help=argparse.SUPPRESS)  # child process: one measurement
    o = parser.parse_args()
    by_key = {row.key: row for row in ROWS}
    if o.row:
        row = by_key[o.row]
        torch.manual_seed(1234)
        print(json.dumps(row.run(o, list(row.flags))))
        return 0
    rows = [by_key[k] for k in (o.only or by_key)]
    if "zero-infinity" in {r.key for r in rows} and not async_io_builds():
        rows = [r for r in rows if r.key != "zero-infinity"]
        print("zero-infinity row left out: DeepSpeed's async_io op cannot build here (libaio missing)")
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    print(f"{cpu}; {torch.get_num_threads()} threads; torch {torch.__version__}; pretraining {o.iters} iterations, "
          f"fine-tuning {o.epochs} epochs, ZeRO-3 rows {o.offload_iters} iterations", flush=True)
    results = []
    for row in rows:
        start = time.perf_counter()
        results.append((row, run_child(o, row)))
        print(f"  {row.key}: {time.perf_counter() - start:.0f} s", flush=True)
    header = (f"{'technique':<36} {'system':<11} {'HF Trainer option':<26} {'tokens/s':>9} {'peak RSS':>9} "
              f"{'state MiB':>9} {'opt B/param':>11} {'trainable':>10}  result")
    print("\n" + header + "\n" + "-" * len(header))
    for row, r in results:
        if "error" in r:
            print(f"{row.technique:<36} {row.system:<11} {row.hf_option:<26} failed: {r['error']}")
            continue
        print(f"{row.technique:<36} {row.system:<11} {row.hf_option:<26} {r['tokens/s']:9.0f} "
              f"{r['peak RSS MiB']:8.0f}M {r['model state MiB']:9.2f} {r['state B/param']:11.2f} "
              f"{r['trainable']:10,}  {r['result']}")
    print("\nengines: " + "; ".join(f"{row.key} = {r.get('engine', '?')}" for row, r in results))
    print("state MiB: parameters as stored + fp32 gradients of trainable parameters + optimizer state, measured on "
          "the live objects; opt B/param: optimizer state per trained parameter. Peak RSS includes the interpreter "
          "and libraries (~0.5 GB).")
    return 1 if any("error" in r for _, r in results) else 0  # the table is printed; a failed row fails the run


if __name__ == "__main__":
    sys.exit(main())
