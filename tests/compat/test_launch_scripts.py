"""Real launch scripts of the Megatron family (tests/compat/launch_scripts.json: Megatron-LM 2020-2026, Microsoft's
and BigScience's Megatron-DeepSpeed, BigScience's training runs, DeepSpeedExamples, Pai-Megatron-Patch,
Megatron-LLaMA, EasyNLP's Rapidformer examples), changed only in their paths: `rapidtrain plan` with their
original sizes and world size either plans them, saying what each of their flags does here, or stops with exit
status 2 naming what rapidtrain does not do."""

from __future__ import annotations

from collections import Counter

import pytest

from rapidtrain.config.arguments import build_parser
from rapidtrain.config.flag_surface import classify, own_flags_help
from tests.compat.launch_data import BY_ID, SCRIPTS, localize, plan

# The scripts that do not plan, and what their message must name: a feature rapidtrain lacks, or a mistake of the
# script that Megatron's own parser or checks stop too.
REFUSED = {
    "mlm-bert-mp-2020": ["--pipeline-model-parallel-size 2 with --bert-binary-head"],
    "mlm-bert-340m-2024": ["--num-layers 24 is not divisible by --pipeline-model-parallel-size 16"],  # as Megatron
    "mlm-bert-340m-2026": ["--num-layers 24 is not divisible by --pipeline-model-parallel-size 16"],
    "mlm-llama3-8b-fp8-2025": ["--fp8-format hybrid"],
    "mlm-llama3-8b-fp8-2026": ["--fp8-format hybrid"],
    "mlm-gptoss-2026": ["--fp8-format hybrid"],  # gpt-oss itself plans now: only FP8 stops it (a GPU's)
    "ez-rf-gpt-moe-ft-2022": ["--tokenizer-type ChineseBPETokenizer"],
    # MLA, YaRN and DeepSeek's MoE plan now: what stops it is its 61 layers over 8 stages (issue 42's uneven split)
    "pai-deepseekv3-2025": ["--num-layers 61 is not divisible by --pipeline-model-parallel-size 8"],
    "bmds-gpt-cl-2021": ["argument --lr-decay-tokens: expected one argument"],  # its shell arithmetic fails
    "bsw-tr1-13b-2021": ["of the batch schedule are not divisible by --micro-batch-size 1 × data-parallel size"],
    "dse-gpt2-mp-2020": ["--global-batch-size 16 is not divisible"],  # its DeepSpeed config's 16 vs 8 × DP 8
    "dse-zero-offload-10b-2020": ["needs --vocab-file"],
    "dse-zero2-2020": ["--global-batch-size 16 is not divisible"],  # its DeepSpeed config's 16 vs 8 × DP 4
    # its --zero-reduce-bucket-size 5e7 against its DeepSpeed config's 1e7 (the run stops on it; the plan now too)
    "dse-zero3-2021": ["zero_optimization.reduce_bucket_size: --deepspeed_config 10000000.0, the flags 50000000 "
                       "(--zero-reduce-bucket-size)"],
    "mds-prmoe-2022": ["is not divisible by --expert-model-parallel-size 64"],
    "mds-bert-pile-2022": ["--micro-batch-size must be at least 1"],  # its shell arithmetic gives -512
    # --data-path of alpaca JSON with no --dataset (Pai's 2023 JSON reader, Megatron-DeepSpeed's finetune_llama.py):
    # indexed data is what --data-path names here, so the plan says how to make it or read the JSON raw
    "pai-llama-pretrain-2023": ["a JSON file, not Megatron indexed data", "--dataset LLama-Pretrain-Raw"],
    "mds-finetune-llama-2024": ["a JSON file, not Megatron indexed data", "--dataset LLama-Pretrain-Raw"],
    # 2024-26 scripts (gathered for issue 41): today's models plan; each stops on what is still missing, named
    "mlm-ft-mtp-fp8-2025": ["--fp8-format hybrid"],
    "mlm-ft-mtp-fp8-2026": ["--fp8-format hybrid"],
    # issue 42: context parallelism plans now; hierarchical CP (a2a inside groups, p2p across) does not
    "mlm-ft-cp4-a2a-p2p-2024": ["--hierarchical-context-parallel-sizes"],
    "mlm-ft-cp4-a2a-p2p-2026": ["--hierarchical-context-parallel-sizes"],
    "mlm-gptoss-2026-03": ["--fp8-format hybrid"],
    "mlm-modelopt-dsv2lite-sft-2026": ["--finetune-hf-dataset"],  # issue 43: SFT data
    "mlm-modelopt-qwen3-30b-a3b-sft-2026": ["--finetune-hf-dataset"],
    # their pipeline layout (issue 42) and first-stage size plan now; multi-token prediction beside sequence
    # parallelism or an untied head under PP, and a batch the layout cannot divide, stop them
    "mlm-ft-dsv3-proxy-2025": ["--mtp-num-layers 1: under --pipeline-model-parallel-size the depths sit on the last "
                               "stage"],
    "mlm-ft-dsv3-proxy-2026": ["--mtp-num-layers 1: with --sequence-parallel"],
    "pai-dsv3-mcore-2025-02": ["--global-batch-size 8 is not divisible",
                               "--mtp-num-layers 1: with --sequence-parallel"],
    "mds-fpdt-6.7b-256k-2024": ["--ds-sequence-parallel-fpdt"],  # Ulysses plans; FPDT's chunking does not
    "tt-llama3-debug-hsdp-cp2-fp8-2025": ["--fp8-format e4m3"],
}
# Flags of today's models those scripts pass: none may be among what stops them.
TODAYS_FLAGS = ["--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim",
                "--v-head-dim", "--rotary-scaling-factor", "--mscale", "--mscale-all-dim",
                "--moe-router-score-function", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate",
                "--moe-router-num-groups",
                "--moe-router-group-topk", "--moe-router-topk-scaling-factor", "--moe-shared-expert-intermediate-size",
                "--moe-ffn-hidden-size", "--moe-router-pre-softmax", "--mtp-num-layers", "--mtp-loss-scaling-factor",
                "--softmax-type", "--quick-geglu", "--glu-linear-offset", "--activation-func-clamp-value",
                "--enable-gpt-oss", "--window-size", "--lr-warmup-init", "--lr-wsd-decay-style",
                "--moe-router-force-load-balancing", "--use-multi-token-prediction", "--num-mtp-predictor"]

# Flags these scripts pass that rapidtrain now serves: their refusal messages must no longer name them.
NOT_REFUSED = {
    "mlm-ft-dsv3-proxy-2025": ["--pipeline-model-parallel-layout"],
    "mlm-ft-dsv3-proxy-2026": ["--pipeline-model-parallel-layout"],
    "pai-dsv3-mcore-2025-02": ["--decoder-first-pipeline-num-layers"],
    "tt-llama3-debug-hsdp-cp2-fp8-2025": ["--context-parallel-size", "--cp-comm-type"],
    "mlm-ft-moe-cp2-ep2-2025": ["--context-parallel-size"],
    "mds-fpdt-6.7b-256k-2024": ["--ds-sequence-parallel-size"],
    "mlm-llama3-8b-fp8-2025": ["--decoupled-lr", "--decoupled-min-lr", "--calculate-per-token-loss"],
    "mlm-llama3-8b-fp8-2026": ["--decoupled-lr", "--decoupled-min-lr", "--calculate-per-token-loss"],
}


@pytest.fixture(scope="module")
def planned(local_files):
    return {script["id"]: plan(script, localize(script, local_files)) for script in SCRIPTS}


def test_the_data_holds_forty_and_more_scripts_over_years_and_origins(planned):
    years = Counter(script["date"][:4] for script in SCRIPTS)
    origins = Counter(script["origin"] for script in SCRIPTS)
    assert len(SCRIPTS) >= 40 and len(years) >= 6 and len(origins) >= 7 and set(REFUSED) <= set(BY_ID)
    for origin in sorted(origins):
        ids = [s["id"] for s in SCRIPTS if s["origin"] == origin]
        print(f"{origin}: {sum(planned[i].status == 0 for i in ids)} of {len(ids)} plan")


@pytest.mark.parametrize("script_id", [script["id"] for script in SCRIPTS])
def test_each_script_plans_or_names_what_rapidtrain_lacks(planned, script_id):
    result = planned[script_id]
    if script_id in REFUSED:
        assert result.status == 2, result.output[-2000:]
        assert "Traceback" not in result.output
        missing = [words for words in REFUSED[script_id] if words not in result.output]
        assert not missing, f"{missing} not in:\n{result.output[-3000:]}"
        named = [flag for flag in NOT_REFUSED.get(script_id, []) + TODAYS_FLAGS
                 if f"  {flag} " in result.output or f"  {flag}:" in result.output]
        assert not named, f"{named} refused:\n{result.output[-3000:]}"
        return
    assert result.status == 0, result.output[-3000:]
    assert "world" in result.output.lower()
    unnoted = [flag for flag in _flags(BY_ID[script_id]) if _no_effect(flag) and flag not in result.output]
    assert not unnoted, f"flags with no effect that the plan does not mention: {unnoted}"


def test_pai_qwen3_plans_with_its_head_size_qk_norms_and_published_parameter_count(planned):
    """Qwen3-30B-A3B: 128-dimension heads (32 × 128 = 4096 ≠ hidden 2048), RMSNorm on q and k per head, 128 experts
    of 768 in all 48 layers, 151936 embedding rows: 30.5B parameters, 3.3B active (Qwen's published 30.5B / 3.3B)."""
    output = planned["pai-qwen3-mcore-2025"].output
    assert "head size 128 (--kv-channels)" in output and "q/k RMSNorm per head (--qk-layernorm)" in output
    assert "routed experts of hidden 768" in output and "padded vocab 151936" in output
    assert "parameters: 30,532,122,624 total, 3,353,032,704 active per token" in output
def test_bloom_and_mistral_attention_is_planned_not_refused(planned):
    """BigScience's BLOOM runs stop only on their vocabulary padding and data-file lists now: ALiBi and the embedding
    LayerNorm plan; Pai's Mistral plans with its 4096-key window (longer than its 128-token samples), and
    gpt-oss's window is no longer among what Megatron-LM's script asks for in vain."""
    for script_id in ("bsw-tr11b-1b3-2022", "bsw-tr11-176b-2022", "bsw-tr13f-6b3-mtf-2022"):
        refusal = planned[script_id].output
        assert "alibi" not in refusal and "--embed-layernorm" not in refusal, refusal[-2000:]
    mistral = planned["pai-mistral-pretrain-2024"].output
    assert "sliding-window attention over the last 4096 keys" in mistral
    assert "the window spans --seq-length 128, so training sees no difference" in mistral
    assert "--window-size" not in planned["mlm-gptoss-2026"].output


def _flags(script: dict) -> set[str]:
    return {token.split("=", 1)[0] for token in script["argv"] if token.startswith("--")}


OWN = own_flags_help(build_parser())


def _no_effect(flag: str) -> bool:
    treatment = classify(flag, OWN)
    return treatment is not None and treatment.status == "no_effect"


def test_bloom_176b_and_zero_bubble_scripts_plan_their_pipelines(planned):
    """BigScience's BLOOM-176B: 70 layers on 12 stages by DeepSpeed's type:transformer|embedding (70 + 2 embeddings =
    12 × 6: the first and last stage hold 5); Megatron-DeepSpeed's ZB-H1 example runs torch's zero-bubble
    schedule; the Megatron-LM scripts' uneven splits are no longer what stops them."""
    for script_id in ("bsw-tr11-176b-2022", "bsw-tr11-176b-2022-03"):
        output = planned[script_id].output
        assert planned[script_id].status == 0, output[-2000:]
        assert "transformer layers per stage 5, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 5" in output
        assert "rank 11: stage 11 layers 65–69 + head (5)" in output
    zero_bubble = planned["mds-zbpp-2024"]
    assert zero_bubble.status == 0, zero_bubble.output[-2000:]
    assert "zero bubble ZB-H1" in zero_bubble.output
