"""Write Megatron-DeepSpeed-style checkpoints with real DeepSpeed engines, for the --load tests.

Usage: `python tests/distributed/write_deepspeed_checkpoint.py MODEL.pt ITERATION CONSUMED_SAMPLES KIND=OUT ...`:
MODEL.pt holds the state dict to save in Megatron-DeepSpeed's GPT names (`language_model.embedding.
word_embeddings.weight`, `language_model.encoder.layers.0.self_attention.query_key_value.weight`, ...), its args,
its schedule's state and, optionally, Adam's state by parameter name (`moments`). For each KIND=OUT a module with
exactly those parameters goes through `deepspeed.initialize` (two processes, data parallel 2, gloo on the CPU: ZeRO
cuts each parameter's optimizer state between the two ranks' files) and `engine.save_checkpoint` into OUT, with the
client state Megatron-DeepSpeed adds (args, iteration, checkpoint_version) and the learning-rate scheduler it hands
DeepSpeed.
KIND: `plain` (ZeRO stage 1), `pipeline` (a DeepSpeed PipelineModule laid out as Megatron-DeepSpeed's GPTModelPipe:
a function first, the embedding, a function, the transformer layers, the final norm; DeepSpeed saves one file per
layer), `zero3` (ZeRO stage 3: the weights then live in the partitioned files only) or `universal` (as `plain`, then
DeepSpeed's own ds_to_universal turns OUT/global_stepN into OUT/global_stepN_universal and writes OUT/latest_universal;
the rows past the tokenizer's vocabulary, which the conversion drops, are zeros in the weights and moments saved, so
that loading either folder gives the same model and optimizer). Every kind saves the universal_checkpoint_info
Megatron-DeepSpeed's GPTModel adds (MODEL.pt's `universal_info`), which ds_to_universal requires. The two processes
write them all, paying for DeepSpeed's import once.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def module_with(state: dict[str, torch.Tensor]) -> nn.Module:
    """A module whose named_parameters() are exactly `state`'s names and values."""
    root = nn.Module()
    for name, value in state.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, nn.Parameter(value.clone()))
    return root


class Schedule:
    """Megatron's OptimizerParamScheduler as DeepSpeed sees it: a state_dict it saves beside the module."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def step(self, *args: Any, **kwargs: Any) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = dict(state)


def pipeline_module(state: dict[str, torch.Tensor]) -> nn.Module:
    """GPTModelPipe's layer list over `state`'s tensors, as a DeepSpeed PipelineModule of one stage."""
    from deepspeed.pipe import PipelineModule

    def part(prefix: str) -> nn.Module:
        return module_with({k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)})

    layers = sorted({int(k.split(".")[3]) for k in state if k.startswith("language_model.encoder.layers.")})
    specs: list[Any] = [lambda x: x, part("language_model.embedding."), lambda x: x]
    specs += [part(f"language_model.encoder.layers.{i}.") for i in layers]
    specs.append(part("language_model.encoder.final_norm."))
    return PipelineModule(layers=specs, num_stages=1, loss_fn=lambda output, labels: output.sum())


def set_adam_state(engine: Any, module: nn.Module, moments: dict[str, Any]) -> None:
    """Give the engine's optimizer the Adam state `moments` holds by parameter name (exp_avg, exp_avg_sq, and the
    step count): one step at rate 0 with zero gradients creates the state (weights unchanged: no weight decay in
    this optimizer), then DeepSpeed's own safe_set_full_optimizer_state writes each parameter's part."""
    from deepspeed.utils import safe_set_full_optimizer_state

    for group in engine.optimizer.optimizer.param_groups:
        group["lr"] = 0.0
    loss = sum((param * 0).sum() for param in module.parameters())
    engine.backward(loss)
    engine.step()
    for name, param in module.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            safe_set_full_optimizer_state(param, moments[key][name].clone(), key)
    for state in engine.optimizer.optimizer.state.values():
        state["step"] = torch.tensor(float(moments["step"]))


def without_padding(state: dict[str, Any], info: dict[str, Any]) -> dict[str, Any]:
    """`state` with the rows of its vocabulary parameters past the tokenizer's vocabulary zeroed."""
    vocabulary = set(info.get("vocabulary_parameter_patterns", []))
    rows = info["original_vocab_size"]
    zeroed = {}
    for name, value in state.items():
        if name in vocabulary:
            value = value.clone()
            value[rows:] = 0
        zeroed[name] = value
    return zeroed


def to_universal(step_folder: Path) -> None:
    """DeepSpeed's ds_to_universal on one global_stepN folder, as its command line runs it (one worker each)."""
    from deepspeed.checkpoint.ds_to_universal import main as convert

    convert(argparse.Namespace(input_folder=str(step_folder), output_folder=f"{step_folder}_universal",
                               num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                               inject_missing_state=False))


DATA_PARALLEL = 2


def main(argv: list[str]) -> None:
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as scratch:
        mp.spawn(write, args=(argv, str(Path(scratch) / "store")), nprocs=DATA_PARALLEL)


def write(rank: int, argv: list[str], store: str) -> None:
    """One data-parallel rank's part: every kind's engine, its save, and (rank 0) the universal conversions."""
    import deepspeed

    source, iteration, consumed = Path(argv[0]), int(argv[1]), int(argv[2])
    saved = torch.load(source, weights_only=False)  # written by the test itself
    state, args, scheduler = saved["model"], saved["args"], saved["scheduler"]
    dist.init_process_group("gloo", store=dist.FileStore(store, DATA_PARALLEL), rank=rank,
                            world_size=DATA_PARALLEL)
    for name, value in (("RANK", rank), ("LOCAL_RANK", rank), ("WORLD_SIZE", DATA_PARALLEL)):
        os.environ[name] = str(value)
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_VERSION_VALUE

    info = {"universal_checkpoint_version": UNIVERSAL_CHECKPOINT_VERSION_VALUE, **(saved.get("universal_info") or {})}
    for request in argv[3:]:
        kind, _, out = request.partition("=")
        weights, moments = state, saved.get("moments")
        if kind == "universal":
            weights = without_padding(state, info)
            moments = moments and {key: without_padding(value, info) if isinstance(value, dict) else value
                                   for key, value in moments.items()}
        module = pipeline_module(weights) if kind == "pipeline" else module_with(weights)
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.0)
        config = {"train_batch_size": DATA_PARALLEL, "zero_optimization": {"stage": 3 if kind == "zero3" else 1},
                  "zero_allow_untested_optimizer": True}
        engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=config,
                                          lr_scheduler=Schedule(scheduler))
        if kind in ("plain", "universal") and moments:
            set_adam_state(engine, module, moments)
        engine.global_steps, engine.global_samples = iteration, consumed
        client = {"args": argparse.Namespace(**args), "checkpoint_version": 3.0, "iteration": iteration,
                  "tokens": consumed * args.get("seq_length", 0), "universal_checkpoint_info": info}
        engine.save_checkpoint(out, tag=f"global_step{iteration}", client_state=client)
        engine.destroy()
        dist.barrier()
        if kind == "universal" and rank == 0:
            to_universal(Path(out) / f"global_step{iteration}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
