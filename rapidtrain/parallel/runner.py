"""How one wrapped model trains: micro-batches, backward, the optimizer step, state for checkpoints.

Every layout trains through one `TorchRunner` built from parts rather than subclasses: the loss scaler,
the gradient norm over the right groups (`GradNorm`), clipping, the data-parallel wrapper's gradient
sync, and `before_step` reductions (tied pipeline embeddings, expert gradients). Pipeline parallelism
replaces how micro-batches run (`forward_backward`); expert parallelism adds its reduction, its norm
part and its checkpoint transform to whatever runner the layout built. The DeepSpeed engine has its own
runner with the same methods (`parallel/deepspeed.py`).

The step never waits on the host by itself: the loop reduces the iteration's decisions (overflow, a
non-finite loss, a stop request) in one collective and one device-to-host copy (`agree`), then calls
`step(skip)`; the gradient norm stays on the device until a log line reads it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from rapidtrain.config.settings import Precision
from rapidtrain.optim.flat_buffers import FlatAdam
from rapidtrain.optim.grad_scaler import LossScaler
from rapidtrain.optim.lr_schedule import set_group_lr

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class StepOutcome:
    grad_norm: torch.Tensor | None  # on the device; None when the step was skipped
    skipped: bool = False  # fp16 overflow: no update, the schedule does not advance


@dataclass
class LossTotal:
    """One iteration's loss before the data-parallel reduction: the sum of per-token loss sums (`per_token`),
    or the mean of the micro-batches' mean losses. `reported`: the values a Megatron loss function returned
    for the log line, each a [sum, weight] pair summed over the micro-batches (shown as sum / weight)."""

    value: torch.Tensor  # fp64 scalar on the device
    per_token: bool
    reported: dict[str, torch.Tensor] = field(default_factory=dict)


class LossParts(NamedTuple):
    """A forward step's result: the loss to back-propagate (or a per-token loss sum), the token count (None
    for a mean loss), and the values to report by name (Megatron's loss-function dict)."""

    value: torch.Tensor
    tokens: torch.Tensor | None
    reported: dict[str, torch.Tensor]


class Runner(Protocol):
    """What the loop, the checkpoints and the export need of one wrapped model and its optimizer. Every engine
    implements it: `TorchRunner` (plain, DDP, FSDP2, OSS, pipeline stages, experts), `DeepSpeedRunner`,
    FairScale's runner; mypy checks each against it where `parallelize` returns them."""

    module: nn.Module
    optimizer: Any  # a torch optimizer, DeepSpeed's ZeRO optimizer or ZeroRedundancyOptimizer: param_groups, step
    precision: Precision
    device_type: str
    gradient_average: int

    def micro_batch(self, is_last: bool) -> contextlib.AbstractContextManager[None]: ...

    def forward_backward(self, micro_batches: list[Any], forward_step: Callable,
                         global_tokens: torch.Tensor | int | None) -> LossTotal: ...

    def evaluate(self, micro_batches: list[Any], forward_step: Callable) -> EvalTotals: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def unscale_gradients(self) -> torch.Tensor | None: ...

    def step(self, skip: bool = False) -> StepOutcome: ...

    def zero_grad(self) -> None: ...

    def params_norm(self) -> torch.Tensor: ...

    def train(self, mode: bool = True) -> None: ...

    @property
    def skips_nonfinite(self) -> bool: ...

    @property
    def loss_scale(self) -> float: ...

    @property
    def backward_scale(self) -> float: ...

    def state_dict(self) -> dict[str, Any]: ...

    def state_dict_for_loading(self, load_optimizer: bool) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], load_optimizer: bool = True) -> None: ...


def autocast(precision: Precision, device_type: str) -> contextlib.AbstractContextManager:
    if precision.dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=AUTOCAST_DTYPES[precision.dtype])


def ensure_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create missing state as torch's get_state_dict does: one step with zero gradients at rate 0 (whatever
    gradients the parameters hold: get_state_dict skips it when any has one, and saves no state at all)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if all(optimizer.state.get(p) for p in params):
        return
    rates = [float(group["lr"]) for group in optimizer.param_groups]
    grads = [p.grad for p in params]
    for group in optimizer.param_groups:
        set_group_lr(group, 0.0)
    for p in params:
        p.grad = torch.zeros_like(p)
    try:
        optimizer.step()
    finally:
        for group, rate in zip(optimizer.param_groups, rates, strict=True):
            set_group_lr(group, rate)
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad


def agree(flags: Sequence[torch.Tensor | bool], device: torch.device) -> list[bool]:
    """Each flag true on any rank → true everywhere: one all-reduce (MAX over the world) and one
    device-to-host copy, the only wait on the host a training iteration makes. A host flag becomes a device value
    by a fill (`torch.full`), not by copying a host tensor: on CUDA such a copy from pageable memory waits for the
    device (found by tests/gpu's sync probe: two more waits an iteration)."""
    values = torch.stack([f.to(device=device, dtype=torch.float32).reshape(()) if torch.is_tensor(f)
                          else torch.full((), float(f), device=device) for f in flags])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return [v > 0 for v in values.tolist()]


def as_loss(output: Any) -> LossParts:
    """A forward step's result as (loss or loss sum, token count or None, reported values).

    Forms: a loss; `(loss_sum, count)`; `(output, loss_fn)` whose `loss_fn(output)` gives any form; Megatron's
    `(loss, {"lm loss": averaged, ...})` (a mean loss, the dict shown in the log line instead of rapidtrain's
    own reduction); Megatron-Core's `(loss_sum, num_tokens, {"lm loss": tensor([sum, count])})`.
    """
    if isinstance(output, tuple) and len(output) == 2 and callable(output[1]):
        output = output[1](output[0])
    if isinstance(output, tuple):
        if len(output) == 2 and isinstance(output[1], Mapping):
            return LossParts(output[0], None, reported_pairs(output[1]))
        if len(output) == 3 and isinstance(output[2], Mapping):
            return LossParts(output[0], torch.as_tensor(output[1]), reported_pairs(output[2]))
        loss_sum, count = output
        if isinstance(count, torch.Tensor) and count.numel() > 1:
            return _masked_token_losses(loss_sum, count)
        return LossParts(loss_sum, torch.as_tensor(count), {})
    return LossParts(output, None, {})


def _masked_token_losses(losses: torch.Tensor, loss_mask: torch.Tensor) -> LossParts:
    if losses.numel() != loss_mask.numel():
        raise ValueError(f"the forward step returned per-token losses of shape {tuple(losses.shape)} with a loss "
                         f"mask of shape {tuple(loss_mask.shape)}: they must hold one value per token each")
    mask = loss_mask.reshape(-1).to(losses.dtype)
    return LossParts((losses.reshape(-1) * mask).sum(), mask.sum(), {})


def reported_pairs(values: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Each reported value as an fp64 [sum, weight] pair: a scalar v is (v, 1) (Megatron averages those), a
    two-element tensor is Megatron-Core's (sum, count) already."""
    pairs = {}
    for name, value in values.items():
        value = torch.as_tensor(value).detach().double().reshape(-1)
        if value.numel() == 1:
            value = torch.cat([value, torch.ones_like(value)])
        if value.numel() != 2:
            raise ValueError(f"the loss function reported {name!r} with {value.numel()} values: report a number, or "
                             "Megatron-Core's tensor([sum, count])")
        pairs[name] = value
    return pairs


def add_pairs(total: dict[str, torch.Tensor], values: dict[str, torch.Tensor]) -> None:
    """Sum reported [sum, weight] pairs into `total` (on the device, no host read)."""
    for name, pair in values.items():
        total[name] = pair if name not in total else total[name] + pair.to(total[name].device)


# ---- the gradient norm, over the groups the layout splits gradients across ----

def squared_norm(grads: list[torch.Tensor], foreach: bool | None = None) -> torch.Tensor:
    """Sum of squares of all gradients, in fp64: DTensor shards (TP, FSDP) are combined across their mesh.

    torch's fp32 norm kernel on CPU drifts by up to ~1e-4 relative on millions of elements, and differently
    for each way of sharding them, so layouts would log (and clip by) different norms. Plain CPU tensors: fp32
    sums of squares (cascade summation, within ~1e-7 of fp64) added up in fp64, with no fp64 copy of
    the gradients (2.5 ms against 5–24 ms at 14M parameters on CPU). DTensors: fp64 per-shard norms,
    which DTensor combines across the shards.

    CUDA tensors (`foreach` None: decided by the device): one multi-tensor norm per device and dtype, fp32
    accumulators in tree reductions, squared and added in fp64. Each gradient is read once; the per-tensor
    square-then-sum wrote a squared copy of every gradient and launched two kernels per parameter (on an
    H100 at GPT 1.3B: 7 ms of a 200 ms step against 2 ms, tests/gpu and bench/gpu_throughput.py --profile).
    """
    from torch.distributed.tensor import DTensor

    if not grads:
        return torch.zeros((), dtype=torch.float64)
    if any(isinstance(grad, DTensor) for grad in grads):
        norms = torch._foreach_norm(grads, 2.0, dtype=torch.float64)
        norm = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return norm.square()
    if foreach if foreach is not None else grads[0].device.type == "cuda":
        norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)  # each on its gradient's device
        return torch.stack([norm.to(grads[0].device) for norm in norms]).double().square().sum()
    return torch.stack([grad.float().square().sum() for grad in grads]).double().sum()


@dataclass
class GradNorm:
    """The global L2 norm of the gradients the optimizer steps, each counted once.

    `parameters`: replicated or DTensor-sharded ones; `local_parameters` hold different values on the
    ranks of `local_group` (expert slices over the expert-parallel group, or FairScale's owned gradients
    over the data-parallel group), summed over it; pipeline stages are summed over `pipeline_group`.
    """

    parameters: list[nn.Parameter]
    pipeline_group: dist.ProcessGroup | None = None
    local_parameters: list[nn.Parameter] = field(default_factory=list)
    local_group: dist.ProcessGroup | None = None

    def __call__(self, of: Callable[[nn.Parameter], torch.Tensor | None] = lambda p: p.grad) -> torch.Tensor:
        """The norm of each parameter's gradient, or of `of(parameter)` (the parameters themselves for
        --log-params-norm), over the same groups."""
        squared = squared_norm([g for p in self.parameters if (g := of(p)) is not None])
        if self.local_parameters:
            local = squared_norm([_local(g) for p in self.local_parameters if (g := of(p)) is not None])
            local = local.to(squared.device)
            if self.local_group is not None:
                dist.all_reduce(local, group=self.local_group)
            squared = squared + local
        if self.pipeline_group is not None:
            dist.all_reduce(squared, group=self.pipeline_group)
        return squared.sqrt()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def clip_by_norm(parameters: list[nn.Parameter], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale the gradients by max_norm / total_norm where that is below 1: one foreach multiply per DTensor
    mesh, which the multiply cannot span (FSDP2 puts expert slices on the expert_dp mesh, the rest on dp).
    The coefficient is fp32: with the fp64 norm, CUDA's foreach multiply left its fast path for one kernel per
    gradient (seen in an H100 profile: twice the time of the plain loop's clipping)."""
    by_mesh: dict[Any, list[nn.Parameter]] = {}
    for param in parameters:
        by_mesh.setdefault(getattr(param, "device_mesh", None), []).append(param)
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total_norm.float())


# ---- running the micro-batches of one iteration ----

def per_token_scale(gradient_average: int, global_tokens: torch.Tensor | int) -> torch.Tensor | float:
    """What a micro-batch's per-token loss sum is multiplied by before backward: the wrapper's average undone,
    over the global batch's tokens (a host tensor: used, never read)."""
    return gradient_average / global_tokens


def scaled(loss: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """`loss * scale` in the loss's dtype, as a Python float would multiply (a host scalar tensor counts as one
    on any device)."""
    return loss * (scale.to(loss.dtype) if torch.is_tensor(scale) else scale)


def run_micro_batches(runner: Any, micro_batches: list[Any], forward_step: Callable,
                      global_tokens: torch.Tensor | int | None) -> LossTotal:
    """Forward and backward of each micro-batch, gradients synchronised on the last.

    With per-token loss sums and `global_tokens` known, each backward loss is scaled to the exact mean over
    the global batch's tokens (the wrapper averages over `gradient_average` ranks, which is undone here).
    """
    steps = len(micro_batches)
    batches = iter(micro_batches)
    total: torch.Tensor | None = None
    per_token = False
    reported: dict[str, torch.Tensor] = {}
    for index in range(steps):
        with runner.micro_batch(is_last=index == steps - 1):
            loss_sum, count, values = as_loss(forward_step(batches, runner.module))
        per_token = count is not None and global_tokens is not None
        scale = 1.0 / steps if global_tokens is None or not per_token else per_token_scale(runner.gradient_average,
                                                                                             global_tokens)
        runner.backward(scaled(loss_sum, scale))
        contribution = loss_sum.detach().double() * (1.0 if per_token else 1.0 / steps)
        total = contribution if total is None else total + contribution
        add_pairs(reported, values)  # a number weighs one micro-batch: the log shows the interval's mean
    assert total is not None, "an iteration needs at least one micro-batch"
    return LossTotal(total, per_token, reported)


class EvalTotals(NamedTuple):
    """Forward-only results of some micro-batches: the sum of their losses and its weight (tokens, or one per
    micro-batch), and the reported values' [sum, weight] pairs."""

    loss_sum: torch.Tensor
    weight: torch.Tensor
    reported: dict[str, torch.Tensor]


@torch.no_grad()
def evaluate_micro_batches(runner: Any, micro_batches: list[Any], forward_step: Callable) -> EvalTotals:
    """Forward only → the losses' sum and weight and the reported values, on the device."""
    loss_sum = weight = None
    reported: dict[str, torch.Tensor] = {}
    for batch in micro_batches:
        with runner.micro_batch(is_last=True):
            value, count, values = as_loss(forward_step(iter([batch]), runner.module))
        value = value.detach().double()
        count_value = (torch.ones((), dtype=torch.float64, device=value.device) if count is None
                       else count.to(value.device, torch.float64))
        loss_sum = value if loss_sum is None else loss_sum + value
        weight = count_value if weight is None else weight + count_value
        add_pairs(reported, values)
    if loss_sum is None or weight is None:
        return EvalTotals(torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64), {})
    return EvalTotals(loss_sum, weight, reported)


@contextlib.contextmanager
def bucket_views_kept(module: nn.Module) -> Iterator[None]:
    """Around clearing the gradients (set to None): DDP's gradients, views into its buckets, are zeroed in place
    and kept instead. Set to None, the next backward would make new gradients, and on accumulation micro-batches
    (no_sync) they would live beside the buckets until the last one: a second copy of the gradients again. DDP
    gives every parameter it reduces a gradient in each step, so zeros and None step alike; the parameters it
    ignores (expert slices reduced over their own group) are left to be cleared."""
    kept = []
    if isinstance(module, DistributedDataParallel) and module.gradient_as_bucket_view:
        ignored = module.parameters_to_ignore
        kept = [(p, p.grad) for name, p in module.module.named_parameters()
                if name not in ignored and p.grad is not None]
    yield
    for param, grad in kept:
        param.grad = grad.zero_()


# ---- the runner ----

@dataclass
class TorchRunner:
    """A torch-wrapped model (plain, DDP, FSDP2, ZeroRedundancyOptimizer, pipeline stages) and its optimizer.

    `gradient_average` is how many ranks the wrapper averages gradients over (DDP and FSDP divide by the
    data-parallel size), so per-token loss sums can be scaled to the exact global-batch mean.
    """

    module: nn.Module
    optimizer: torch.optim.Optimizer
    precision: Precision
    device_type: str
    clip_grad: float
    gradient_average: int = 1
    pipeline_group: dist.ProcessGroup | None = None
    scaler: LossScaler | None = None
    parameters: list[nn.Parameter] = field(default_factory=list)
    grad_norm: GradNorm | None = None
    # Reductions the layout needs after backward and before unscaling (tied embeddings, expert gradients).
    before_step: list[Callable[[], None]] = field(default_factory=list)
    # (to the saved layout, from it) applied to checkpoint state: expert shards, pipeline names.
    state_transforms: list[tuple[Callable[[dict], dict], Callable[[dict], dict]]] = field(default_factory=list)
    # Run whenever the parameters took new values (an optimizer step, a loaded checkpoint): bf16 copies refreshed.
    after_update: list[Callable[[], None]] = field(default_factory=list)
    # Parameters, gradients and Adam's moments in flat buffers (optim/flat_buffers.py): one process only.
    flat: FlatAdam | None = None

    def __post_init__(self) -> None:
        if not self.parameters:
            self.parameters = [p for p in self.module.parameters() if p.requires_grad]
        if self.grad_norm is None:
            self.grad_norm = GradNorm(self.parameters, self.pipeline_group)
        if self.scaler is not None:  # fp16 headroom independent of the data-parallel size (LossScaler)
            self.scaler.data_parallel_average = self.gradient_average

    # ---- one iteration ----
    @contextlib.contextmanager
    def micro_batch(self, is_last: bool) -> Iterator[None]:
        """Forward/backward of one micro-batch; gradients are synchronised only on the last."""
        with self._gradient_sync(is_last), autocast(self.precision, self.device_type):
            yield

    def forward_backward(self, micro_batches: list[Any], forward_step: Callable,
                         global_tokens: torch.Tensor | int | None) -> LossTotal:
        return run_micro_batches(self, micro_batches, forward_step, global_tokens)

    def evaluate(self, micro_batches: list[Any], forward_step: Callable) -> EvalTotals:
        return evaluate_micro_batches(self, micro_batches, forward_step)

    @property
    def skips_nonfinite(self) -> bool:
        """Under loss scaling an overflow skips the step; otherwise a non-finite loss must stop the run."""
        return self.scaler is not None

    @property
    def loss_scale(self) -> float:
        return self.scaler.loss_scale if self.scaler is not None else 1.0

    @property
    def backward_scale(self) -> float:
        """What `backward` multiplies a loss by (the router losses' gradient must carry the same factor)."""
        return self.scaler.multiplier if self.scaler is not None else 1.0

    def _gradient_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        set_sync = getattr(self.module, "set_requires_gradient_sync", None)
        if set_sync is not None:
            # FSDP2 decides in backward, which the trainer runs after this context (outside autocast):
            # so the flag is set for the whole micro-batch, and the last one turns reduction back on.
            set_sync(enabled)
            return contextlib.nullcontext()
        no_sync = getattr(self.module, "no_sync", None)  # DDP
        if enabled or no_sync is None:
            return contextlib.nullcontext()
        return no_sync()

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def unscale_gradients(self) -> torch.Tensor | None:
        """Finish the gradients (the layout's reductions, then unscaling); this rank's overflow flag on the
        device (None without loss scaling). The loop agrees on it across ranks before `step`."""
        for reduce in self.before_step:
            reduce()
        if self.scaler is None:
            return None
        return self.scaler.unscale(self.parameters)

    def step(self, skip: bool = False) -> StepOutcome:
        """Clip by the global norm and step, or skip (an overflow somewhere); gradients are cleared."""
        if self.scaler is not None:
            self.scaler.update(skip)
        if skip:
            self.zero_grad()
            return StepOutcome(None, skipped=True)
        assert self.grad_norm is not None
        flat = self.flat if self.flat is not None and self.flat.ready() else None
        if flat is not None:  # a few operators over the buffers instead of a few per parameter
            norm = flat.grad_norm()
            if self.clip_grad > 0:
                flat.clip(self.clip_grad, norm)
            flat.step()
        else:
            norm = self.grad_norm()
            if self.clip_grad > 0:
                clip_by_norm([p for p in self.parameters if p.grad is not None], self.clip_grad,
                             norm.to(self._grad_device()))
            self.optimizer.step()
        self.parameters_updated()
        self.zero_grad()
        return StepOutcome(norm)

    def parameters_updated(self) -> None:
        for update in self.after_update:
            update()

    def _grad_device(self) -> torch.device:
        return self.parameters[0].device if self.parameters else torch.device("cpu")

    def params_norm(self) -> torch.Tensor:
        """The L2 norm of the trained parameters (Megatron's --log-params-norm), each counted once."""
        assert self.grad_norm is not None
        return self.grad_norm(lambda p: p.detach())

    def zero_grad(self) -> None:
        with bucket_views_kept(self.module):
            self.clear_gradients()

    def clear_gradients(self) -> None:
        if self.flat is not None:  # zeroed in place: the next backward adds into the buffer
            self.flat.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)

    # ---- checkpoint state (torch.distributed.checkpoint, reshardable) ----
    def state_dict(self) -> dict[str, Any]:
        stepped = self.optimizer_stepped()
        state = self._own_state_dict()
        if not stepped:  # get_state_dict made the state with a step at rate 0: a run that saves must not keep it
            self.forget_optimizer_state()
        for to_saved, _ in self.state_transforms:
            state = to_saved(state)
        return state

    @property
    def stepping_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer whose state a step creates (torch optimizers make it at their first step)."""
        return self.optimizer

    def optimizer_stepped(self) -> bool:
        """Whether a step has run: not yet while fp16's first iterations overflow and are skipped."""
        return bool(self.stepping_optimizer.state)

    def forget_optimizer_state(self) -> None:
        """Back to a fresh optimizer's empty state (its groups and rates kept), so the next step is its first:
        a checkpoint saved before any step holds the state torch makes for saving (a step at rate 0, which counts
        a step and, under L2 weight decay, fills momentum), and loading it must not keep that either."""
        self.stepping_optimizer.state.clear()

    def _own_state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if not self.optimizer_stepped():  # only then: a rate-0 step would count one for parameters that stepped
            ensure_optimizer_state(self.optimizer)
        model_state, optimizer_state = get_state_dict(self.module, self.optimizer)
        state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
        if self.scaler is not None:
            state["loss_scaler"] = self.scaler.state_dict()
        return state

    def state_dict_for_loading(self, load_optimizer: bool) -> dict[str, Any]:
        """A state dict of the right shapes for torch.distributed.checkpoint.load to fill in place."""
        state = self.state_dict()
        if not load_optimizer:
            state.pop("optimizer")
            state.pop("loss_scaler", None)
        return state

    def load_state_dict(self, state: dict[str, Any], load_optimizer: bool = True) -> None:
        for _, from_saved in reversed(self.state_transforms):
            state = from_saved(state)
        self._load_own_state_dict(state, load_optimizer)
        if self.flat is not None:
            self.flat.state_loaded()
        self.parameters_updated()

    def _load_own_state_dict(self, state: dict[str, Any], load_optimizer: bool) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        if load_optimizer:
            set_model_state_dict(self.module, state["model"])
            # Not strict about parameters without optimizer state: the checkpoint has none for a parameter that
            # never had a gradient (checkpointer.drop_state_never_saved), and then neither has the resumed run.
            set_optimizer_state_dict(self.module, self.optimizer, state["optimizer"],
                                     options=StateDictOptions(strict=False))
            if self.scaler is not None and "loss_scaler" in state:
                self.scaler.load_state_dict(state["loss_scaler"])
        else:
            set_model_state_dict(self.module, state["model"])
