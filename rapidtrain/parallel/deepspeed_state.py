"""Checkpoint state of a DeepSpeed ZeRO engine in the layout every rapidtrain mode shares.

ZeRO keeps fp32 master weights and optimizer state as flat partitions per parameter group. A checkpoint
holds them by parameter name, as `torch.distributed.checkpoint.state_dict.get_state_dict` gives them for
any model: `model` maps each parameter name to its fp32 value, `optimizer` holds `state[name][key]` and
`param_groups` with names. Each value is written sharded, as FSDP2 writes it: a DTensor with rows
`Shard(0)` over the data-parallel ranks. To cut its rows a rank gathers one parameter at a time
(DeepSpeed's `safe_get_full_*`), keeps its own rows and drops the rest, so a save never holds more than
this rank's shard of the model state plus one whole parameter; every rank writes its own shard. DCP
reshards on load, so the files load into any mode, stage or world size; loading gathers one parameter at a
time from the shards read and scatters it into this rank's partitions.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from rapidtrain.models.transformer import canonical_name, parameter_names
from rapidtrain.optim.lr_schedule import set_group_lr

# torch's Adam/AdamW keep `step` as a float tensor per parameter: checkpoints use that form.
STEP = "step"


def world_mesh() -> Any:
    """A 1-D CPU mesh over every rank (ZeRO's data-parallel group), for the shards a checkpoint holds; None in
    one process (values are then whole tensors)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def row_shard(value: torch.Tensor, mesh: Any) -> torch.Tensor:
    """This rank's rows of a whole value as a DTensor (Shard(0) over `mesh`, torch.chunk's split), copied so the
    whole value can be freed; a scalar stays whole (replicated)."""
    if mesh is None:
        return value
    if value.dim() == 0:
        return DTensor.from_local(value, mesh, [Replicate()], run_check=False)
    rows = -(-value.shape[0] // mesh.size())  # ceil
    start = min(mesh.get_local_rank() * rows, value.shape[0])
    local = value[start:start + rows].clone()
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=value.shape, stride=value.stride())


def empty_shard(shape: torch.Size, mesh: Any) -> torch.Tensor:
    """Room for this rank's rows of a value of `shape`, for DCP to read into (whole in one process)."""
    if mesh is None or len(shape) == 0:
        return torch.empty(shape, dtype=torch.float32)
    from torch.distributed.tensor import empty

    return empty(shape, dtype=torch.float32, device_mesh=mesh, placements=[Shard(0)])


def whole(value: torch.Tensor) -> torch.Tensor:
    """The whole value of a saved entry (collective for a DTensor: every rank must ask for the same ones)."""
    return value.full_tensor() if isinstance(value, DTensor) else value


class ZeroState:
    """Reads and writes a ZeRO engine's weights and optimizer state by parameter name."""

    def __init__(self, engine: Any, groups: list[list[nn.Parameter]]) -> None:
        self.engine = engine
        self.zero = engine.optimizer  # DeepSpeedZeroOptimizer (stage 1/2) or its stage-3 sibling
        self.base = self.zero.optimizer  # the real torch optimizer (or DeepSpeedCPUAdam) on flat partitions
        self.groups = groups  # the model parameters of each optimizer group, in DeepSpeed's group order
        self.stage3 = hasattr(self.zero, "fp32_partitioned_groups_flat")
        self.names = parameter_names(engine.module)
        self.mesh = world_mesh()

    # ---- the flat partitions the real optimizer steps ----
    def flat_partitions(self) -> list[torch.Tensor]:
        if self.stage3:
            return list(self.zero.fp32_partitioned_groups_flat)
        return list(self.zero.single_partition_of_fp32_groups)

    def flat_partitions_of_group(self, index: int) -> list[torch.Tensor]:
        if self.stage3:
            mapping = self.zero.sub_group_to_group_id
            return [
                flat
                for sub, flat in enumerate(self.zero.fp32_partitioned_groups_flat)
                if mapping[sub] == index
            ]
        return [self.zero.single_partition_of_fp32_groups[index]]

    def optimizer_stepped(self) -> bool:
        """Whether the real optimizer has stepped: not yet while fp16's first iterations overflow and are skipped."""
        return all(len(self.base.state.get(flat, {})) > 0 for flat in self.flat_partitions())

    def forget_optimizer_state(self) -> None:
        """Back to no state, so the next real step is the first (as the torch runners do): a save before any step
        makes the state with a step at rate 0 (`ensure_optimizer_state`), which counts a step Adam never took."""
        for flat in self.flat_partitions():
            self.base.state.pop(flat, None)
        if not self.stage3:  # the fragments point at the state just dropped: link again after the next step
            self.zero._hp_optimizer_states_linked = False

    def ensure_optimizer_state(self) -> None:
        """Create the optimizer's state if no step ran yet, and link each parameter to its state fragment."""
        flats = self.flat_partitions()
        if not all(len(self.base.state.get(flat, {})) > 0 for flat in flats):
            self.initialize_optimizer_state(flats)
        if not self.stage3:
            # DeepSpeed 0.19 links the fragments once, right after the first group's first step, when the later
            # groups have no state yet (their fragments stay empty): link again now that every group has one.
            self.zero._hp_optimizer_states_linked = False
            self.zero._lazy_init_hp_params_optimizer_state()

    def initialize_optimizer_state(self, flats: list[torch.Tensor]) -> None:
        """As torch does before loading into a fresh optimizer: one step with zero gradients at rate 0."""
        rates = [float(group["lr"]) for group in self.base.param_groups]
        kept_grads = [flat.grad for flat in flats]
        for group in self.base.param_groups:
            set_group_lr(group, 0.0)
        for flat in flats:
            flat.grad = torch.zeros_like(flat)
        try:
            if self.stage3:
                for sub_group in range(len(flats)):
                    self.zero._optimizer_step(sub_group)  # it points the real optimizer at that partition
            else:
                self.base.step()
        finally:
            for group, rate in zip(self.base.param_groups, rates, strict=True):
                set_group_lr(group, rate)
            for flat, grad in zip(flats, kept_grads, strict=True):
                flat.grad = grad.zero_() if grad is not None else None

    def optimizer_keys(self) -> list[str]:
        """The per-element state tensors of the real optimizer (exp_avg, exp_avg_sq, momentum_buffer, ...)."""
        flat = self.flat_partitions()[0]
        state = self.base.state[flat]
        return [k for k, v in state.items() if torch.is_tensor(v) and v.shape == flat.shape]

    def counts_steps(self) -> bool:
        """Whether the optimizer keeps a step count (Adam's bias correction; SGD has none)."""
        return STEP in self.base.state[self.flat_partitions()[0]]

    def group_step(self, index: int) -> float:
        return float(self.base.state[self.flat_partitions_of_group(index)[0]][STEP])

    def set_group_step(self, index: int, value: float) -> None:
        for flat in self.flat_partitions_of_group(index):
            state = self.base.state[flat]
            if torch.is_tensor(state[STEP]):
                state[STEP].fill_(value)
            else:  # DeepSpeedCPUAdam counts in a Python int
                state[STEP] = int(value)

    # ---- gathering and scattering by parameter ----
    @staticmethod
    def full_shape(param: nn.Parameter) -> torch.Size:
        return param.ds_shape if hasattr(param, "ds_shape") else param.shape

    def full_weight(self, param: nn.Parameter) -> torch.Tensor:
        """The fp32 master value of a trained parameter, or the (gathered) value of a frozen one."""
        from deepspeed.runtime.zero import GatheredParameters
        from deepspeed.utils import safe_get_full_fp32_param

        if param.requires_grad:
            return safe_get_full_fp32_param(param).detach().float().cpu()
        with GatheredParameters([param]):
            return param.data.detach().float().cpu().clone()

    def set_full_weight(self, param: nn.Parameter, value: torch.Tensor) -> None:
        """Write the fp32 master (this rank's fragment) and the 16-bit/working copy the forward uses."""
        from deepspeed.runtime.zero import GatheredParameters
        from deepspeed.utils import safe_set_full_fp32_param

        if param.requires_grad:
            safe_set_full_fp32_param(param, value.to(self.device_of(param)).float())
        with GatheredParameters([param], modifier_rank=0), torch.no_grad():
            param.data.copy_(value.view(param.data.shape).to(param.data.dtype))

    @staticmethod
    def device_of(param: nn.Parameter) -> torch.device:
        return param.ds_tensor.device if hasattr(param, "ds_tensor") else param.device

    # ---- the state dicts ----
    def model_state(self, sharded: bool = False) -> dict[str, torch.Tensor]:
        """Every entry of the module's state dict (tied names too) under its canonical name; fp32 weights.

        Whole values on every rank (export gathers them), or `sharded`: this rank's rows only, one whole
        parameter at a time."""
        params = dict(self.engine.module.named_parameters(remove_duplicate=False))
        gathered: dict[int, torch.Tensor] = {}
        state: dict[str, torch.Tensor] = {}
        for key, value in self.engine.module.state_dict(keep_vars=True).items():
            param = params.get(key)
            if param is None:
                state[canonical_name(key)] = value.detach().clone()
                continue
            if id(param) not in gathered:
                full = self.full_weight(param)
                gathered[id(param)] = row_shard(full, self.mesh) if sharded else full
            state[canonical_name(key)] = gathered[id(param)]
        return state

    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer state by parameter name, each tensor this rank's rows (one whole one at a time)."""
        from deepspeed.utils import safe_get_full_optimizer_state

        self.ensure_optimizer_state()
        keys = self.optimizer_keys()
        state: dict[str, dict[str, torch.Tensor]] = {}
        groups = []
        for index, (params, group) in enumerate(zip(self.groups, self.base.param_groups, strict=True)):
            for param in params:
                entry = {STEP: torch.tensor(self.group_step(index))} if self.counts_steps() else {}
                for key in keys:
                    full = safe_get_full_optimizer_state(param, key).detach().float().cpu()
                    entry[key] = row_shard(full, self.mesh)
                    del full
                state[self.names[id(param)]] = entry
            groups.append(self.saved_group(group, params))
        return {"state": state, "param_groups": groups}

    def saved_group(self, group: dict[str, Any], params: list[nn.Parameter]) -> dict[str, Any]:
        saved = {k: v for k, v in group.items() if k != "params"}
        if hasattr(self.base, "adam_w_mode"):  # DeepSpeedCPUAdam: say it as torch's Adam/AdamW would
            saved["decoupled_weight_decay"] = bool(self.base.adam_w_mode)
        saved["params"] = [self.names[id(p)] for p in params]
        return saved

    def state_dict(self) -> dict[str, Any]:
        stepped = self.optimizer_stepped()
        state = {"model": self.model_state(sharded=True), "optimizer": self.optimizer_state()}
        if not stepped:  # the state was made for this save: the run that saves goes on without it
            self.forget_optimizer_state()
        if self.dynamic_loss_scaling:
            state["loss_scaler"] = loss_scaler_state(self.zero.loss_scaler)
        return state

    @property
    def dynamic_loss_scaling(self) -> bool:
        return bool(getattr(getattr(self.zero, "loss_scaler", None), "dynamic", False))

    def template(self, load_optimizer: bool) -> dict[str, Any]:
        """Room for this rank's rows of every saved value, for DCP to fill, without gathering anything."""
        model: dict[str, torch.Tensor] = {}
        params = dict(self.engine.module.named_parameters(remove_duplicate=False))
        for key, value in self.engine.module.state_dict(keep_vars=True).items():
            param = params.get(key)
            model[canonical_name(key)] = (
                empty_shard(self.full_shape(param), self.mesh)
                if param is not None
                else value.detach().clone()
            )
        state: dict[str, Any] = {"model": model}
        if load_optimizer:
            self.ensure_optimizer_state()
            keys = self.optimizer_keys()
            state["optimizer"] = {
                "state": {
                    self.names[id(p)]: {
                        **({STEP: torch.tensor(0.0)} if self.counts_steps() else {}),
                        **{key: empty_shard(self.full_shape(p), self.mesh) for key in keys},
                    }
                    for params in self.groups
                    for p in params
                },
                "param_groups": [
                    self.saved_group(g, ps) for g, ps in zip(self.base.param_groups, self.groups, strict=True)
                ],
            }
            if self.dynamic_loss_scaling:
                state["loss_scaler"] = loss_scaler_state(self.zero.loss_scaler)
        return state

    def load(self, state: dict[str, Any], load_optimizer: bool) -> None:
        from deepspeed.utils import safe_set_full_optimizer_state

        model = state["model"]
        done: set[int] = set()
        for name, param in self.engine.module.named_parameters():
            if id(param) not in done:
                self.set_full_weight(param, whole(model[canonical_name(name)]))
                done.add(id(param))
        for name, buffer in self.engine.module.named_buffers():
            if canonical_name(name) in model:
                buffer.data.copy_(whole(model[canonical_name(name)]))
        if not load_optimizer:
            return
        self.ensure_optimizer_state()
        saved = state["optimizer"]
        keys = self.optimizer_keys()
        steps = 0
        for index, (params, group) in enumerate(zip(self.groups, self.base.param_groups, strict=True)):
            for param in params:
                entry = saved["state"][self.names[id(param)]]
                for key in keys:
                    safe_set_full_optimizer_state(param, whole(entry[key]).to(self.device_of(param)).float(), key)
            if params and self.counts_steps():
                step = float(saved["state"][self.names[id(params[0])]][STEP])
                self.set_group_step(index, step)
                steps = max(steps, int(step))
            self.load_hyperparameters(group, saved["param_groups"][index])
        if hasattr(self.base, "ds_opt_adam"):
            replay_cpu_adam_steps(self.base, steps)
        if self.dynamic_loss_scaling and "loss_scaler" in state:
            load_loss_scaler_state(self.zero.loss_scaler, state["loss_scaler"])

    @staticmethod
    def load_hyperparameters(group: dict[str, Any], saved: dict[str, Any]) -> None:
        # Only keys this optimizer knows: a checkpoint of another optimizer class must not add or rename any.
        for key in group:
            if key != "params" and key in saved:
                group[key] = saved[key]


def replay_cpu_adam_steps(optimizer: Any, steps: int) -> None:
    """Bring DeepSpeedCPUAdam's C++ bias-correction powers to where an uninterrupted run has them after `steps`.

    The C++ optimizer keeps beta1^t and beta2^t in float32 and multiplies them by the betas once per step; when a
    step number arrives that does not follow the last one (the first step after a resume, into a fresh optimizer)
    it computes std::pow(beta, t) instead, which can differ in the last bit, and so the resumed run's updates, and
    within a few steps its losses, stop being bitwise the uninterrupted run's. Stepping a one-element stand-in
    through steps 1..`steps` at rate 0 takes the multiplying path every time (step 1 gives beta exactly whatever
    came before): the real parameters and their state are not touched."""
    if steps <= 0:
        return
    group = optimizer.param_groups[0]
    beta1, beta2 = group["betas"]
    param, grad, exp_avg, exp_avg_sq = (torch.zeros(1) for _ in range(4))
    for step in range(1, steps + 1):
        optimizer.ds_opt_adam.adam_update(optimizer.opt_id, step, 0.0, beta1, beta2, group["eps"], 0.0,
                                          group["bias_correction"], param, grad, exp_avg, exp_avg_sq)


def loss_scaler_state(scaler: Any) -> dict[str, Any]:
    """DeepSpeed's dynamic fp16 loss scaler in rapidtrain's (Megatron's) keys, so fp16 checkpoints cross modes."""
    stable_steps = (
        scaler.cur_iter - scaler.last_overflow_iter - 1
    )  # overflow-free steps since the last overflow
    return {
        "scale": float(scaler.cur_scale),
        "growth_tracker": stable_steps % scaler.scale_window,
        "hysteresis_tracker": int(scaler.cur_hysteresis),
    }


def load_loss_scaler_state(scaler: Any, state: dict[str, Any]) -> None:
    if not state:  # a constant scale (from the flags) was saved
        return
    scale = state["scale"]
    scaler.cur_scale = float(scale.item() if torch.is_tensor(scale) else scale)
    scaler.cur_iter, scaler.last_overflow_iter = int(state["growth_tracker"]), -1
    scaler.cur_hysteresis = int(state["hysteresis_tracker"])
