"""Megatron-LM's own functional-test configurations (tests/compat/functional_test_configs.json: every training
tests/functional_tests/test_cases/**/model_config.yaml of 2026-08-22, and the four of 2025-07-01 that pass a flag none
of those does, gathered by scripts/make_functional_test_configs.py), changed only in their paths: `rapidtrain plan`
at the world size of their CI recipe either plans each one, saying what each of its no-effect flags does here, or
stops with exit status 2 and one message naming the flags; never a traceback. The refusals are the justified set
below: features rapidtrain does not build, each named by its flag. Planning all 267 costs some 8 CPU-s (the local
files, shared with test_launch_scripts.py, some 6 more)."""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from pathlib import Path

import pytest

from rapidtrain.config.arguments import build_parser
from rapidtrain.config.flag_surface import classify, own_flags_help
from tests.compat.launch_data import localize, plan

CONFIGS: list[dict] = json.loads(Path(__file__).with_name("functional_test_configs.json").read_text())
# Placeholders the CI's environment fills with values, not paths (launch_data.localize fills the paths).
ENVIRONMENT = {"REPEAT": "1", "TOKENIZER_TYPE": "HuggingFaceTokenizer"}
# Megatron's entry programs of model families rapidtrain does not build: their configurations must stop on a flag of
# that family, never plan as a GPT.
NOT_BUILT = {"pretrain_t5.py": "T5", "pretrain_hybrid.py": "Mamba/hybrid", "pretrain_hybrid_flex.py": "Flextron",
             "pretrain_vlm.py": "LLaVA", "train.py": "MIMO (multimodal)"}

# Why a configuration may stop: a feature rapidtrain does not have, as its refusal line says it (each line of a
# refusal must match one). Each reason is listed with the families of configurations that meet it.
JUSTIFIED = {
    "T5 (encoder-decoder)": r"encoder-decoder \(T5\) models are not in rapidtrain|T5's sentinel tokens",
    "Mamba/hybrid, linear and sparse attention": r"Mamba, hybrid, linear-attention and sparse-attention layers",
    "vision and multimodal models": r"vision and multimodal models are not in rapidtrain|"
                                    r"unknown flag --use-packed-sequence|"  # pretrain_vlm.py's own flag
                                    r"--model-provider: invalid choice: 'llava_vlm'",  # MIMO's train.py
    "Flextron elastic training": r"elastic \(Flextron\) training|--lr-mult-router",
    "FP8 (Transformer Engine, FP8 hardware)": r"FP8 training",
    "expert tensor parallelism": r"--expert-tensor-parallel-size \d+: experts are not split by tensor parallelism",
    "global_aux_loss router": r"--moe-router-load-balancing-type global_aux_loss",
    "muP": r"--(use-mup|mup-base-hidden-size)",
    "gated attention output": r"--attention-output-gate",
    "weight decay on QK norms": r"--apply-wd-to-qk-layernorm",
    "fill-in-the-middle data": r"--fim-data",
    "activation offloading": r"activation offloading is not in rapidtrain",
    "hierarchical context parallelism": r"--hierarchical-context-parallel-sizes",
    "no position encoding": r"--position-embedding-type none",
    "Megatron's SFT data and tokenizer": r"--sft|--tokenizer-type SFTTokenizer",
    "MTP options beyond depth and loss scale": r"--mtp-use-repeated-layer",
    "latent MoE (Nemotron 3 Super)": r"--moe-latent-size",
    # Layouts rapidtrain's engines do not run (each a rule of config/rules_*.py, naming the flags):
    "MTP beside sequence parallelism": r"--mtp-num-layers \d+: with --sequence-parallel",
    "BERT's sentence-order head under pipelining": r"--pipeline-model-parallel-size \d+ with --bert-binary-head",
    "full FSDP beside tensor/pipeline parallelism": r"cannot be combined with --fsdp-memory-optimization",
}


PLANNED = 186  # configurations that plan


def _script(config: dict) -> dict:
    """A configuration in launch_data's script form: torchrun on the recipe's nodes × GPUs."""
    argv = [re.sub(r"\{(\w+)\}", lambda m: ENVIRONMENT.get(m.group(1), m.group(0)), token) for token in config["argv"]]
    return {"id": config["id"].replace("/", "_"), "argv": argv, "launcher": "torchrun",
            "launcher_argv": ["--nproc_per_node", str(config["gpus_per_node"]), "--nnodes", str(config["nodes"])],
            "entry": config["entry"], "deepspeed_config": None}


def refusal_lines(output: str) -> list[str]:
    """Each problem of a refusal: the rules' `  - ...` lines, the flag surface's `  --flag ...` lines, or argparse's
    one line."""
    lines = [m.group(1) for line in output.splitlines() if (m := re.match(r"\s+(?:- )?(--.*|\d.*)", line))]
    return lines or [line for line in output.splitlines() if "error:" in line][:1]


def reasons_of(lines: list[str]) -> list[str | None]:
    return [next((name for name, pattern in JUSTIFIED.items() if re.search(pattern, line)), None) for line in lines]


@pytest.fixture(scope="module")
def planned(local_files):
    seen: dict[tuple, object] = {}
    out = {}
    started = time.process_time()
    for config in CONFIGS:
        key = (config["entry"], config["nodes"] * config["gpus_per_node"], tuple(config["argv"]))
        if key not in seen:
            script = _script(config)
            seen[key] = plan(script, localize(script, local_files))
        out[config["id"]] = seen[key]
    counts = Counter("plans" if r.status == 0 else reason or "unjustified" for r in out.values()
                     for reason in ([None] if r.status == 0 else set(reasons_of(refusal_lines(r.output)))))
    print(f"\n{len(out)} configurations planned in {time.process_time() - started:.1f} CPU-s; configurations per "
          "outcome (a refused one under each of its reasons):")
    print("\n".join(f"{n:4d}  {what}" for what, n in counts.most_common()))
    return out


OWN = own_flags_help(build_parser())


def _no_effect(flag: str) -> bool:
    treatment = classify(flag, OWN)
    return treatment is not None and treatment.status == "no_effect"


def test_the_data_holds_every_training_configuration_of_megatron_lm():
    families = Counter(config["id"].split("/")[0] for config in CONFIGS)
    assert len(CONFIGS) >= 250 and {"gpt", "moe", "mixtral", "bert", "t5", "hybrid"} <= set(families)
    assert all(config["argv"] and config["commit"] for config in CONFIGS)


@pytest.mark.parametrize("config_id", [config["id"] for config in CONFIGS])
def test_each_configuration_plans_or_names_the_flag_rapidtrain_lacks(planned, config_id):
    config = next(c for c in CONFIGS if c["id"] == config_id)
    result = planned[config_id]
    assert "Traceback" not in result.output and result.status in (0, 2), result.output[-3000:]
    if result.status == 2:
        lines = refusal_lines(result.output)
        unjustified = [line for line, reason in zip(lines, reasons_of(lines), strict=True) if reason is None]
        assert lines and not unjustified, f"refusals outside the justified set: {unjustified}"
        assert all("--" in line for line in lines), lines
        return
    assert config["entry"] not in NOT_BUILT, f"a {NOT_BUILT[config['entry']]} configuration planned as a GPT"
    unnoted = [flag for flag in {t for t in config["argv"] if t.startswith("--")}
               if _no_effect(flag) and flag not in result.output]
    assert not unnoted, f"flags with no effect that the plan does not mention: {unnoted}"


def test_every_justified_reason_still_stops_a_configuration(planned):
    """The justified set stays tight: each reason is one that some configuration still meets; and no configuration
    that plans today stops on one of them tomorrow unnoticed (PLANNED; 147 of the 263 of 2026 planned before the
    sweep's fixes)."""
    assert sum(result.status == 0 for result in planned.values()) >= PLANNED
    met = {reason for r in planned.values() if r.status == 2 for reason in reasons_of(refusal_lines(r.output))}
    assert set(JUSTIFIED) - met == set()
