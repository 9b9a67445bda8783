"""Every bench under bench/ keeps running: each is run as a user runs it (`python bench/X.py`, cwd the repository) at
the smallest sizes its flags allow, and must exit 0 and print its table with numbers that parse. The values are
not checked (they are timings on a shared machine); generation.py and startup.py have smoke tests of their own,
machine.py is the module the others import; moe_layer.py at a tiny shape. The benches that measure each system in a
child process run every system once, in the bench's own process (SMOKE_IN_PROCESS below). The slowest benches run
one part each:
memory.py its state section (ddp and zero-2 in one launch, --one-launch; not --section startup / save,
~100M-parameter models),
parallel_layouts.py layouts 1,1 and 2,2, gpu_throughput.py --smoke-cpu without its memory modes (and its --profile
with one system), head_loss.py at a tiny shape,
pretrain_throughput.py three of its seven rows in fp32 over two interleaved rounds (not the tuned-malloc row nor the
two torch.compile rows, nor bf16),
efficient_training.py two of its rows (a pretraining and a causal-LM fine-tuning one), long_sequence.py at seq 256,
moe_throughput.py one round of two rows (rapidtrain and Hugging Face's Qwen2-MoE loop) at a tiny shape."""

from __future__ import annotations

import math
import re
import subprocess
import sys

from tests.launch import REPO, child_env

NUMBER = r"-?\d[\d,]*(?:\.\d+)?"


# The benches that run each system (row) in a process of its own (pretrain_throughput.py's measure_in_child, which
# moe_throughput.py and long_sequence.py share; efficient_training.py's run_child; gpu_throughput.py's child but for
# the rows it launches under torchrun) run them one after another in the bench's own process here: the subject is
# that each bench runs every system and prints its table, and a child per system paid for an interpreter, torch's
# import and the training stack's again (pretrain_throughput's three systems: 22.6 CPU-s with children, 12.8
# without, on the loaded 2-core host).
SMOKE_IN_PROCESS = {"RAPIDTRAIN_BENCH_SMOKE_IN_PROCESS": "1"}


def run_bench(script: str, *flags: str, timeout: int = 300) -> str:
    """The bench's stdout; its exit status must be 0."""
    result = subprocess.run([sys.executable, str(REPO / "bench" / script), *flags], capture_output=True, text=True,
                            cwd=REPO, env=child_env(SMOKE_IN_PROCESS), timeout=timeout)
    assert result.returncode == 0, (f"bench/{script} {' '.join(flags)} exited {result.returncode}:\n"
                                    f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result.stdout


def number(text: str) -> float:
    """A printed number ("1,234", "0.52", "12.5%", "1.02×", "nan" is not one) as a finite float."""
    match = re.fullmatch(rf"\s*({NUMBER})\s*(?:%|×|x|ms|s|MiB|GiB|M)?\s*", text)
    assert match, f"not a number: {text!r}"
    value = float(match.group(1).replace(",", ""))
    assert math.isfinite(value), text
    return value


def lines_after(stdout: str, header: str) -> list[str]:
    """The lines after the one that starts with `header` (stripped), up to the next blank line."""
    lines = stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip().startswith(header)), None)
    assert start is not None, f"no line starting {header!r} in:\n{stdout}"
    rows = []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        rows.append(line)
    return rows


def markdown_rows(stdout: str, header: str) -> list[list[str]]:
    """The cells of a markdown table's body whose header row starts with `header`."""
    body = [line for line in lines_after(stdout, header) if not line.startswith("|---")]
    assert body and all(line.startswith("|") for line in body), stdout
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in body]


def test_async_save_bench_prints_time_lost_for_blocking_and_async():
    stdout = run_bench("async_save.py", "--params-millions", "1", "--steps", "6", "--save-at", "2", "--repeats", "1")
    assert stdout.startswith("CPU: ") and "M parameters; checkpoint" in stdout
    rows = {line.split()[0]: line.split()[1:] for line in lines_after(stdout, "save ")}
    assert set(rows) == {"blocking", "async"}, stdout
    for cells in rows.values():
        assert len(cells) == 6 and [number(cell) for cell in cells], stdout


def test_checkpoint_checksum_bench_prints_crc32_beside_sha256():
    stdout = run_bench("checkpoint_checksum.py", "--params-millions", "1")
    assert re.search(rf"^checkpoint: {NUMBER} MiB in \d+ files; save_checkpoint \(with manifest\) {NUMBER} s$",
                     stdout, flags=re.M), stdout
    for name in ("crc32", "sha256"):
        assert re.search(rf"^  {name}\s+over all files: {NUMBER} s \({NUMBER} MiB/s, {NUMBER}% of the save\)$",
                         stdout, flags=re.M), stdout
    assert re.search(rf"verify_checkpoint .*: {NUMBER} s$", stdout, flags=re.M), stdout


def test_dynamic_shape_bench_prints_fixed_beside_dynamic():
    stdout = run_bench("dynamic_shape.py", "--seq-length", "64", "--num-samples", "16", "--micro-batch-size", "4",
                       "--log-mean", "3", "--hidden-size", "32", "--num-layers", "1", "--num-heads", "2",
                       "--vocab-size", "64", "--window-steps", "4", "--warmup-steps", "1", "--device", "cpu")
    rows = {line[:24].strip(): line[24:].split() for line in lines_after(stdout, "fixed")}
    assert list(rows) == ["padded-token fraction", "step time (ms)", "epoch time (s)", "steps", "mean batch width"]
    for label, cells in rows.items():
        assert len(cells) == (2 if label in ("padded-token fraction", "steps") else 3), stdout
        assert [number(cell) for cell in cells]
    assert number(rows["steps"][0]) == number(rows["steps"][1]) == 4  # both sides saw the same 16 samples


def test_matmul_peak_bench_prints_each_dtype():
    stdout = run_bench("matmul_peak.py", "--device", "cpu", "--size", "64", "--dtypes", "fp32", "bf16",
                       "--min-seconds", "0.01", "--repeats", "1")
    assert stdout.startswith("matmul peak, 64x64 @ 64x64 on cpu"), stdout
    rows = dict(line.split(":") for line in lines_after(stdout, "matmul peak"))
    assert set(map(str.strip, rows)) == {"fp32", "bf16"}, stdout
    assert all(number(value.removesuffix("GFLOP/s")) > 0 for value in rows.values())


def test_preprocess_bench_prints_throughput_per_worker_count():
    stdout = run_bench("preprocess.py", "--documents", "300", "--workers", "1", "2")
    assert re.search(r"^corpus: 300 documents, .* tokenizer GPT2BPETokenizer", stdout, flags=re.M), stdout
    rows = [line.split("|") for line in lines_after(stdout, "workers |") if "|" in line]
    assert [int(cells[0]) for cells in rows] == [1, 2], stdout
    assert all(len(cells) == 6 and [number(cell) for cell in cells] for cells in rows), stdout
    assert ".bin/.idx byte-identical across worker counts: True" in stdout


def test_moe_bench_prints_dense_beside_moe_rows(demo_data):
    stdout = run_bench("moe.py", "--iters", "11", "--warmup", "1", "--layers", "1", "--hidden", "32", "--heads", "2",
                       "--seq", "16", "--micro-batch", "2", "--experts", "2", "--eval-iters", "1")
    rows = markdown_rows(stdout, "| model | total params | active params | tokens/s |")
    assert [row[0] for row in rows] == ["dense", "MoE top-1 of 2", "MoE top-2 of 2, ffn 64"], stdout
    for row in rows:
        assert len(row) == 7 and [number(cell) for cell in row[1:6]], stdout
        assert row[6] == "–" if row[0] == "dense" else number(row[6]) >= 0
    assert stdout.count("expert load over training") == 2 and "expert  1 " in stdout  # one MoE layer per MoE row


def test_memory_bench_state_section_prints_measured_beside_formula():
    stdout = run_bench("memory.py", "--modes", "ddp", "zero-2", "--world-sizes", "2", "--precision", "fp32",
                       "--steps", "2", "--one-launch")
    rows = markdown_rows(stdout, "| mode | ranks | parameters | gradients | optimizer state |")
    assert [(row[0], row[1]) for row in rows] == [("ddp", "2"), ("zero-2", "2")], stdout  # torch and DeepSpeed
    for row in rows:
        for cell in row[2:5]:
            assert re.fullmatch(rf"\s*{NUMBER} /\s+{NUMBER} \({NUMBER}\)( \(CPU\))?", cell), stdout
        assert number(row[5]) > 0 and number(row[6]) > 0, stdout


def test_parallel_layouts_bench_prints_each_layout_it_ran():
    stdout = run_bench("parallel_layouts.py", "--steps", "1", "--layouts", "1,1", "2,2")
    rows = markdown_rows(stdout, "| TP × PP (DP) |")
    assert [row[0] for row in rows] == ["(1,1) (4)", "(2,2) (1)"], stdout
    assert all(len(row) == 6 and [number(cell) for cell in row[1:]] for row in rows), stdout


def test_gpu_throughput_bench_smoke_cpu_runs_every_system_and_writes_its_profiles(tmp_path):
    """One launch (each system is a child process that imports torch and Transformers): the table, and with
    --profile each system's profiler table."""
    stdout = run_bench("gpu_throughput.py", "--smoke-cpu", "--no-memory", "--profile", str(tmp_path))
    rows = markdown_rows(stdout, "| model | system | torch.compile |")
    assert [row[1] for row in rows] == ["rapidtrain", "plain loop", "HF Trainer"], stdout
    assert all(len(row) == 9 and [number(row[i]) for i in (3, 4, 5, 7, 8)] for row in rows), stdout
    table = (tmp_path / "profile_plain_loop.txt").read_text()
    assert table.startswith("plain loop: 3 steps in ") and "aten::mm" in table, table[:2000]
    assert sorted(path.name for path in tmp_path.glob("profile_*.txt")) == [
        "profile_HF_Trainer.txt", "profile_plain_loop.txt", "profile_rapidtrain.txt"]


def test_head_loss_bench_prints_plain_beside_chunked():
    stdout = run_bench("head_loss.py", "--tokens", "256", "--hidden", "64", "--vocab", "1024", "--device", "cpu",
                       "--dtype", "fp32", "--blocks", "128", "--repeats", "2")
    rows = markdown_rows(stdout, "| path |")
    assert [row[0] for row in rows] == ["plain (fp32 logits)", "chunked, block 1024 (default)", "chunked, block 128"]
    assert all(number(row[1]) > 0 and number(row[3]) > 0 for row in rows), stdout


def test_pretrain_throughput_bench_prints_systems_side_by_side(demo_data):
    """One round (each system is a child process that imports torch, and the HF one Transformers): the table; the
    rounds' rotation is checked on the function that orders them."""
    systems = ["rapidtrain", "plain loop", "HF Trainer"]
    stdout = run_bench("pretrain_throughput.py", "--iters", "3", "--warmup", "1", "--layers", "1", "--hidden", "32",
                       "--heads", "2", "--seq", "16", "--batch", "1", "--precisions", "fp32", "--rounds", "1",
                       "--dropout", "0.1", "--systems", *systems)
    assert "dropout 0.1;" in stdout, stdout  # every row trains as users do, dropout on
    rows = lines_after(stdout, "precision system")
    assert [(row[:9].strip(), row[10:35].strip()) for row in rows] == [("fp32", system) for system in systems], stdout
    assert all(len(row[35:].split()) == 8 and [number(cell) for cell in row[35:].split()] for row in rows), stdout
    # Each system ran once in its round, in the order round_order gives round 0.
    rounds = re.findall(r"round (\d) fp32 (.+?): [\d.]+ ms/step", stdout)
    assert rounds == [("1", s) for s in systems], stdout
    plain = next(row for row in rows if row[10:35].strip() == "plain loop")
    assert number(plain[35:].split()[4]) == 1.0, stdout  # the plain loop against itself, per round
    assert re.search(r"fp32: matmul peak \d+ GFLOP/s .* GEMMs alone run at \d+ GFLOP/s", stdout), stdout


def test_pretrain_throughput_rounds_rotate_the_systems():
    """Interleaved rounds: each system runs once per round, each round starts one later (A B C, B C A, C A B)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pretrain_throughput", REPO / "bench" / "pretrain_throughput.py")
    assert spec and spec.loader
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    systems = ["rapidtrain", "plain loop", "HF Trainer"]
    assert [bench.round_order(systems, r) for r in range(4)] == [
        systems, systems[1:] + systems[:1], systems[2:] + systems[:2], systems]


def test_efficient_training_bench_prints_each_row_it_ran(demo_data):
    rows = ["recompute-selective", "clm-packed"]
    stdout = run_bench("efficient_training.py", "--only", *rows, "--iters", "7", "--epochs", "1")
    body = [line for line in lines_after(stdout, "technique") if not line.startswith("---")]
    assert [line[:36].strip() for line in body] == ["recompute selective (attention core)",
                                                    "causal LM, padding-free packing"], stdout
    for line in body:
        cells = re.fullmatch(rf".{{75}}\s*({NUMBER})\s+({NUMBER})M\s+({NUMBER})\s+({NUMBER})\s+({NUMBER})  (.+)", line)
        assert cells and [number(cell) for cell in cells.groups()[:5]], line
        assert re.match(r"(loss|dev loss) \d", cells.group(6)), line


def test_moe_layer_bench_prints_grouped_beside_capacity_and_hugging_face():
    stdout = run_bench("moe_layer.py", "--experts", "4", "--topk", "2", "--hidden", "32", "--ffn", "16", "--shared",
                       "16", "--tokens", "64", "--rounds", "2", "--steps", "1")
    rows = lines_after(stdout, "system")
    assert [row[:42].strip() for row in rows] == ["rapidtrain grouped (dropless)",
                                                  "rapidtrain capacity buffers (dropless)",
                                                  "HF Qwen2MoeSparseMoeBlock"], stdout
    assert all(len(row[42:].split()) == 4 and [number(cell) for cell in row[42:].split()] for row in rows), stdout


def test_long_sequence_bench_prints_rapidtrain_beside_hugging_face_sdpa():
    stdout = run_bench("long_sequence.py", "--seq", "256", "--layers", "1", "--hidden", "32", "--heads", "2",
                       "--kv-heads", "1", "--ffn", "64", "--vocab", "128", "--steps", "1", "--rounds", "1")
    rows = lines_after(stdout, "system")
    assert [row[:30].strip() for row in rows] == ["rapidtrain Llama (SDPA)", "HF LlamaForCausalLM (sdpa)"], stdout
    # ms/step, ± %, tokens/s, vs HF, CPU ms/step, vs HF in CPU time, peak MiB, training MiB
    assert all(len(row[30:].split()) == 8 and [number(cell) for cell in row[30:].split()] for row in rows), stdout
    assert number(rows[1][30:].split()[3]) == number(rows[1][30:].split()[5]) == 1.0, stdout  # HF against itself


def test_moe_throughput_bench_prints_rapidtrain_beside_hugging_face_of_the_same_shape(demo_data):
    """One tiny round of the MoE bench: rapidtrain's product against Hugging Face's Qwen2-MoE in a torch loop (the
    bench itself stops when the two models' parameter counts differ)."""
    systems = ["rapidtrain", "HF loop"]
    stdout = run_bench("moe_throughput.py", "--rounds", "1", "--iters", "4", "--warmup", "1", "--layers", "1",
                       "--hidden", "32", "--heads", "2", "--seq", "16", "--batch", "1", "--experts", "4", "--topk", "2",
                       "--expert-ffn", "16", "--shared-ffn", "32", "--threads", "1", "--shapes", "qwen2_moe",
                       "--systems", *systems)
    rows = lines_after(stdout, "shape")
    assert [(row[:10].strip(), row[11:34].strip()) for row in rows] == [("qwen2_moe", s) for s in systems], stdout
    cells = [row[35:].split() for row in rows]
    assert all(len(row) == 9 and [number(cell) for cell in row] for row in cells), stdout
    assert number(cells[1][3]) == 1.0, stdout  # the only peer against itself
    assert cells[0][-1] == cells[1][-1], stdout  # the same parameter count


def test_step_profile_bench_prints_the_phases_and_the_top_operators(demo_data):
    """bench/step_profile.py at the tiniest shape: each phase of the steady steps (forward, backward, clip +
    optimizer, the rest, the whole step) with its time, and the profiled steps' top operators."""
    stdout = run_bench("step_profile.py", "--precision", "fp32", "--layers", "1", "--hidden", "32", "--heads", "2",
                       "--seq", "32", "--batch", "2", "--iters", "5", "--warmup", "1", "--profile-steps", "1",
                       "--top", "5")
    rows = [line.split() for line in lines_after(stdout, "phase")]
    assert [row[0] for row in rows] == ["forward", "backward", "clip+optimizer", "rest", "step"], stdout
    step = {row[0]: number(row[1]) for row in rows}
    assert step["step"] > 0 and step["forward"] > 0 and step["backward"] > 0, stdout
    operators = lines_after(stdout, "operator")
    assert len(operators) == 6 and operators[-1].startswith("all operators"), stdout
