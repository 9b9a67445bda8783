"""Published training runs (published_runs.json) as the step-time model's inputs, with what each measured: the
references config/estimate.py's constants are fitted to, and the test that reports how far each lies from its
estimate (tests/unit/test_published_runs.py). Read only by tests and scripts/calibrate_step_model.py: `rapidtrain
plan` names the references in its assumptions without loading them."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rapidtrain.config.estimate import StepInputs, estimate_step
from rapidtrain.config.settings import Layout, RecomputeSettings
from rapidtrain.core.devices import DeviceSpec, device_spec
from rapidtrain.models.config import ModelConfig
from rapidtrain.models.counting import count_parameters, model_flops_per_iteration

RUNS_FILE = Path(__file__).with_name("published_runs.json")
# Megatron's mixed-precision model states per parameter: 16-bit weight and gradient, fp32 master weight, two fp32
# Adam moments and the fp32 gradient the optimizer steps (what the optimizer step reads and writes).
MIXED_PRECISION_STATE_BYTES = 18


@dataclass(frozen=True)
class PublishedRun:
    name: str
    source: str
    inputs: StepInputs
    device: DeviceSpec
    measured_seconds: float  # per iteration, as published or from the published TFLOP/s and the source's FLOP count
    assumed: tuple[str, ...]
    fitted: bool  # among the runs estimate.py's constants are fitted to; False: held out, a check of the fit

    def estimated_seconds(self) -> float:
        return estimate_step(self.inputs, self.device).seconds_per_iteration

    def error(self) -> float:
        """(estimate - measured) / measured: positive when the estimate is slower than the run was."""
        return self.estimated_seconds() / self.measured_seconds - 1


def megatron_hardware_flops(model: ModelConfig, global_batch: int) -> float:
    """Narayanan et al. 2021's equation 3 (full recomputation included), the count Megatron-LM and
    Megatron-DeepSpeed log TFLOP/s by: 96·B·s·l·h²·(1 + s/6h + V/16lh)."""
    b, s, layers, h, vocab = global_batch, model.seq_length, model.num_layers, model.hidden_size, model.vocab_size
    return 96 * b * s * layers * h**2 * (1 + s / (6 * h) + vocab / (16 * layers * h))


def model_of(shape: dict[str, Any], attention: str) -> ModelConfig:
    llama = bool(shape.get("swiglu"))
    dropout = 0.0 if llama else 0.1  # Llama trains without dropout; GPT-3-style runs with Megatron's 0.1
    return ModelConfig(num_layers=shape["layers"], hidden_size=shape["hidden"], num_attention_heads=shape["heads"],
                       ffn_hidden_size=shape.get("ffn"), seq_length=shape["seq"], max_position_embeddings=shape["seq"],
                       vocab_size=shape["vocab"], num_query_groups=shape.get("query_groups"), swiglu=llama,
                       normalization="RMSNorm" if llama else "LayerNorm",
                       position_embedding_type="rope" if llama else "learned_absolute", tie_embeddings=not llama,
                       add_bias_linear=not llama, hidden_dropout=dropout, attention_dropout=dropout,
                       attention_kernel=attention)  # type: ignore[arg-type]


def run_of(entry: dict[str, Any]) -> PublishedRun:
    model = model_of(entry["model"], entry["attention"])
    shape, batch, gpus = entry["layout"], entry["batch"], entry["gpus"]
    tp, pp, cp = shape["tp"], shape["pp"], shape.get("cp", 1)
    dp = gpus // (tp * pp * cp)
    layout = Layout(gpus, dp, tp, pp, virtual_pipeline_stages=shape.get("v", 1),
                    sequence_parallel=shape.get("sp", False),
                    context_parallel_size=cp, cp_comm_type=shape.get("cp_comm", "p2p"))
    micro_batches = batch["global"] // (dp * batch["micro"])
    params = count_parameters(model)[0] / (tp * pp)
    inputs = StepInputs(model, layout, batch["micro"], micro_batches, batch["global"], entry["dtype"],
                        RecomputeSettings(entry["recompute"]), "none", params, 2, params * MIXED_PRECISION_STATE_BYTES)
    device = device_spec(entry["device"])
    assert device is not None, entry["device"]
    if "inter_node_gb_per_s" in entry:  # the cluster's own network (BLOOM's Omni-Path)
        device = dataclasses.replace(device, inter_node_gb_per_s=entry["inter_node_gb_per_s"])
    measured = entry["measured"]
    if "seconds_per_iteration" in measured:
        seconds = measured["seconds_per_iteration"]
    else:
        count = megatron_hardware_flops if measured["flops"] == "megatron_hardware" else model_flops_per_iteration
        seconds = count(model, batch["global"]) / (measured["tflops_per_gpu"] * 1e12 * gpus)
    return PublishedRun(entry["name"], entry["source"], inputs, device, seconds, tuple(entry["assumed"]),
                        entry.get("fitted", True))


def published_runs() -> list[PublishedRun]:
    return [run_of(entry) for entry in json.loads(RUNS_FILE.read_text())["runs"]]
