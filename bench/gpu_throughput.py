"""GPU pretraining throughput: the built-in GPT at ~350M and ~1.3B parameters (seq 2048, bf16) through
rapidtrain, a plain PyTorch loop and Hugging Face Trainer on the same GPU, with and without torch.compile; then
peak GPU memory of rapidtrain's modes (DDP, FSDP, ZeRO-2, ZeRO-3) at world size 1. One run, one table.

    python bench/gpu_throughput.py                        # everything (about 15-25 minutes on an H100)
    python bench/gpu_throughput.py --sizes 350m --iters 20 --no-memory
    python bench/gpu_throughput.py --smoke-cpu            # every code path on a tiny model on the CPU (no numbers)
    python bench/gpu_throughput.py --sizes 1.3b --compile-modes off --systems rapidtrain "plain loop" --profile DIR

Model shapes are GPT-2 medium and GPT-3 XL's (24 layers, hidden 1024 / 2048, 16 heads, GELU MLP 4h, learned
positions, tied embeddings) over a 50,257-token vocabulary (padded to 50,304): 355M and 1.31B parameters.
The data is random token ids written once as Megatron indexed data (the bench measures compute, not text).
Every system trains the same shape with fused AdamW, clipping 1.0, bf16 autocast over fp32 weights (HF: its
`bf16=True`, the same), the same micro batch; tokens/s counts steady steps (the first `--warmup` are left out:
compilation, allocator warm-up). MFU = model FLOPs (Megatron's count, `rapidtrain.models.counting`) per second
over the GPU's dense bf16 peak (`rapidtrain.core.peak_flops`; `--peak-tflops` for a GPU it does not know). Each
system runs in a process of its own, so allocator state and compiled kernels do not leak between them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

VOCAB = 50257  # GPT-2's; padded to a multiple of 128 by rapidtrain (50,304), and given as such to the others
PADDED_VOCAB = 50304
SIZES = {  # name → (layers, hidden, heads, micro batch on an 80 GB GPU)
    "350m": (24, 1024, 16, 8),
    "1.3b": (24, 2048, 16, 4),
    "tiny": (2, 64, 4, 2),  # --smoke-cpu only
}
SYSTEMS = ("rapidtrain", "plain loop", "HF Trainer")
MEMORY_MODES = {"DDP": [], "FSDP": ["--fsdp-memory-optimization"], "ZeRO-2": ["--zero-2-memory-optimization"],
                "ZeRO-3": ["--zero-3-memory-optimization"]}


# ---- data: random ids as Megatron indexed data, written once ----

def write_random_corpus(folder: Path, tokens: int, seed: int = 0) -> str:
    import numpy as np

    from rapidtrain.data.indexed import IndexedDatasetBuilder

    prefix = folder / "random_text_document"
    if Path(f"{prefix}.idx").exists():
        return str(prefix)
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    written = 0
    while written < tokens:
        length = int(rng.integers(512, 4096))
        builder.add_document([rng.integers(0, VOCAB - 1, length, dtype=np.uint16)])
        written += length
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def rapidtrain_flags(o: argparse.Namespace, data_prefix: str) -> list[str]:
    layers, hidden, heads, batch = SIZES[o.size]
    return ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
            "--seq-length", str(o.seq), "--max-position-embeddings", str(o.seq), "--micro-batch-size", str(batch),
            "--global-batch-size", str(batch), "--train-iters", str(o.iters), "--lr", "3e-4",
            "--lr-decay-style", "constant", "--clip-grad", "1.0", "--weight-decay", "0.01",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "2",
            "--log-interval", str(10**6), "--eval-interval", str(10**6), "--eval-iters", "0",
            "--data-path", data_prefix, "--split", "100,0,0", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(VOCAB - 1), *(["--bf16"] if o.device == "cuda" else [])]


def model_config(o: argparse.Namespace):
    from rapidtrain.models.config import ModelConfig

    layers, hidden, heads, _ = SIZES[o.size]
    return ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, seq_length=o.seq,
                       max_position_embeddings=o.seq, vocab_size=PADDED_VOCAB, hidden_dropout=0.0,
                       attention_dropout=0.0)


def steady_seconds(stamps: list[float], warmup: int) -> float:
    steady = stamps[warmup:]
    return (steady[-1] - steady[0]) / (len(steady) - 1)


def stamp(stamps: list[float], o: argparse.Namespace) -> None:
    """Time at the end of a step. Only the first steady step and the last wait for the GPU: between them the
    host runs ahead as in real training, and the interval still covers all the kernels of those steps."""
    import torch

    if o.device == "cuda" and len(stamps) in (o.warmup, o.iters - 1):
        torch.cuda.synchronize()
    stamps.append(time.perf_counter())
    if o.profile:
        profile_steps(len(stamps), o)


PROFILED_STEPS = 3
_profiler: list = []


def profile_steps(done: int, o: argparse.Namespace) -> None:
    """--profile: record the PROFILED_STEPS steps after the warm-up with torch.profiler and write, per system,
    the device time by kernel and how busy the device was (kernel time over wall time)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if done == o.warmup:
        activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (o.device == "cuda")
        _profiler.append((profile(activities=activities), time.perf_counter()))
        _profiler[0][0].__enter__()
    elif done == o.warmup + PROFILED_STEPS and _profiler:
        if o.device == "cuda":
            torch.cuda.synchronize()
        prof, started = _profiler.pop()
        wall = time.perf_counter() - started
        prof.__exit__(None, None, None)
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e6
        name = o.system.replace(" ", "_") + ("_compile" if o.compile else "")
        table = prof.key_averages().table(sort_by="self_cuda_time_total" if o.device == "cuda"
                                          else "self_cpu_time_total", row_limit=40, max_name_column_width=70)
        summary = (f"{o.system}{' + compile' if o.compile else ''}: {PROFILED_STEPS} steps in {wall * 1e3:.1f} ms "
                   f"wall, kernels {busy * 1e3:.1f} ms ({100 * busy / wall:.1f}% busy), {len(kernels)} kernels")
        Path(o.profile, f"profile_{name}.txt").write_text(summary + "\n\n" + table)
        print(summary, file=sys.stderr, flush=True)


# ---- the three systems (each in its own process) ----

def run_rapidtrain(o: argparse.Namespace, data_prefix: str, extra: list[str]) -> dict:
    from rapidtrain.core.metrics import peak_memory_bytes
    from rapidtrain.pretrain import ENTRY, MegatronPreTrainer
    from rapidtrain.train.engine import Engine

    stamps: list[float] = []

    class Timed(MegatronPreTrainer):
        def train_step(self, micro_batches, stop_requested=False):
            result = super().train_step(micro_batches, stop_requested)
            stamp(stamps, o)
            return result

    engine = Engine(argv=rapidtrain_flags(o, data_prefix) + extra, entry=ENTRY)
    Timed(engine).train()
    return {"seconds": steady_seconds(stamps, o.warmup), "peak_memory": peak_memory_bytes(engine.device)}


def samples(o: argparse.Namespace, data_prefix: str):
    from rapidtrain.data.gpt_dataset import GPTDatasetConfig, build_gpt_datasets

    _, _, _, batch = SIZES[o.size]
    config = GPTDatasetConfig([data_prefix], "100,0,0", o.seq, 1234, VOCAB - 1)
    return build_gpt_datasets(config, [o.iters * batch, 0, 0])[0]


def run_plain_loop(o: argparse.Namespace, data_prefix: str) -> dict:
    """A hand-written loop: the built-in model, fused AdamW, bf16 autocast, clipping, the masked mean loss."""
    import torch

    from rapidtrain.models import build_model

    model = build_model(model_config(o), seed=1234).to(o.device)
    if o.compile:
        for block in model.layers.values():
            block.compile()
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=3e-4, fused=True)
    _, _, _, batch = SIZES[o.size]
    loader = torch.utils.data.DataLoader(samples(o, data_prefix), batch_size=batch, num_workers=2,
                                         pin_memory=o.device == "cuda")
    dtype = torch.bfloat16 if o.device == "cuda" else torch.float32
    stamps: list[float] = []
    # --iters steps, as the other rows run: the dataset holds at least a whole epoch of the corpus.
    for data in itertools.islice(loader, o.iters):
        data = {k: v.to(o.device, non_blocking=True) for k, v in data.items()}
        with torch.autocast(o.device, dtype=dtype, enabled=o.device == "cuda"):
            per_token = model(data["tokens"], position_ids=data["position_ids"], labels=data["labels"])
        mask = data["loss_mask"].float()
        loss = (per_token.float() * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        stamp(stamps, o)
    return {"seconds": steady_seconds(stamps, o.warmup), "peak_memory": peak_memory(o.device)}


def run_hf_trainer(o: argparse.Namespace, data_prefix: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config, Trainer, TrainerCallback, TrainingArguments

    layers, hidden, heads, batch = SIZES[o.size]
    config = GPT2Config(vocab_size=PADDED_VOCAB, n_positions=o.seq, n_embd=hidden, n_layer=layers, n_head=heads,
                        activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")  # GPT2LMHeadModel
    dataset = samples(o, data_prefix)
    stamps: list[float] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamp(stamps, o)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return len(dataset)

        def __getitem__(self, i):
            tokens = torch.as_tensor(dataset[i]["tokens"])
            return {"input_ids": tokens, "labels": tokens}

    with tempfile.TemporaryDirectory() as workdir:
        arguments = TrainingArguments(
            output_dir=workdir, per_device_train_batch_size=batch, max_steps=o.iters, learning_rate=3e-4,
            weight_decay=0.01, max_grad_norm=1.0, bf16=o.device == "cuda", use_cpu=o.device != "cuda",
            report_to=[], logging_steps=10**6, save_strategy="no", dataloader_num_workers=2,
            lr_scheduler_type="constant", disable_tqdm=True, torch_compile=o.compile)
        Trainer(model=model, args=arguments, train_dataset=Tokens(), callbacks=[Stamp()]).train()
    return {"seconds": steady_seconds(stamps, o.warmup), "peak_memory": peak_memory(o.device)}


def peak_memory(device: str) -> int:
    from rapidtrain.core.metrics import peak_memory_bytes

    return peak_memory_bytes(device)


def run_child(o: argparse.Namespace) -> dict:
    data_prefix = o.data_prefix
    if o.system == "rapidtrain":
        return run_rapidtrain(o, data_prefix, (["--torch-compile"] if o.compile else [])
                              + shlex.split(o.rapidtrain_flags))
    if o.system.startswith("memory:"):
        return run_rapidtrain(o, data_prefix, MEMORY_MODES[o.system.removeprefix("memory:")])
    if o.system == "plain loop":
        return run_plain_loop(o, data_prefix)
    return run_hf_trainer(o, data_prefix)


# ---- the driver ----

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child(o: argparse.Namespace, system: str, size: str, compile_: bool, data_prefix: str) -> dict:
    """One measurement in a fresh process; memory modes under torchrun (world size 1, NCCL as in real runs)."""
    args = [__file__, "--child", "--system", system, "--size", size, "--seq", str(o.seq), "--iters", str(o.iters),
            "--warmup", str(o.warmup), "--device", o.device, "--data-prefix", data_prefix,
            *(["--compile"] if compile_ else []), *(["--profile", o.profile] if o.profile else []),
            f"--rapidtrain-flags={o.rapidtrain_flags}"]
    launcher = [sys.executable]
    if system.startswith("memory:") or system == "rapidtrain":
        launcher += ["-m", "torch.distributed.run", "--nproc-per-node=1", f"--master-port={free_port()}"]
    elif os.environ.get("RAPIDTRAIN_BENCH_SMOKE_IN_PROCESS") == "1":  # the smoke tests: see pretrain_throughput.py
        return run_child(parse_args(args[1:]))
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run(launcher + args, capture_output=True, text=True, env=env, cwd=REPO)
    for line in result.stderr.splitlines():
        if " steps in " in line and "% busy" in line:  # --profile's summary
            print("  " + line, file=sys.stderr, flush=True)
    if result.returncode != 0:
        return {"error": (result.stdout[-1500:] + result.stderr[-2500:]).strip()}
    return json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])


def measure_throughput(o: argparse.Namespace, data_prefix: str, peak: float | None) -> list[dict]:
    from rapidtrain.models.counting import count_parameters, model_flops_per_iteration

    rows = []
    for size in o.sizes:
        layers, hidden, heads, batch = SIZES[size]
        o.size = size
        config = model_config(o)
        flops = model_flops_per_iteration(config, batch)
        parameters = count_parameters(config)[0]
        for compile_ in (False, True) if o.compile_modes == "both" else (o.compile_modes == "on",):
            for system in o.systems:
                result = child(o, system, size, compile_, data_prefix)
                label = f"{system} {o.rapidtrain_flags}" if system == "rapidtrain" and o.rapidtrain_flags else system
                row = {"size": size, "parameters": parameters, "system": label, "compile": compile_,
                       "batch": batch, **result}
                if "seconds" in result:
                    row["tokens_per_second"] = batch * o.seq / result["seconds"]
                    row["tflops"] = flops / result["seconds"] / 1e12
                    row["mfu"] = row["tflops"] / peak if peak else None
                rows.append(row)
                print(f"  {size} {label}{' + compile' if compile_ else ''}: "
                      + (f"{row['tokens_per_second']:,.0f} tokens/s" if "seconds" in result
                         else "failed: " + result["error"].splitlines()[-1]), file=sys.stderr, flush=True)
    return rows


def measure_memory(o: argparse.Namespace, data_prefix: str) -> list[dict]:
    rows = []
    o.size = o.memory_size
    for mode in MEMORY_MODES:
        result = child(o, f"memory:{mode}", o.memory_size, False, data_prefix)
        rows.append({"mode": mode, "size": o.memory_size, **result})
        print(f"  memory {mode}: " + (f"{result['peak_memory'] / 2**30:.2f} GiB" if "peak_memory" in result
                                      else "failed"), file=sys.stderr, flush=True)
    return rows


def speed_ratio(row: dict, other: dict | None) -> str:
    return f"{row['tokens_per_second'] / other['tokens_per_second']:.2f}×" if other else "n/a"


def format_tables(rows: list[dict], memory: list[dict], device_name: str, peak: float | None, seq: int) -> str:
    lines = [f"GPU: {device_name}; bf16 autocast, seq {seq}; MFU against "
             + (f"{peak:g} TFLOP/s (dense bf16 peak)" if peak else "no known peak (give --peak-tflops)"),
             "", "| model | system | torch.compile | micro batch | tokens/s | TFLOP/s | MFU | vs plain loop | vs HF |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if "seconds" not in row:
            lines.append(f"| {row['size']} | {row['system']} | {'yes' if row['compile'] else 'no'} | {row['batch']} "
                         f"| failed | | | | |")
            continue
        same = [r for r in rows if r["size"] == row["size"] and r["compile"] == row["compile"] and "seconds" in r]
        plain = next((r for r in same if r["system"] == "plain loop"), None)
        hf = next((r for r in same if r["system"] == "HF Trainer"), None)
        mfu = f"{100 * row['mfu']:.1f}%" if row.get("mfu") else "n/a"
        lines.append(f"| {row['size']} ({row['parameters'] / 1e6:,.0f}M) | {row['system']} | "
                     f"{'yes' if row['compile'] else 'no'} | {row['batch']} | {row['tokens_per_second']:,.0f} | "
                     f"{row['tflops']:.1f} | {mfu} | {speed_ratio(row, plain)} | {speed_ratio(row, hf)} |")
    if memory:
        lines += ["", f"peak GPU memory at world size 1 ({memory[0]['size']}, bf16; max_memory_allocated):",
                  "| mode | peak memory | tokens/s |", "|---|---|---|"]
        for row in memory:
            if "peak_memory" in row:
                lines.append(f"| {row['mode']} | {row['peak_memory'] / 2**30:.2f} GiB | "
                             f"{SIZES[row['size']][3] * seq / row['seconds']:,.0f} |")
            else:
                lines.append(f"| {row['mode']} | failed | |")
        lines.append("At world size 1 FSDP has no data-parallel ranks to shard over (rapidtrain wraps nothing), "
                     "and ZeRO partitions over one rank: the modes differ by their engines' own buffers only.")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["350m", "1.3b"], choices=[s for s in SIZES if s != "tiny"])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=8, help="first steps left out (compilation, warm-up)")
    parser.add_argument("--compile-modes", choices=("both", "on", "off"), default="both")
    parser.add_argument("--memory-size", choices=[s for s in SIZES if s != "tiny"], default="1.3b")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory-per-mode table")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help=f"write each system's torch.profiler table of {PROFILED_STEPS} steady steps to DIR")
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--rapidtrain-flags", default="", metavar="FLAGS",
                        help="more flags for the rapidtrain rows, one string after '=' (e.g. "
                             "--rapidtrain-flags='--zero-1-memory-optimization': DeepSpeed's bf16 weights instead "
                             "of autocast over fp32 ones); the row is named by them")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--smoke-cpu", action="store_true",
                        help="run every system and mode for a few steps of a tiny model on the CPU: checks the "
                             "bench's code paths where no GPU is available; the numbers mean nothing")
    # one measurement, in a child process
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--system", help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    parser.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    parser.add_argument("--data-prefix", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    o = parse_args(argv)
    if o.child:
        print(json.dumps(run_child(o)))
        return 0
    import torch

    from rapidtrain.core.peak_flops import peak_flops

    if o.smoke_cpu:
        o.device, o.sizes, o.memory_size, o.seq, o.iters, o.warmup = "cpu", ["tiny"], "tiny", 64, 4, 1
        o.compile_modes = "off"
    elif not torch.cuda.is_available():
        print("bench/gpu_throughput.py measures a CUDA GPU and none is visible here: nothing was run "
              "(--smoke-cpu checks its code paths on the CPU).")
        return 0
    device_name = torch.cuda.get_device_name() if o.device == "cuda" else "CPU (smoke run)"
    peak = peak_flops(o.device, device_name, "bf16", False, o.peak_tflops).tflops
    with tempfile.TemporaryDirectory() as folder:
        tokens = max(o.iters * max(SIZES[s][3] for s in o.sizes) * o.seq * 2, 1 << 16)
        data_prefix = write_random_corpus(Path(folder), tokens)
        rows = measure_throughput(o, data_prefix, peak)
        memory = [] if o.no_memory else measure_memory(o, data_prefix)
    print(format_tables(rows, memory, device_name, peak, o.seq))
    if o.json:
        Path(o.json).write_text(json.dumps({"device": device_name, "rows": rows, "memory": memory}, indent=2))
    failed = [r for r in rows + memory if "error" in r]
    for row in failed:
        print(f"\n{row.get('system', row.get('mode'))} failed:\n{row['error']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
