"""The optimizer side of a one-process step on flat buffers: parameters, gradients and Adam's moments as views into
one contiguous buffer each, so the gradient norm, clipping, zeroing and the AdamW update are a handful of operators
a step instead of one (or three) per parameter.

Megatron's DistributedOptimizer and mixed-precision optimizer keep `main_grad` and the fp32 parameters in flat
buffers for the same reason. Here the torch optimizer stays what it was (torch.optim.AdamW/Adam, fused): its
param_groups, schedule and per-parameter state (`state_dict`, so checkpoints keep their per-parameter format and
load from before) are untouched; only where the tensors live changes:

- each parameter's data is a view into `params`, each group a contiguous slice padded to a multiple of `ROW`
  elements (the padding is zero and stays zero: Adam steps a zero weight with a zero gradient to zero);
- each parameter's `.grad` is a view into `grads`, never cleared but zeroed in place (one fill), so backward adds
  into it (autograd's in-place accumulation; the bf16 copies' hooks add into it the same way);
- each parameter's `exp_avg` / `exp_avg_sq` are views into `exp_avgs` / `exp_avg_sqs`: the state torch's fused Adam
  would make at its first step is made with them, and after a checkpoint is loaded (which makes fresh tensors) the
  loaded moments are copied in;
- a step is `torch._fused_adamw_` (or `_fused_adam_`) once per group on the group's slices, with the group's step
  counters advanced together, exactly as torch's fused AdamW runs over a list (the same kernel, element by element);
- the gradient norm is one row-wise norm over `grads` (rows of `ROW` elements, summed in fp64: within 1e-8 of the
  fp64 norm, where fp32's single-pass norm of millions of elements drifts by 1e-2), and clipping one multiply.

Measured with bench/step_profile.py on the pretraining bench's shape (11.5M parameters in 100 tensors; AMD EPYC Zen 4,
2 cores shared with other jobs, load 9-27; CPU time of the runner's step: norm, clipping, AdamW, bf16 refresh,
zeroing; A/B interleaved in own processes, medians): with two threads 824 and 1038 ms → 53 and 49 ms a step (per
parameter, every small operator is an OpenMP region whose barrier spins while the other core is taken; wall 8.3 s and
3.9 s → 0.37 s and 0.15 s); with one thread 21.9 → 20.4 ms (bf16) and 20.9 → 17.1 ms (fp32), about 0.3% of the step.
The gradients' in-place accumulation and one fill of the buffer are the price: within the noise of the backward.

Where it runs (`optim/optimizers.py`'s `runs_on_flat_buffers`, said in the plan's optimizer line): one process, the
built-in dense GPT or BERT (every weight receives a gradient each step, so a zeroed gradient and no gradient step
alike), torch's fused Adam/AdamW built by rapidtrain, no loss scaling. DDP keeps torch's own bucket views of the
gradients (in an order it rebuilds after the first iteration); FSDP2, ZeroRedundancyOptimizer, DeepSpeed, FairScale,
pipeline, tensor and expert parallelism keep their own layouts.
"""

from __future__ import annotations

import torch
from torch import nn

ROW = 1024  # elements per row of the norm (and the padding of each group): accurate sums, no full-size temporary


def _padded(numel: int) -> int:
    return -(-numel // ROW) * ROW


class FlatAdam:
    """Flat buffers under a torch fused Adam/AdamW, and the norm, clipping, step and zeroing over them."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        groups = optimizer.param_groups
        self.parameters: list[nn.Parameter] = [p for group in groups for p in group["params"]]
        first = self.parameters[0]
        self.slices: list[slice] = []  # each group's stretch of the buffers
        self.group_params: list[range] = []  # each group's indices into `parameters`
        offsets: list[int] = []
        total = 0
        for group in groups:
            start = total
            self.group_params.append(range(len(offsets), len(offsets) + len(group["params"])))
            for param in group["params"]:
                offsets.append(total)
                total += param.numel()
            total = start + _padded(total - start)
            self.slices.append(slice(start, total))
        # whether each group's step counters agree (one bias correction serves the group): set when state is made
        # or adopted
        self._counters_agree = True
        self.params = torch.zeros(total, dtype=first.dtype, device=first.device)
        self.grads = torch.zeros_like(self.params)
        self.exp_avgs = torch.zeros_like(self.params)
        self.exp_avg_sqs = torch.zeros_like(self.params)
        self.offsets = offsets
        self.param_views = self._views(self.params)
        self.grad_views = self._views(self.grads)
        self.exp_avg_views = self._views(self.exp_avgs)
        self.exp_avg_sq_views = self._views(self.exp_avg_sqs)
        self.relink()

    @staticmethod
    def problem(optimizer: torch.optim.Optimizer) -> str | None:
        """Why this optimizer's parameters cannot step on flat buffers, or None when they can."""
        if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
            return f"{type(optimizer).__name__} is not torch's Adam or AdamW"
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not params:
            return "no parameters"
        if any(not group.get("fused") or group.get("amsgrad") or group.get("differentiable")
               for group in optimizer.param_groups):
            return "a group is not fused (or uses amsgrad)"
        first = params[0]
        if any(type(p) is not nn.Parameter or p.dtype != first.dtype or p.device != first.device
               or not p.is_floating_point() for p in params):
            return "the parameters are not plain tensors of one dtype on one device"
        if len({id(p) for p in params}) != len(params) or any(p.grad is not None for p in params):
            return "a parameter is listed twice or already has a gradient"
        return None

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o:o + p.numel()].view_as(p) for p, o in zip(self.parameters, self.offsets, strict=True)]

    # ---- keeping the parameters and gradients in the buffers ----
    def relink(self) -> None:
        """Make every parameter's data and gradient the buffers' views again (copying in what it holds): at the
        start, and after a checkpoint was loaded, should anything have replaced a parameter's tensor."""
        with torch.no_grad():
            for param, view, grad in zip(self.parameters, self.param_views, self.grad_views, strict=True):
                if param.data_ptr() != view.data_ptr():
                    view.copy_(param.detach())
                    param.data = view  # the same Parameter object: optimizer, hooks and names keep it
                if param.grad is not grad:
                    grad.copy_(param.grad) if param.grad is not None else grad.zero_()
                    param.grad = grad

    def ready(self) -> bool:
        """Whether every gradient is still the buffer's view (code outside the loop may have replaced one: then the
        step takes torch's per-parameter path once, and zeroing links the views back)."""
        return all(p.grad is g for p, g in zip(self.parameters, self.grad_views, strict=True))

    def zero_grad(self) -> None:
        self.grads.zero_()
        for param, grad in zip(self.parameters, self.grad_views, strict=True):
            if param.grad is not grad:
                param.grad = grad

    # ---- the step ----
    def grad_norm(self) -> torch.Tensor:
        """The L2 norm of all gradients, fp64 (as runner.squared_norm's, within float rounding of it)."""
        return squared_norm_of_flat(self.grads).sqrt()

    def clip(self, max_norm: float, total_norm: torch.Tensor) -> None:
        """torch.nn.utils.clip_grads_with_norm_'s coefficient, applied by one multiply."""
        coefficient = (max_norm / (total_norm.float() + 1e-6)).clamp(max=1.0)
        self.grads.mul_(coefficient)

    def step(self) -> None:
        """The optimizer's update over the buffers; torch's own step where the state is not flat (counters that differ
        after a load)."""
        if not self.optimizer.state:
            self._start_state()
        steps = self._adopted_steps()
        if steps is None:
            self.optimizer.step()  # torch makes the state (first step, or counters that differ after a load)
            self._adopt_state()
            return
        for group, part, counters in zip(self.optimizer.param_groups, self.slices, steps, strict=True):
            update = torch._fused_adamw_ if group.get("decoupled_weight_decay", False) else torch._fused_adam_
            beta1, beta2 = group["betas"]
            torch._foreach_add_(counters, 1)
            update([self.params[part]], [self.grads[part]], [self.exp_avgs[part]], [self.exp_avg_sqs[part]], [],
                   [counters[0]], amsgrad=False, lr=group["lr"], beta1=float(beta1), beta2=float(beta2),
                   weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                   grad_scale=None, found_inf=None)

    def _adopted_steps(self) -> list[list[torch.Tensor]] | None:
        """Each group's step counters when every parameter's moments are the buffers' views and a group's counters
        agree (one bias correction serves the group); None otherwise."""
        state = self.optimizer.state
        steps = []
        for indices in self.group_params:
            counters = []
            for i in indices:
                found = state.get(self.parameters[i])
                if (not found or found["exp_avg"] is not self.exp_avg_views[i]
                        or found["exp_avg_sq"] is not self.exp_avg_sq_views[i]):
                    return None
                counters.append(found["step"])
            steps.append(counters)
        return steps if self._counters_agree else None

    def _start_state(self) -> None:
        """The state torch's fused Adam makes at its first step (a float32 step counter on the parameter's device,
        zero moments), with the buffers' views as the moments: torch's own first step would allocate a second set
        of moments beside the buffers' (two more copies of the model at the peak) only for them to be copied in."""
        for param, exp_avg, exp_avg_sq in zip(self.parameters, self.exp_avg_views, self.exp_avg_sq_views, strict=True):
            self.optimizer.state[param] = {"step": torch.zeros((), dtype=torch.float32, device=param.device),
                                           "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        self._counters_agree = True

    def _adopt_state(self) -> None:
        """Copy torch's per-parameter moments into the buffers and make them the state's tensors."""
        state = self.optimizer.state
        self._counters_agree = True
        with torch.no_grad():
            for indices in self.group_params:
                counters = [state[self.parameters[i]]["step"] for i in indices if self.parameters[i] in state]
                if len(counters) != len(indices) or len({float(c) for c in counters}) > 1:
                    self._counters_agree = False  # torch's per-parameter step keeps each parameter's count
                for i in indices:
                    found = state.get(self.parameters[i])
                    if not found:
                        continue
                    for key, views in (("exp_avg", self.exp_avg_views), ("exp_avg_sq", self.exp_avg_sq_views)):
                        if found[key] is not views[i]:
                            views[i].copy_(found[key])
                            found[key] = views[i]

    def state_loaded(self) -> None:
        """After a checkpoint was loaded into the model and optimizer: parameters back in the buffers, the loaded
        moments adopted."""
        self.relink()
        if self.optimizer.state:
            self._adopt_state()


def squared_norm_of_flat(flat: torch.Tensor) -> torch.Tensor:
    """Sum of squares of a flat buffer whose length is a multiple of ROW, fp64: one row-wise norm (no temporary of
    the buffer's size), the rows' squares added in fp64."""
    return torch.linalg.vector_norm(flat.view(-1, ROW), dim=1).double().square().sum()
