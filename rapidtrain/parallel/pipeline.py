"""Pipeline parallelism for the built-in models with `torch.distributed.pipelining`.

The model is split by layers into --pipeline-model-parallel-size stages (× virtual stages for the
interleaved and V schedules), as many layers to each stage as the plan's split says (config/pipeline_split.py:
even, Megatron's uneven first/last or embedding/loss accounting, a layout string, DeepSpeed's partition methods):
the first stage keeps the embedding, the last the final norm and the head, every other part is deleted. `layers`
keeps its keys ("0", "1", ...), so a stage's parameter names are the full model's and torch.distributed.checkpoint
reshards between pipeline sizes and splits.

Tied embeddings stay tied, as in Megatron: the last stage keeps its own copy of the word embedding
(same initial values) and, after every backward, the first and last stage sum the two copies'
gradients over their embedding group, so both copies take the same steps. The copy is left out of
the gradient norm and saved under the embedding's name in the optimizer state.

`PipelineRunner` runs a whole iteration with one `schedule.step` (micro-batches = accumulation steps): 1F1B
(interleaved with virtual stages), GPipe, zero bubble (ZB-H1; ZB1P interleaved), ZBV or DualPipeV (two stages per
rank in a V: rank r runs stages r and 2P-1-r, so the first rank also holds the head and ties the embedding within
itself). The zero-bubble family splits backward into input and weight gradients (torch's stage_backward_input /
stage_backward_weight), which write `.grad` themselves, past DistributedDataParallel's hooks: under those schedules
the stages are not wrapped in DDP, and their gradients are all-reduced over the data-parallel group before the step
(as DDP would, averaged). Loss and evaluation come from the last stage, which broadcasts them to the other stages of
its pipeline.

Expert parallelism shards each stage's experts over that stage's expert-parallel group (apply.py
shards them before the split); the ranks of a group run the same schedule, so their all-to-alls meet.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import _Action, _ComputationType, _PipelineScheduleRuntime
from torch.distributed.tensor import DTensor

from rapidtrain.config.pipeline_split import SPLIT_BACKWARD, V_SHAPED, rank_of_stage, stages_of_rank
from rapidtrain.config.settings import Layout, Plan, even_split
from rapidtrain.models.config import ModelConfig
from rapidtrain.models.transformer import TIED_EMBEDDING_NAME, OutputLayer
from rapidtrain.optim.grad_scaler import LossScaler
from rapidtrain.optim.optimizers import build_optimizer
from rapidtrain.parallel.mesh import ParallelMesh
from rapidtrain.parallel.runner import (
    EvalTotals,
    GradNorm,
    LossTotal,
    TorchRunner,
    add_pairs,
    as_loss,
    autocast,
    bucket_views_kept,
    per_token_scale,
    scaled,
)

FIRST_STAGE_PARTS = ("embedding",)
LAST_STAGE_PARTS = ("final_norm", "output", "lm_head", "pooler", "binary_head", "mtp")


# ---- splitting ----


def stage_layers(split: Sequence[int]) -> list[list[str]]:
    """Layer names of each stage, in order, from the layers per stage (the full model's names)."""
    starts = [sum(split[:s]) for s in range(len(split))]
    return [[str(i) for i in range(start, start + count)] for start, count in zip(starts, split, strict=True)]


def split_of(layout: Layout, num_layers: int) -> tuple[int, ...]:
    """The plan's layers per stage (the even split where the layout predates it)."""
    stages = layout.pipeline_parallel_size * layout.virtual_pipeline_stages
    return layout.stage_layers or even_split(num_layers, stages)


def local_stage_indices(pipeline_rank: int, pipeline_size: int, virtual_stages: int,
                        schedule: str = "1f1b") -> list[int]:
    """The stages a pipeline rank runs: Megatron's interleaving (chunk c of rank r is stage c·P + r), or the V
    schedules' (stages r and 2P-1-r)."""
    return stages_of_rank(pipeline_rank, pipeline_size, virtual_stages, schedule)


def keep_stages(model: nn.Module, stages: list[int], split: Sequence[int]) -> nn.Module:
    """Delete, in place, every part of the built-in model that `stages` do not run (`split`: layers per stage)."""
    if not isinstance(getattr(model, "layers", None), nn.ModuleDict) or not hasattr(model, "config"):
        raise ValueError(
            f"--pipeline-model-parallel-size splits the built-in GPT/BERT by layers; "
            f"{type(model).__name__} has no `layers` ModuleDict. Use --pipeline-model-parallel-size 1."
        )
    names, num_stages = stage_layers(split), len(split)
    mine = {name for s in stages for name in names[s]}
    layers = cast(nn.ModuleDict, model.layers)  # checked above (nn.Module's __getattr__ types it Tensor | Module)
    for name in [n for n in layers if n not in mine]:
        del layers[name]
    for part in FIRST_STAGE_PARTS:
        if 0 not in stages and getattr(model, part, None) is not None:
            setattr(model, part, None)
    for part in LAST_STAGE_PARTS:
        if num_stages - 1 not in stages and getattr(model, part, None) is not None:
            setattr(model, part, None)
    return model


def _config_of(model: nn.Module) -> ModelConfig:
    # The built-in models keep their ModelConfig as .config (nn.Module's __getattr__ types it Tensor | Module).
    return cast(ModelConfig, model.config)


def stage_view(model: nn.Module, stage: int, split: Sequence[int]) -> nn.Module:
    """A module of the model's class that runs one stage, sharing its submodules with `model`
    (with interleaving a rank runs several stages of one model whose names stay the full model's)."""
    view = object.__new__(type(model))
    nn.Module.__init__(view)
    view.config = model.config
    num_stages = len(split)
    layer_names = set(stage_layers(split)[stage])
    for name, child in model._modules.items():  # with the parts set to None, which named_children skips
        if name == "layers":
            child = nn.ModuleDict({k: v for k, v in cast(nn.ModuleDict, child).items() if k in layer_names})
        elif name in FIRST_STAGE_PARTS and stage != 0 or name in LAST_STAGE_PARTS and stage != num_stages - 1:
            child = None
        setattr(view, name, child)
    for name in FIRST_STAGE_PARTS + LAST_STAGE_PARTS:  # parts the model holds as None (BERT without its binary
        if name not in view._modules and hasattr(model, name):  # head): plain attributes its forward reads
            setattr(view, name, None)
    view.train(model.training)
    return view


def tied_copies(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of the tied word embedding where this stage holds it, and of a head's own copy
    of it on a stage without the embedding; the embedding group sums their gradients."""
    if not _config_of(model).tie_embeddings:
        return []
    found = {}
    if getattr(model, "embedding", None) is not None:
        weight = model.get_parameter(TIED_EMBEDDING_NAME)
        found[id(weight)] = (TIED_EMBEDDING_NAME, weight)
    for module_name, module in model.named_modules():
        if isinstance(module, OutputLayer) and module.tied_to is not None:
            weight = cast(nn.Parameter, module.weight)  # a Parameter (nn.Linear types it Tensor)
            found.setdefault(id(weight), (f"{module_name}.weight", weight))
    return list(found.values())


# ---- sequence-parallel stage boundaries: DTensors inside a stage, local shards on the wire ----


def _sequence_parallel_boundaries(view: nn.Module, tp_mesh: Any, first: bool, last: bool) -> None:
    from torch.distributed.tensor import DTensor, Shard

    if not first:
        view.register_forward_pre_hook(
            lambda _m, args: (DTensor.from_local(args[0], tp_mesh, [Shard(1)], run_check=False), *args[1:])
        )
    if not last:
        view.register_forward_hook(lambda _m, _a, out: out.to_local() if isinstance(out, DTensor) else out)


# ---- building the runner ----


class Stage(PipelineStage):
    """A PipelineStage whose shape inference leaves the MoE routing statistics and DDP's reducer alone: torch runs
    the stage once on placeholder inputs before the first step (and after each switch between training and
    evaluation), which is no training forward and must not enter the logged balancing loss."""

    def _compute_outputs(self, *args: Any, **kwargs: Any) -> Any:
        from rapidtrain.models.moe import routing_stats_paused

        # A DDP stage runs it under no_sync: otherwise DDP readies its reducer for a backward that never comes,
        # and the next micro-batch's backward is taken for the reducing one (its gradients recorded twice).
        ddp = self.submod if isinstance(self.submod, nn.parallel.DistributedDataParallel) else None
        with routing_stats_paused(self.submod), ddp.no_sync() if ddp is not None else contextlib.nullcontext():
            return super()._compute_outputs(*args, **kwargs)



def pipeline_runner(
    model: nn.Module,
    plan: Plan,
    mesh: ParallelMesh,
    device: torch.device,
    *,
    optimizer: torch.optim.Optimizer | None,
) -> PipelineRunner:
    """This rank's stage(s) of `model`, wrapped as the plan says, with their optimizer and schedule."""
    layout = plan.layout
    split = split_of(layout, _config_of(model).num_layers)
    num_stages, schedule_name = len(split), layout.pipeline_schedule
    stages = local_stage_indices(
        mesh.pipeline_rank, layout.pipeline_parallel_size, layout.virtual_pipeline_stages, schedule_name
    )
    model, views, stage_modules = parallelize_stages(
        keep_stages(model, stages, split), stages, split, plan, mesh, device
    )
    if optimizer is None:
        assert plan.optimizer is not None  # a training plan has its optimizer settings
        optimizer, _ = build_optimizer(model, plan.optimizer, device.type)
    pipeline_group = mesh.group("pp")
    runner = PipelineRunner(
        module=model,
        optimizer=optimizer,
        precision=plan.precision,
        device_type=device.type,
        clip_grad=plan.clip_grad,
        gradient_average=layout.data_context_parallel_size,  # DDP/FSDP average over data × context ranks
        pipeline_group=pipeline_group,
        scaler=LossScaler(plan.loss_scale) if plan.precision.loss_scaling != "none" else None,
        views=views,
        stage_modules=stage_modules,
        is_first=0 in stages,
        is_last=num_stages - 1 in stages,
        last_stage_rank=mesh.pipeline_global_rank(
            rank_of_stage(num_stages - 1, layout.pipeline_parallel_size, schedule_name)),
        # a V keeps the first and the last stage on one rank, whose views share the tied embedding itself
        embedding_group=mesh.embedding_group() if _config_of(model).tie_embeddings
        and rank_of_stage(num_stages - 1, layout.pipeline_parallel_size, schedule_name) != 0 else None,
        data_parallel_group=mesh.gradient_group() if schedule_name in SPLIT_BACKWARD else None,
    )

    def make_schedule(micro_batches: int, evaluation: bool = False) -> Any:
        pipeline_stages = [
            Stage(module, stage, num_stages, device, group=pipeline_group)
            for module, stage in zip(stage_modules, stages, strict=True)
        ]
        if evaluation:
            return v_forward_schedule(pipeline_stages, micro_batches, runner.microbatch_loss)
        return build_schedule(pipeline_stages, micro_batches, runner.microbatch_loss, schedule_name)

    runner.make_schedule = make_schedule
    runner.evaluates_apart = schedule_name in V_SHAPED
    runner.schedule = runner.schedule_for(plan.batches.accumulation_steps)
    return runner


def parallelize_stages(
    model: nn.Module, stages: list[int], split: Sequence[int], plan: Plan, mesh: ParallelMesh, device: torch.device
) -> tuple[nn.Module, list[nn.Module], list[nn.Module]]:
    """apply.py's order on the rank's model: tensor parallel → activation checkpointing → compile → data
    parallel; the last wraps each stage's view (with several virtual stages, one view per stage). Returns the
    model, its stage views, and what each pipeline stage runs: the view, or its DistributedDataParallel wrapper.

    Plain data parallelism is DistributedDataParallel around each view, with gradients as views into its buckets
    (the schedule's no_sync and last-backward reduction are torch's own for DDP); composable replicate() only
    under tensor parallelism, whose DTensor parameters DDP cannot reduce. replicate() is FSDP2's machinery: it
    keeps a second, "unsharded" copy of the parameters from forward to the end of backward, and accumulates
    gradients apart from them between micro-batches (measured on CPU: 8 bytes per parameter more than DDP)."""
    from rapidtrain.parallel.data_parallel import apply_ddp, apply_fsdp, apply_replicate
    from rapidtrain.parallel.meta_init import is_on_meta, materialize
    from rapidtrain.parallel.transforms import apply_transforms

    layout, switches = plan.layout, plan.switches
    model = apply_transforms(model, plan, mesh)
    on_meta = is_on_meta(model)  # built on meta: wrapped first, then each rank allocates its stage's shards
    if not on_meta:
        model.to(device)
    num_stages = len(split)
    views = [model] if len(stages) == 1 else [stage_view(model, s, split) for s in stages]
    context_parallel = getattr(model, "context_parallel", None)  # parallel/context_parallel.py's hook, per view
    for view in views:
        if context_parallel is not None and view is not model:
            context_parallel.attach(view)
    for view, stage in zip(views, stages, strict=True):
        if layout.sequence_parallel:
            _sequence_parallel_boundaries(view, mesh.submesh("tp"), stage == 0, stage == num_stages - 1)
        if mesh.gradient_group() is None:
            continue
        if switches.partitioning_engine == "fsdp2":  # ZeRO-1/2 in 3D: unsharded between forward and backward
            apply_fsdp(view, mesh, reshard_after_forward=switches.partitioning == "fsdp",
                       precision=plan.precision.dtype)
        elif layout.tensor_parallel_size > 1:
            apply_replicate(view, mesh)
    if on_meta:
        materialize(model, device, plan, parts=views)
    # DDP's hooks miss the split backward's weight gradients: those schedules reduce them in PipelineRunner instead
    ddp = (mesh.gradient_group() is not None and switches.partitioning_engine != "fsdp2"
           and layout.tensor_parallel_size == 1 and layout.pipeline_schedule not in SPLIT_BACKWARD)
    # DDP after the parameters exist (it broadcasts them); each view its own reducer
    stage_modules = [apply_ddp(view, mesh, device) for view in views] if ddp else list(views)
    return model, views, stage_modules


def build_schedule(stages: Sequence[PipelineStage], micro_batches: int, loss_fn: Callable,
                   schedule: str = "1f1b") -> Any:
    """The plan's schedule over this rank's stages. 1F1B: interleaved with several stages per rank; with one, GPipe
    when there are fewer micro-batches than stages (1F1B needs one per stage; the result is the same). Zero bubble:
    torch's interleaved ZB1P, which with one stage per rank is ZB-H1. Losses are summed, not averaged."""
    kwargs: dict[str, Any] = {"loss_fn": loss_fn, "scale_grads": False}
    if schedule == "zero-bubble":
        return ScheduleInterleavedZeroBubble(list(stages), micro_batches, **kwargs)
    if schedule == "zbv":
        return ScheduleZBVZeroBubble(list(stages), micro_batches, **kwargs)
    if schedule == "dualpipev":
        return ScheduleDualPipeV(list(stages), micro_batches, **kwargs)
    if len(stages) > 1:
        return ScheduleInterleaved1F1B(list(stages), micro_batches, **kwargs)
    single = Schedule1F1B if schedule == "1f1b" and micro_batches >= stages[0].num_stages else ScheduleGPipe
    return single(stages[0], micro_batches, **kwargs)


def v_forward_schedule(stages: Sequence[PipelineStage], micro_batches: int, loss_fn: Callable) -> Any:
    """Evaluation on a V (ZBV, DualPipeV): torch's V schedules keep their backward actions in `eval` (measured:
    ZBV stops on "can't steal_bwd_input"), so evaluation runs forwards alone on the same stages: each rank takes
    micro-batch i through its first stage r, then its second stage 2P-1-r (which waits for the ranks below it).
    torch's schedule lowering validates a backward per micro-batch, so the V's stage → rank map is set here and
    torch's _add_send_recv adds the communication."""
    from torch.distributed.pipelining.schedules import _add_send_recv

    schedule = _PipelineScheduleRuntime(list(stages), micro_batches, loss_fn=loss_fn, scale_grads=False)
    p, forward = stages[0].group_size, _ComputationType.FORWARD
    to_rank = {stage: rank_of_stage(stage, p, "zbv") for stage in range(2 * p)}
    schedule.stage_index_to_group_rank = to_rank
    for stage in stages:
        stage.stage_index_to_group_rank = to_rank
    order = {rank: [_Action(stage, forward, i) for i in range(micro_batches) for stage in (rank, 2 * p - 1 - rank)]
             for rank in range(p)}
    schedule.pipeline_order_with_comms = _add_send_recv(order, stage_to_rank=to_rank.__getitem__, num_stages=2 * p)
    return schedule


# ---- running whole iterations ----


class _RecordCall:
    """Stands in for the model in a trainer's forward step: records how the model would be called, so
    the pipeline can feed those inputs to its stages and apply the returned loss function."""

    def __init__(self) -> None:
        self.args: tuple = ()
        self.kwargs: dict[str, Any] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> _RecordCall:
        self.args, self.kwargs = args, kwargs
        return self


_NOT_PIPELINABLE = (
    "under --pipeline-model-parallel-size the forward step must call the model once and return "
    "(output, loss_fn), as the built-in pretraining does, so that the last stage can apply loss_fn; a loss "
    "that is not per token (the BERT binary head's) cannot be pipelined: drop --bert-binary-head or "
    "--pipeline-model-parallel-size."
)


def _record_micro_batch(forward_step: Callable, batch: Any,
                        positional_names: Sequence[str] = ()) -> tuple[_RecordCall, Callable]:
    call = _RecordCall()
    try:
        result = forward_step(iter([batch]), call)
    except (AttributeError, TypeError, ValueError) as error:  # it used the model's output itself
        raise ValueError(_NOT_PIPELINABLE) from error
    if not (isinstance(result, tuple) and len(result) == 2 and result[0] is call and callable(result[1])):
        raise ValueError(_NOT_PIPELINABLE)
    if 1 < len(call.args) <= len(positional_names):  # Megatron's model(tokens, position_ids, attention_mask)
        call.kwargs = {**dict(zip(positional_names[1:], call.args[1:], strict=False)), **call.kwargs}
        call.args = call.args[:1]
    if len(call.args) != 1:
        raise ValueError(
            "under --pipeline-model-parallel-size the forward step must pass the model one positional "
            "input (token ids) and everything else by keyword."
        )
    return call, result[1]


def _positional_names(module: nn.Module) -> list[str]:
    """The names of the model's forward parameters, in order (to pass positional inputs by name)."""
    import inspect

    return [name for name, p in inspect.signature(module.forward).parameters.items()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _concatenate(calls: list[_RecordCall]) -> tuple[tuple, dict[str, Any]]:
    """One whole-batch input that the schedule splits back into exactly these micro-batches."""
    args = (torch.cat([c.args[0] for c in calls]),)
    kwargs = {
        name: torch.cat([c.kwargs[name] for c in calls])
        for name, value in calls[0].kwargs.items()
        if isinstance(value, torch.Tensor)
    }
    return args, kwargs


@dataclass
class PipelineRunner(TorchRunner):
    """A pipeline stage's model part(s), optimizer and schedule: `forward_backward` runs every micro-batch
    of one global batch through the schedule; the norm sums the stages' parts (TorchRunner's step)."""

    views: list[nn.Module] = field(default_factory=list)
    stage_modules: list[nn.Module] = field(default_factory=list)  # the views, or their DDP wrappers
    is_first: bool = False
    is_last: bool = False
    last_stage_rank: int = 0
    embedding_group: dist.ProcessGroup | None = None
    # Set under the split-backward schedules, whose stages DDP does not wrap: the gradients are averaged over it
    data_parallel_group: dist.ProcessGroup | None = None
    schedule: Any = None
    # A schedule for another number of micro-batches (a batch-size ramp-up changes it between iterations).
    make_schedule: Callable[..., Any] | None = None
    evaluates_apart: bool = False  # evaluation runs a forward-only schedule of its own (the V schedules)

    def __post_init__(self) -> None:
        super().__post_init__()
        # Per iteration: the trainer's loss function and the results of each micro-batch.
        self._loss_fns: list[Callable] = []
        self._loss_sums: dict[int, torch.Tensor] = {}
        self._counts: dict[int, Any] = {}
        self._reported: dict[int, dict[str, torch.Tensor]] = {}
        self._schedules: dict[tuple[int, bool], Any] = {}
        self._scale: torch.Tensor | float = 1.0
        self._targets: torch.Tensor | None = None  # the micro-batch indices the schedule splits
        copies = tied_copies(self.module)
        self.tied_parameters = [p for _, p in copies]
        # The head's copy of the embedding is counted once in the norm (with the embedding itself).
        self.tied_copy_name = next((n for n, _ in copies if n != TIED_EMBEDDING_NAME), None)
        copy_ids = {id(p) for n, p in copies if n == self.tied_copy_name}
        self.grad_norm = GradNorm([p for p in self.parameters if id(p) not in copy_ids], self.pipeline_group)
        if self.embedding_group is not None:
            self.before_step.append(self._sum_tied_gradients)
        if self.data_parallel_group is not None:
            self.before_step.append(self._average_data_parallel_gradients)

    def microbatch_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss: `target` is the micro-batch's index; its loss function came from the trainer.

        Results are kept by index: the schedule's first step also calls this once to infer shapes,
        on uninitialised inputs, before the real micro-batch 0.
        """
        index = self._micro_batch_index(target)
        loss_sum, count, reported = as_loss(self._loss_fns[index](output))
        self._loss_sums[index] = loss_sum.detach().double()
        self._counts[index] = count
        self._reported[index] = reported
        loss = scaled(loss_sum, self._scale)
        return self.scaler.scale(loss) if self.scaler is not None and torch.is_grad_enabled() else loss

    def _micro_batch_index(self, target: torch.Tensor) -> int:
        """The index `target` carries, read without a host read: the schedule hands each micro-batch a view
        of `arange(micro_batches)` (tensor_split; detached for its shape inference), whose storage offset is
        the index. A target that is no such view is read (it lives on the host)."""
        if self._targets is not None and target.untyped_storage().data_ptr() == \
                self._targets.untyped_storage().data_ptr():
            return int(target.storage_offset())  # an int (SymInt only under tracing)
        return int(target[0])

    def _run(
        self, micro_batches: list[Any], forward_step: Callable, scale: torch.Tensor | float | None, train: bool
    ) -> None:
        names = _positional_names(self.views[0]) if self.views else []
        recorded = [_record_micro_batch(forward_step, batch, names) for batch in micro_batches]
        self._loss_fns = [loss_fn for _, loss_fn in recorded]
        self._loss_sums, self._counts, self._reported = {}, {}, {}
        schedule = self.schedule_for(len(micro_batches), evaluation=not train)
        self._scale = scale if scale is not None else 1.0 / len(micro_batches)
        args, kwargs = _concatenate([call for call, _ in recorded])
        args = args if self.is_first else ()  # later stages take their input from the previous stage
        target = self._targets = torch.arange(len(micro_batches)) if self.is_last else None
        with autocast(self.precision, self.device_type):
            if train:
                schedule.step(*args, target=target, return_outputs=False, **kwargs)
            else:
                schedule.eval(*args, target=target, **kwargs)

    def schedule_for(self, micro_batches: int, evaluation: bool = False) -> Any:
        """The schedule for this many micro-batches (its stages built for it), kept for later iterations; for
        evaluation, the training one unless the layout evaluates apart."""
        key = (micro_batches, evaluation and self.evaluates_apart)
        if key not in self._schedules:
            if self.make_schedule is None:
                return self.schedule
            self._schedules[key] = self.make_schedule(*key)
        return self._schedules[key]

    def forward_backward(
        self, micro_batches: list[Any], forward_step: Callable, global_tokens: torch.Tensor | int | None
    ) -> LossTotal:
        """Forward and backward of every micro-batch → the loss total on every stage (from the last).

        With `global_tokens` the loss functions' per-token sums are scaled to the global-batch mean (the
        forward step must then return `(output, loss_fn)` with `loss_fn` giving `(loss_sum, count)`);
        without, each micro-batch's mean loss weighs 1 / micro-batches.
        """
        scale = per_token_scale(self.gradient_average, global_tokens) if global_tokens is not None else None
        self._run(micro_batches, forward_step, scale, train=True)
        total = self._total()
        if global_tokens is None:
            total = total / len(micro_batches)
        return LossTotal(self._broadcast(total.reshape(1))[0], global_tokens is not None, self._reported_total())

    @torch.no_grad()
    def evaluate(self, micro_batches: list[Any], forward_step: Callable) -> EvalTotals:
        """Forward only → (sum of losses, their weight: tokens, or one per micro-batch) on every stage; the
        reported values on the last stage."""
        self._run(micro_batches, forward_step, None, train=False)
        weight = torch.zeros((), dtype=torch.float64, device=self._grad_device())
        for count in self._counts.values():
            weight = weight + (1.0 if count is None else count.to(weight.device, torch.float64))
        totals = self._broadcast(torch.stack([self._total(), weight]))
        return EvalTotals(totals[0], totals[1], self._reported_total())

    def _reported_total(self) -> dict[str, torch.Tensor]:
        total: dict[str, torch.Tensor] = {}
        for index in sorted(self._reported):
            add_pairs(total, self._reported[index])
        return total

    def _total(self) -> torch.Tensor:
        # Summed in micro-batch order, as the unpipelined loop does; zero on stages without the loss.
        total = torch.zeros((), dtype=torch.float64, device=self._grad_device())
        for index in sorted(self._loss_sums):
            total = total + self._loss_sums[index].to(total.device)
        return total

    def _broadcast(self, values: torch.Tensor) -> torch.Tensor:
        if self.pipeline_group is not None:
            dist.broadcast(values, src=self.last_stage_rank, group=self.pipeline_group)
        return values

    @torch.no_grad()
    def _sum_tied_gradients(self) -> None:
        for param in self.tied_parameters:
            grad = param.grad
            if grad is None:  # keep the collective matched: this stage contributed nothing
                param.grad = grad = torch.zeros_like(param)
            if isinstance(grad, DTensor):
                placements = cast(DTensor, param).placements  # a DTensor gradient's parameter is a DTensor
                if grad.placements != placements:
                    param.grad = grad = grad.redistribute(placements=placements)
            dist.all_reduce(
                grad.to_local() if isinstance(grad, DTensor) else grad, group=self.embedding_group
            )

    @torch.no_grad()
    def _average_data_parallel_gradients(self) -> None:
        """DDP's reduction, for the stages it does not wrap: every gradient but the sharded experts' (reduced over
        their own group, parallel/experts.py) averaged over the data-parallel group, one flat all-reduce per dtype."""
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        from rapidtrain.parallel.experts import expert_parameters

        experts = {id(p) for p in expert_parameters(self.module).values()}
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for param in self.module.parameters():
            if param.requires_grad and id(param) not in experts:
                if param.grad is None:  # keep the collective matched across ranks
                    param.grad = torch.zeros_like(param)
                by_dtype.setdefault(param.grad.dtype, []).append(param)
        size = dist.get_world_size(self.data_parallel_group)
        for params in by_dtype.values():
            grads = [cast(torch.Tensor, p.grad) for p in params]
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=self.data_parallel_group)
            flat.div_(size)
            for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
                grad.copy_(reduced)

    def backward(self, loss: torch.Tensor) -> None:
        raise RuntimeError(
            "under --pipeline-model-parallel-size the pipeline schedule runs forward and backward of every "
            "micro-batch: train with a template's train_step (or runner.forward_backward), not "
            "engine.backward(loss)."
        )

    def train(self, mode: bool = True) -> None:
        for view in [self.module, *self.views]:
            view.train(mode)

    def zero_grad(self) -> None:
        """As TorchRunner's, for each stage's DDP: its gradients stay views into its buckets (zeroed), so the
        micro-batches accumulate into the buckets instead of into new tensors beside them."""
        with contextlib.ExitStack() as kept:
            for module in self.stage_modules:
                kept.enter_context(bucket_views_kept(module))
            self.clear_gradients()

    # ---- checkpoints ----
    # Parameter names are the full model's; the head's embedding copy is saved under the embedding's name
    # in the optimizer state. `param_groups` (one object for the whole checkpoint, so only one stage's)
    # is not loaded: this stage keeps its own groups, the learning rate comes back with the schedule.
    def _own_state_dict(self) -> dict[str, Any]:
        state = super()._own_state_dict()
        if self.tied_copy_name:
            state["optimizer"] = _rename(state["optimizer"], self.tied_copy_name, TIED_EMBEDDING_NAME)
        return state

    def state_dict_for_loading(self, load_optimizer: bool) -> dict[str, Any]:
        state = super().state_dict_for_loading(load_optimizer)
        if "optimizer" in state:
            state["optimizer"] = {"state": state["optimizer"]["state"]}
        return state

    def _load_own_state_dict(self, state: dict[str, Any], load_optimizer: bool) -> None:
        if load_optimizer:
            groups = super()._own_state_dict()["optimizer"]["param_groups"]
            optimizer = {**state["optimizer"], "param_groups": groups}
            if self.tied_copy_name:
                optimizer = _rename(optimizer, TIED_EMBEDDING_NAME, self.tied_copy_name)
            state = {**state, "optimizer": optimizer}
        super()._load_own_state_dict(state, load_optimizer)


def _rename(optimizer_state: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    """Rename one parameter in an optimizer state dict keyed by parameter names."""
    state = {new if name == old else name: value for name, value in optimizer_state["state"].items()}
    groups = [
        {**group, "params": [new if name == old else name for name in group["params"]]}
        for group in optimizer_state.get("param_groups", [])
    ]
    return {**optimizer_state, "state": state, **({"param_groups": groups} if groups else {})}
