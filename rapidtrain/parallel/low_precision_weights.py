"""bf16 copies of the linear layers' weights kept by the step, so autocast stops casting them in every forward.

Under torch autocast over fp32 parameters every micro-batch's forward casts each linear layer's weight and bias to
bf16, and backward casts each of their gradients back (ToCopyBackward): two passes over the layers' weights and two
more operators per weight per micro-batch, whatever the micro-batch's size. Megatron keeps 16-bit parameters and
fp32 master copies in its optimizer instead (Float16OptimizerWithFloat16Params, main_grad in fp32 with
--accumulate-allreduce-grads-in-fp32, which bf16 implies); here the module's parameters stay the fp32 masters (so
the optimizer, the checkpoints, export and evaluation see what they saw before) and the linear layers compute with
bf16 copies of them:

- the masters of the converted layers live in one flat fp32 buffer (their own, or the flat optimizer's when the
  step runs on flat buffers: optim/flat_buffers.py), their copies in one flat bf16 buffer at the same offsets,
  refreshed by one copy after each optimizer step and after a checkpoint is loaded (`refresh`);
- a converted `nn.Linear` runs `F.linear` on the copies while bf16 autocast is on (autocast then has nothing to
  cast but the input), and on the masters otherwise;
- each copy's gradient is added into its master's fp32 `.grad` as soon as backward has accumulated it (a
  post-accumulate-grad hook), the copy's own `.grad` dropped: fp32 accumulation over micro-batches.

The numbers are autocast's own: a copy holds exactly the bf16 value autocast's cast would give (both round to
nearest even), and the gradient reaches the fp32 `.grad` through the same bf16 → fp32 conversion. Only one process
without tensor, pipeline or data parallelism uses it (config/memory.py's `bf16_weight_copies` decides, the plan's
engine line says it; DDP, FSDP2 and DeepSpeed reduce or shard the parameters themselves).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class LowPrecisionLinear:
    """The forward of one converted `nn.Linear` (set as the module's `forward`): bf16 copies under bf16 autocast."""

    def __init__(self, module: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        self.module = module
        self.weight, self.bias = weight, bias
        self.dtype = dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == self.dtype:
            return F.linear(x, self.weight, self.bias)
        return F.linear(x, self.module.weight, self.module.bias)


class LowPrecisionWeights:
    """The bf16 copies of a model's trainable `nn.Linear` layers, their flat buffers and gradient hooks."""

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.bfloat16,
                 flat_master: torch.Tensor | None = None) -> None:
        """`flat_master`: a flat fp32 buffer the masters already live in (the optimizer's, optim/flat_buffers.py):
        the copies then mirror that buffer at the same offsets and nothing is moved."""
        self.dtype = dtype
        self.modules = converted_linears(model)
        self.masters = [p for m in self.modules for p in (m.weight, m.bias) if p is not None]
        if flat_master is not None and all(_inside(p, flat_master) for p in self.masters):
            self.flat_master = flat_master
            offsets = [(p.data_ptr() - flat_master.data_ptr()) // p.element_size() for p in self.masters]
        else:
            total = sum(p.numel() for p in self.masters)
            device = self.masters[0].device if self.masters else torch.device("cpu")
            self.flat_master = torch.empty(total, dtype=torch.float32, device=device)
            offsets, offset = [], 0
            with torch.no_grad():
                for master in self.masters:
                    view = self.flat_master[offset:offset + master.numel()].view_as(master)
                    view.copy_(master)
                    master.data = view  # the same Parameter object: optimizer, hooks and names keep it
                    offsets.append(offset)
                    offset += master.numel()
        self.flat_copy = torch.empty(self.flat_master.numel(), dtype=dtype, device=self.flat_master.device)
        copies: dict[int, torch.Tensor] = {}  # by id(master)
        for master, offset in zip(self.masters, offsets, strict=True):
            copy = self.flat_copy[offset:offset + master.numel()].view_as(master).requires_grad_()
            copy.register_post_accumulate_grad_hook(_into_master(master))
            copies[id(master)] = copy
        for module in self.modules:
            bias = None if module.bias is None else copies[id(module.bias)]
            # An instance attribute: nn.Module.__call__ runs it, and no hook appears that would make the model's
            # loss think its head is transformed (TokenCrossEntropy.can_fuse_head).
            module.__dict__["forward"] = LowPrecisionLinear(module, copies[id(module.weight)], bias, dtype)
        self.refresh()

    @property
    def parameters(self) -> int:
        """How many parameters have a bf16 copy."""
        return self.flat_master.numel()

    def refresh(self) -> None:
        """Copy the masters into the bf16 copies: after an optimizer step, after loading a checkpoint."""
        with torch.no_grad():
            self.flat_copy.copy_(self.flat_master)


def converted_linears(model: nn.Module) -> list[nn.Linear]:
    """The plain `nn.Linear` layers whose trainable weight belongs to them alone: a tied or shared weight (the output
    layer tied to the word embeddings, a subclass such as OutputLayer, whose loss reads the weight directly) and
    frozen or non-fp32 weights (LoRA's base, quantized layers) keep autocast's cast."""
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    found = []
    for module in model.modules():
        if type(module) is not nn.Linear:
            continue
        params = [p for p in (module.weight, module.bias) if p is not None]
        if all(type(p) is nn.Parameter and p.requires_grad and p.dtype == torch.float32 and uses[id(p)] == 1
               for p in params):
            found.append(module)
    return found


def _inside(tensor: torch.Tensor, flat: torch.Tensor) -> bool:
    """Whether `tensor` is a contiguous stretch of the 1-D buffer `flat` (same storage, same dtype)."""
    start = tensor.data_ptr() - flat.data_ptr()
    return (tensor.dtype == flat.dtype and tensor.is_contiguous()
            and tensor.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            and 0 <= start and start + tensor.numel() * tensor.element_size() <= flat.numel() * flat.element_size())


def _into_master(master: torch.Tensor) -> Callable[[torch.Tensor], None]:
    """Backward's hook on a copy: its bf16 gradient added into the master's fp32 gradient (set on the first)."""

    def hook(copy: torch.Tensor) -> None:
        grad, copy.grad = copy.grad, None
        assert grad is not None
        if master.grad is None:
            master.grad = grad.to(master.dtype)
        else:
            master.grad.add_(grad)

    return hook
