"""Every command line Pai-Megatron-Patch's 2025-26 Megatron-Core launch scripts produce (tests/compat/pai_sweep.json:
each script run by bash with a recording torchrun, for every model size of its case block, pretraining and SFT on
idxmap and raw JSON data, and each value of its precision, recompute, offload and parallel switches), changed only in
their paths: `rapidtrain plan` with the scripts' own sizes and world size either plans, saying what each of their
flags does, or stops with exit status 2 naming the flag and why. No traceback, nothing accepted and ignored."""

from __future__ import annotations

import time
import traceback
from collections import Counter, defaultdict

import pytest

from rapidtrain.config.arguments import build_parser
from rapidtrain.config.flag_surface import classify, own_flags_help
from tests.compat.launch_data import Planned, localize, plan
from tests.compat.pai_sweep import family, scripts

SCRIPTS = scripts()


def _plan(script: dict, local_files) -> Planned:
    try:
        return plan(script, localize(script, local_files))
    except Exception:  # noqa: BLE001 - a crash is a finding: the test names it with its traceback
        return Planned(1, traceback.format_exc())


OWN = own_flags_help(build_parser())


def _unnoted(script: dict, result: Planned) -> list[str]:
    flags = {token for token in script["argv"] if token.startswith("--")}
    return sorted(flag for flag in flags if (t := classify(flag, OWN)) is not None and t.status == "no_effect"
                  and flag not in result.output)


# Representative command lines shrunk (launch_data.tiny) and trained 2 iterations: (id, processes, changes). The
# layout keeps what two CPU processes hold: expert parallelism 2 for DeepSeek-V3 (MLA, YaRN, grouped sigmoid routing,
# multi-token prediction), tensor parallelism 2 with sequence parallelism for Qwen3-MoE's SFT on Pai's idxmap.
TINY_RUNS = [
    ("deepseek_v3-mcore_deepseek-A37B-pt-7", 2, {"--tensor-model-parallel-size": "1",
                                               "--pipeline-model-parallel-size": "1",
                                               "--expert-model-parallel-size": "2"}),
    ("qwen3-mcore_qwen3-A3B-sft", 2, {"--pipeline-model-parallel-size": "1"}),
    ("qwen2_5-mcore_qwen-7B-sft", 1, {"--tensor-model-parallel-size": "1", "--pipeline-model-parallel-size": "1"}),
    ("moonlight-mcore_moonlight-A3B-pt", 1, {}),
    # Qwen2-57B-A14B's script: --moe-layer-recompute beside selective recompute, over 2 expert-parallel ranks
    ("qwen2-mcore_qwen2_moe-A14B-pt", 2, {"--expert-model-parallel-size": "2"}),
    ("qwen2_5-mcore_qwen-0.5B-pt-6", 1, {}),  # AC=offload: --cpu-offloading of 1 layer
]


def tiny_argv(script: dict, local_files, changes: dict) -> list[str]:
    from tests.compat.launch_data import groups, pai_sft_idxmap, tiny

    values = dict(groups(script["argv"]))
    extra: dict[str, object] = {"--train-iters": "2", "--padded-vocab-size": "1024", "--save-interval": "100"}
    if "--moe-layer-freq" in values:
        extra["--moe-layer-freq"] = "([1]*4)" if "([1]" in values["--moe-layer-freq"][0] else "([0]*1+[1]*3)"
    if values.get("--train-mode") == ["finetune"] and values.get("--dataset") == ["MMAP"]:
        extra["--data-path"] = pai_sft_idxmap(local_files, 64)
    return tiny(script, local_files, {**extra, **changes})


@pytest.mark.slow
def test_representative_scripts_train_two_iterations(local_files, tmp_path):
    """DeepSeek-V3 (MoE + MLA, 2 expert-parallel ranks), Qwen3-MoE SFT on Pai's idxmap (2 tensor-parallel ranks),
    Qwen2-MoE with --moe-layer-recompute (2 expert-parallel ranks), Qwen2.5 dense SFT on Pai's idxmap, Moonlight (MLA +
    MoE) and Qwen2.5 with activation offloading on one process: each trains 2 iterations."""
    import json
    import subprocess
    import sys

    from tests.compat.run_launch_scripts import results
    from tests.compat.test_launch_runs import log_lines
    from tests.launch import REPO, child_env, torchrun

    by_id = {script["id"]: script for script in SCRIPTS}
    runner = REPO / "tests" / "compat" / "run_launch_scripts.py"
    done: dict = {}
    for processes in (1, 2):
        runs = [{"id": run_id, "entry": "pretrain", "argv": tiny_argv(by_id[run_id], local_files, changes)}
                for run_id, count, changes in TINY_RUNS if count == processes]
        path = tmp_path / f"runs-{processes}.json"
        path.write_text(json.dumps(runs))
        if processes == 1:
            out = subprocess.run([sys.executable, str(runner), str(path)], capture_output=True, text=True,
                                 env=child_env(), cwd=REPO, timeout=600).stdout
        else:
            launched = torchrun(2, runner, [str(path)], check=False)
            out = launched.stdout + launched.stderr
        done.update({run["id"]: results(out).get(run["id"], (None, out[-4000:])) for run in runs})
    for run_id, (status, output) in done.items():
        assert status == 0 and len(log_lines(output)) == 2, f"{run_id}: {status}\n{output[-4000:]}"
    assert "expert parallel 2" in done[TINY_RUNS[0][0]][1] and "mtp loss" in done[TINY_RUNS[0][0]][1]
    assert "data 1 × tensor 2" in done[TINY_RUNS[1][0]][1]
    assert "each MoE layer whole" in done["qwen2-mcore_qwen2_moe-A14B-pt"][1]
    assert "activations of the first 1 layer(s)" in done["qwen2_5-mcore_qwen-0.5B-pt-6"][1]
    for run_id in (TINY_RUNS[1][0], TINY_RUNS[2][0]):
        assert "as Pai's SFT idxmap (128 ids a document" in done[run_id][1]


# What stops an argv, and why rapidtrain does not serve it: each refusal line must match one of these.
JUSTIFIED = {
    "vision and multimodal models are not in rapidtrain": "multimodal (Qwen2/2.5/3-VL, Qwen3-Omni, LLaVA): vision "
                                                          "encoders, mrope, image data are not in rapidtrain",
    "--position-embedding-type mrope": "multimodal rope (Qwen-VL)",
    "--dataloader-type external": "the VL scripts' own multimodal loader",
    "MultimodalTokenizer": "LLaVA's tokenizer",
    "encoder-decoder (T5) models": "LLaVA's --decoder-seq-length",
    "Mamba, hybrid, linear-attention": "Qwen3-Next: gated DeltaNet / linear attention layers",
    "FP8 training": "FP8 needs Transformer Engine and FP8 hardware",
    "is not divisible by --pipeline-model-parallel-size": "README layouts (DeepSeek-V2-Lite 27 layers on PP 4, V3 61 "
                                                          "on PP 8) that Megatron refuses too without an uneven split",
    "--global-batch-size 8 is not divisible": "a README layout (DeepSeek-V3: 8 samples over DP 16), refused by "
                                              "Megatron too",
    "--mtp-num-layers 1: with --sequence-parallel": "multi-token prediction beside sequence parallelism",
    "--mtp-num-layers 1: under --pipeline-model-parallel-size": "multi-token prediction with an untied head under PP",
    "Pai-Megatron-Patch's fork's Adam": "Pai's HybridAdam / cpu-adam (a share of the optimizer state on the CPU)",
    "keeps the whole optimizer state on the CPU, not a share": "--optimizer-offload-fraction below 1",
    "(--cpu-offload) moves the optimizer state": "optimizer offload is DeepSpeed's, without TP/PP/EP",
    "--optimizer-offload-policy auto": "Pai's HybridAdam moving state by free memory at run time",
    "--cpu-offloading with --recompute-granularity": "DeepSeek's script keeps selective recompute beside activation "
                                                     "offloading, which Megatron-Core refuses too",
    "--attention-backend flash with --reset-attention-mask": "Pai's packed SFT with flash attention (varlen flash)",
    "--dataset LLama-SFT-Raw": "the 2024 llama2 script's kinds, which Pai's own data code no longer builds",
    "finetune with --dataset LLama-Pretrain-Idxmap": "(the same)",
    "finetune with --dataset LLama-SFT-Raw": "(the same)",
    "argument --cpu-offloading-num-layers: expected one argument": "LLaVA's script passes the flag without a value",
}


@pytest.fixture(scope="module")
def planned(local_files):
    started = time.process_time()
    out = {script["id"]: _plan(script, local_files) for script in SCRIPTS}
    print(f"\n{len(out)} plans in {time.process_time() - started:.1f} CPU-s")
    return out


def problem_lines(output: str) -> list[str]:
    return [line.strip() for line in output.splitlines()
            if line.startswith(("  - ", "  --")) or line.startswith("rapidtrain: error")]


def test_every_pai_argv_plans_or_is_refused_naming_the_flag_and_a_justified_reason(planned):
    by_family: dict[str, Counter] = defaultdict(Counter)
    unjustified = {}
    for script in SCRIPTS:
        result = planned[script["id"]]
        assert result.status in (0, 2) and "Traceback" not in result.output, (script["id"], result.output[-3000:])
        by_family[family(script)]["plans" if result.status == 0 else "refused"] += 1
        if result.status == 0:
            assert not _unnoted(script, result), (script["id"], _unnoted(script, result))
            continue
        lines = problem_lines(result.output)
        assert lines and all("--" in line for line in lines), (script["id"], result.output[-2000:])
        wrong = [line for line in lines if not any(words in line for words in JUSTIFIED)]
        if wrong:
            unjustified[script["id"]] = wrong
    print("\n".join(f"{name:12} {dict(counts)}" for name, counts in sorted(by_family.items())))
    assert not unjustified, "\n".join(f"{i}: {lines}" for i, lines in unjustified.items())
    # the text-only families of 2025-26 plan in every branch but those JUSTIFIED names
    for name in ("qwen2_5", "qwen3", "qwq", "mistral", "llama3_1", "moonlight"):
        assert by_family[name]["plans"] > by_family[name]["refused"], (name, by_family[name])


def test_sweep_covers_every_model_size_and_both_sft_data_kinds():
    sizes = {(s["path"], word) for s in SCRIPTS for word in s["args"].split()[1:3]}
    assert ("examples/qwen3/run_mcore_qwen3.sh", "A22B") in sizes and ("examples/qwen2_5/run_mcore_qwen.sh",
                                                                      "72B") in sizes
    kinds = Counter((s["path"], s["env"].get("MP_DATASET_TYPE", "idxmap"), "--train-mode" in s["argv"]
                     and s["argv"][s["argv"].index("--train-mode") + 1]) for s in SCRIPTS)
    assert kinds[("examples/qwen3/run_mcore_qwen3.sh", "idxmap", "finetune")] >= 1
    assert kinds[("examples/qwen3/run_mcore_qwen3.sh", "raw", "finetune")] >= 1
    assert len(SCRIPTS) >= 300 and len({s["path"] for s in SCRIPTS}) == 26
