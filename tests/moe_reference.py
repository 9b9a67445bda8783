"""What an MoE training step's gradients must be, computed in one process from first principles; shared
by the unit tests (one process, gradient accumulation) and the expert-parallel worker (torchrun)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from rapidtrain.models.moe import MoELayer, load_balancing_loss, set_aux_loss_scale
from rapidtrain.train.trainer import Trainer

VOCAB, SEQ, MICRO = 64, 8, 2


def model_flags(micro_batches_per_rank: int, data_parallel: int) -> list[str]:
    """A tiny GPT: dense layer 0, top-2 of 4 experts in layer 1, a strong balancing loss, plain SGD."""
    global_batch = MICRO * micro_batches_per_rank * data_parallel
    return (
        f"--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length {SEQ} --micro-batch-size {MICRO} "
        f"--global-batch-size {global_batch} --hidden-dropout 0 --attention-dropout 0 --num-experts 0 4 "
        "--moe-router-topk 2 --moe-min-capacity 1 --moe-loss-coeff 0.5 --clip-grad 0 --lr 0.1 --optimizer sgd "
        "--sgd-momentum 0 --train-iters 4"
    ).split()


def global_batches(count: int) -> list[dict[str, torch.Tensor]]:
    """`count` micro-batches of a global batch, rank-major (rank r owns a contiguous run of them)."""
    generator = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(count):
        tokens = torch.randint(0, VOCAB, (MICRO, SEQ), generator=generator)
        loss_mask = (torch.rand(MICRO, SEQ, generator=generator) > 0.2).float()
        batches.append({"tokens": tokens, "labels": tokens.roll(-1, dims=1), "loss_mask": loss_mask})
    return batches


class OneStepTrainer(Trainer):
    """The real loop's train_step on hand-made batches: per-token loss normalised over the global batch."""

    def run_forward_step(self, data_iterator: Iterator[dict], model: torch.nn.Module):  # noqa: ANN201
        batch = next(data_iterator)
        per_token = model(batch["tokens"], labels=batch["labels"])
        return per_token, lambda losses: ((losses * batch["loss_mask"]).sum(), batch["loss_mask"].sum())


def reference_gradients(model: torch.nn.Module, batches: list[dict], coeff: float) -> dict[str, torch.Tensor]:
    """d/dθ [Σ masked token loss / all tokens + coeff · mean over micro-batches of Σ_layers balancing loss].

    The balancing loss is built here from the router probabilities of each MoE layer's input; the
    layer's own gradient injector is switched off (scale 0).
    """
    set_aux_loss_scale(model, 0.0)
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    inputs: list[torch.Tensor] = []
    hooks = [layer.register_forward_pre_hook(lambda _m, args: inputs.append(args[0])) for layer in layers]
    tokens = sum(float(b["loss_mask"].sum()) for b in batches)
    total = torch.zeros(())
    try:
        for batch in batches:
            inputs.clear()
            per_token = model(batch["tokens"], labels=batch["labels"])
            total = total + (per_token * batch["loss_mask"]).sum() / tokens
            for layer, hidden in zip(layers, inputs, strict=True):
                probs = F.linear(hidden.reshape(-1, hidden.shape[-1]), layer.router.weight).softmax(-1)
                counts = F.one_hot(probs.topk(layer.topk, dim=-1).indices, layer.num_experts).sum((0, 1))
                total = total + coeff * load_balancing_loss(probs, counts) / len(batches)
        model.zero_grad(set_to_none=True)
        total.backward()
    finally:
        for hook in hooks:
            hook.remove()
        set_aux_loss_scale(model, 1.0)
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole value of a tensor-parallel DTensor (of an expert slice: this rank's slice), else a copy."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach().clone()


def canonical(name: str) -> str:
    """The model's own parameter name, without the DDP and activation-checkpointing wrappers' parts."""
    return name.removeprefix("module.").replace("_checkpoint_wrapped_module.", "")


def capture_step_gradients(runner) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """Fills (at each optimizer step) with the gradients the optimizer is about to apply, by canonical name."""
    seen: dict[str, torch.Tensor] = {}
    names = {id(p): canonical(n) for n, p in runner.module.named_parameters()}
    runner.optimizer.register_step_pre_hook(
        lambda _opt, _args, _kwargs: seen.update({names[id(p)]: full(p.grad) for p in runner.parameters})
    )
    return seen


def relative_gradient_difference(
    seen: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], expert_rank: int = 0
) -> float:
    """‖seen − expected‖ / ‖expected‖ over all gradients; an expert slice is compared with its experts
    [expert_rank · local, (expert_rank + 1) · local) of the full gradient."""
    difference = magnitude = 0.0
    for name, grad in seen.items():
        want = expected[name]
        if want.shape != grad.shape:
            first = expert_rank * grad.shape[0]
            want = want[first : first + grad.shape[0]]
        difference += float((grad - want).double().square().sum())
        magnitude += float(want.double().square().sum())
    return (difference / magnitude) ** 0.5
