"""--torch-compile-backend and --torch-compile-mode reach torch.compile: the plan names them, and a registered
backend that counts its calls is the one that compiles the model's blocks."""

from __future__ import annotations

import torch
import torch._dynamo

from rapidtrain.config import arguments, rules
from rapidtrain.config.plan import from_args
from rapidtrain.config.settings import RunContext
from rapidtrain.models import build_model
from rapidtrain.models.config import ModelConfig
from rapidtrain.parallel.transforms import apply_graph_optimization, transformer_blocks

COMPILED_GRAPHS: list[torch.fx.GraphModule] = []


@torch._dynamo.register_backend(name="rapidtrain_counting_test_backend")
def counting_backend(graph: torch.fx.GraphModule, example_inputs):
    """Records each graph dynamo hands it and runs it as captured (eager)."""
    COMPILED_GRAPHS.append(graph)
    return graph.forward


def plan_for(flags: list[str]):
    args = arguments.parse_args(["--train-iters", "10", "--lr", "1e-4", *flags])
    ctx = RunContext(1, "cpu")
    rules.validate(args, ctx)
    return from_args(args, ctx)


def test_plan_names_backend_and_mode():
    plan = plan_for(["--torch-compile", "--torch-compile-mode", "max-autotune"])
    assert plan.engine_for("--torch-compile").engine == (
        "torch.compile(backend='inductor', mode='max-autotune') per transformer layer")
    assert (plan.switches.compile_backend, plan.switches.compile_mode) == ("inductor", "max-autotune")
    assert plan_for(["--torch-compile"]).engine_for("--torch-compile").engine.startswith(
        "torch.compile(backend='inductor', mode='default')")


def test_the_chosen_backend_compiles_every_block():
    torch._dynamo.reset()
    COMPILED_GRAPHS.clear()
    plan = plan_for(["--torch-compile", "--torch-compile-backend", "rapidtrain_counting_test_backend"])
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=128,
                         hidden_dropout=0.0, attention_dropout=0.0)
    model = apply_graph_optimization(build_model(config, seed=1), plan.switches)
    reference = build_model(config, seed=1)
    tokens = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(model(tokens), reference(tokens), atol=1e-6)
    # Each block is compiled, by the counting backend (dynamo may hand it one graph that both identical blocks
    # share, their parameters being graph inputs).
    blocks = transformer_blocks(model)
    assert len(blocks) == 2 and all(block._compiled_call_impl is not None for block in blocks)
    assert 1 <= len(COMPILED_GRAPHS) <= len(blocks)
    calls = len(COMPILED_GRAPHS)
    torch._dynamo.reset()
    other = plan_for(["--torch-compile", "--torch-compile-backend", "aot_eager"])
    model = apply_graph_optimization(build_model(config, seed=1), other.switches)
    model(tokens)
    assert len(COMPILED_GRAPHS) == calls  # another backend compiled this time, not the counting one
