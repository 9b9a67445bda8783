"""How many transformer layers each pipeline stage holds, and which schedule runs the stages: pure arithmetic on the
flags, shared by the rules (which refuse an impossible split, naming the flags and numbers), the plan (which prints
it) and parallel/pipeline.py (which keeps each stage's layers).

A split is a tuple of layer counts, one per pipeline stage in model order (stage s = chunk·P + pipeline rank with
virtual stages, Megatron's interleaving; the V-shaped schedules put stages r and 2P-1-r on rank r instead). Layers
keep their full-model names whatever the split, so checkpoints reshard between splits.

The splits, after their origins' semantics:
- even (Megatron's default): N / (P·v) layers per stage.
- Megatron-LM's --decoder-first/last-pipeline-num-layers: the first (last) pipeline rank holds that many layers
  (over its v chunks equally), the middle ranks share the rest equally.
- Megatron-LM's --account-for-embedding/loss-in-pipeline-split: the embedding (loss) counts as one layer of the
  split of N + 1 (+ 1) layers, so the first (last) stage holds one transformer layer fewer.
- Megatron-Core's --pipeline-model-parallel-layout: one string naming each stage's parts ("E" embedding, "t" a
  transformer layer, "m" a multi-token-prediction depth, "L" the loss; "|" between stages, "," cosmetic, "x*n" and
  "(...)*n" repeat).
- DeepSpeed's PipelineModule partition_method over Megatron-DeepSpeed's GPTModelPipe layer list (a cast function,
  the embedding, the N layers, the final norm, the head — a tied EmbeddingPipe or LMHeadPipe — and, in 16 bits, a
  cast back): `uniform` splits the list's items evenly (the first stages one more), `parameters` and `type:REGEX`
  balance weights (each item's parameters; 1 for items whose class name the regex finds, 0 otherwise) by the
  linear partition that minimises the heaviest minus the lightest part.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal

from rapidtrain.core.errors import UserError

PipelineScheduleName = Literal["1f1b", "gpipe", "zero-bubble", "zbv", "dualpipev"]
SCHEDULES: tuple[str, ...] = ("1f1b", "gpipe", "zero-bubble", "zbv", "dualpipev")
V_SHAPED = ("zbv", "dualpipev")  # two stages per rank, rank r holding stages r and 2P-1-r
SPLIT_BACKWARD = ("zero-bubble", "zbv", "dualpipev")  # backward split into input and weight gradients


class SplitError(UserError):
    """A split the flags ask for that cannot be made; the message names the flags and the numbers."""


# ---- Megatron-LM ----


def megatron_split(num_layers: int, pipeline: int, virtual: int = 1, *, first: int | None = None,
                   last: int | None = None, embedding: bool = False, loss: bool = False) -> tuple[int, ...]:
    """Layers per stage (model order) of Megatron-LM's even, uneven first/last and embedding/loss-accounted splits."""
    if pipeline < 1 or virtual < 1:
        raise SplitError(f"--pipeline-model-parallel-size {pipeline} and virtual stages {virtual} must be ≥ 1")
    if (first is not None or last is not None) and (embedding or loss):
        raise SplitError("--decoder-first/last-pipeline-num-layers cannot be combined with "
                         "--account-for-embedding/loss-in-pipeline-split (as in Megatron-LM): give one of them")
    if first is not None or last is not None:
        per_rank = _first_last_per_rank(num_layers, pipeline, first, last)
    else:
        total = num_layers + embedding + loss
        if total % pipeline:
            accounted = " + 1 (embedding)" * embedding + " + 1 (loss)" * loss
            accounted += f" = {total}" if accounted else ""
            raise SplitError(f"--num-layers {num_layers}{accounted} is not divisible by "
                             f"--pipeline-model-parallel-size {pipeline}: each stage holds the same number of layers. "
                             "Change one of them, or give --decoder-first-pipeline-num-layers / "
                             "--decoder-last-pipeline-num-layers or --pipeline-model-parallel-layout for an uneven "
                             "split.")
        per_rank = [total // pipeline] * pipeline
    for rank, layers in enumerate(per_rank):
        if layers % virtual:
            raise SplitError(f"pipeline rank {rank} holds {layers} layers, not divisible by its {virtual} virtual "
                             "stages (--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-"
                             "rank): each virtual stage of a rank holds the same number of layers.")
    counts = [per_rank[rank] // virtual for _ in range(virtual) for rank in range(pipeline)]
    if embedding:
        counts[0] -= 1
    if loss:
        counts[-1] -= 1
    if min(counts) < 0:
        raise SplitError(f"--account-for-embedding/loss-in-pipeline-split with {num_layers} layers over "
                         f"{pipeline * virtual} stages leaves a stage fewer than no layers")
    return tuple(counts)


def _first_last_per_rank(num_layers: int, pipeline: int, first: int | None, last: int | None) -> list[int]:
    given = [n for n in (first, last) if n is not None]
    if any(n < 0 for n in given):
        raise SplitError("--decoder-first/last-pipeline-num-layers must be ≥ 0")
    if pipeline < 2:
        raise SplitError("--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size ≥ 2")
    if pipeline == 2 and len(given) == 2 and first is not None and last is not None and first + last != num_layers:
        raise SplitError(f"--decoder-first-pipeline-num-layers {first} + --decoder-last-pipeline-num-layers {last} "
                         f"≠ --num-layers {num_layers} over 2 stages")
    middle_ranks = pipeline - len(given)
    rest = num_layers - sum(given)
    names = " and ".join(f"--decoder-{w}-pipeline-num-layers {n}" for w, n in (("first", first), ("last", last))
                         if n is not None)
    if rest < 0 or (middle_ranks and rest % middle_ranks) or (not middle_ranks and rest):
        raise SplitError(f"{names} leave {rest} of --num-layers {num_layers} for the other {middle_ranks} pipeline "
                         f"ranks of --pipeline-model-parallel-size {pipeline}, which must share them equally. "
                         "Change the numbers so that they divide.")
    middle = rest // middle_ranks if middle_ranks else 0
    per_rank = [middle] * pipeline
    if first is not None:
        per_rank[0] = first
    if last is not None:
        per_rank[-1] = last
    return per_rank


# ---- Megatron-Core's layout string ----


def parse_layout(text: str) -> list[str]:
    """Each stage's parts as a string of E/t/m/L, in model order, from Megatron-Core's layout syntax."""
    expanded = text.replace(",", "").replace(" ", "")
    group = re.compile(r"\(([^()]*)\)\*(\d+)")
    while group.search(expanded):
        expanded = group.sub(lambda m: m.group(1) * int(m.group(2)), expanded)
    expanded = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), expanded)
    bad = sorted(set(expanded) - set("EtmL|"))
    if bad:
        raise SplitError(f"--pipeline-model-parallel-layout {text!r}: unknown part(s) {', '.join(map(repr, bad))}; "
                         "the parts are E (embedding), t (transformer layer), m (MTP depth), L (loss), '|' between "
                         "stages, 'x*n' and '(...)*n' repeats")
    return expanded.split("|")


def layout_split(text: str, pipeline: int, num_layers: int, mtp_layers: int = 0) -> tuple[int, ...]:
    """Layers per stage of a layout string, checked as Megatron-Core checks it and for what rapidtrain's stages hold:
    the embedding on the first stage and the loss (with any MTP depths) on the last."""
    stages = parse_layout(text)
    flag = f"--pipeline-model-parallel-layout {text!r}"
    if len(stages) % pipeline:
        raise SplitError(f"{flag} has {len(stages)} stages, not a multiple of --pipeline-model-parallel-size "
                         f"{pipeline}")
    joined = "".join(stages)
    if joined.count("E") != 1 or not stages[0].startswith("E"):
        raise SplitError(f"{flag}: the embedding E must appear once, first, on the first stage")
    if joined.count("L") != 1 or not stages[-1].endswith("L"):
        raise SplitError(f"{flag}: the loss L must appear once, last, on the last stage")
    if joined.count("t") != num_layers:
        raise SplitError(f"{flag} places {joined.count('t')} transformer layers (t), but --num-layers is "
                         f"{num_layers}")
    if joined.count("m") != mtp_layers:
        raise SplitError(f"{flag} places {joined.count('m')} MTP depths (m), but --mtp-num-layers is {mtp_layers}")
    if "m" in "".join(stages[:-1]) or ("m" in stages[-1] and "t" in stages[-1].split("m", 1)[1]):
        raise SplitError(f"{flag}: rapidtrain runs the MTP depths (m) on the last stage, after its layers; put every "
                         "m in the last stage before L")
    empty = [s for s, parts in enumerate(stages) if not parts]
    if empty:
        raise SplitError(f"{flag}: stage(s) {', '.join(map(str, empty))} hold nothing; every stage needs a layer, "
                         "the embedding or the loss")
    return tuple(parts.count("t") for parts in stages)


# ---- DeepSpeed's PipelineModule partitioning ----


def deepspeed_units(num_layers: int, *, tied: bool, rmsnorm: bool, sixteen_bit: bool,
                    embedding_parameters: int = 0, layer_parameters: Sequence[int] = (), norm_parameters: int = 0,
                    head_parameters: int = 0) -> list[tuple[str, int]]:
    """Megatron-DeepSpeed's GPTModelPipe layer list as (class or function name, parameters)."""
    layers = list(layer_parameters) or [0] * num_layers
    units = [("_to_float16", 0), ("EmbeddingPipe", embedding_parameters)]
    units += [("ParallelTransformerLayerPipe", n) for n in layers]
    units += [("MixedFusedRMSNorm" if rmsnorm else "LayerNorm", norm_parameters),
              ("EmbeddingPipe" if tied else "LMHeadPipe", head_parameters)]
    return units + ([("float16_to_fp32", 0)] if sixteen_bit else [])


def uniform_boundaries(items: int, parts: int) -> list[int]:
    """DeepSpeed's uniform partition: boundaries of `parts` runs of `items`, the first runs one longer."""
    if items <= parts:
        return [min(p, items) for p in range(parts + 1)]
    size, extra = divmod(items, parts)
    return [p * size + min(p, extra) for p in range(parts + 1)]


def balanced_boundaries(weights: Sequence[float], parts: int) -> list[int]:
    """DeepSpeed's balanced partition (its dynamic programme for the linear partition problem): the boundaries whose
    parts' heaviest minus lightest is smallest, extending the best split of each prefix; on ties the later cut."""
    n = len(weights)
    if n <= parts:
        return uniform_boundaries(n, parts)
    prefix = [0.0]
    for weight in weights:
        prefix.append(prefix[-1] + weight)
    inf = float("inf")
    # best[i][j] = (cost, heaviest, lightest, cut) of the first i items in j parts
    best = [[(inf, inf, inf, 0)] * (parts + 1) for _ in range(n + 1)]
    best[0][0] = (0.0, 0.0, inf, 0)
    for i in range(1, n + 1):
        for j in range(1, min(i, parts) + 1):
            chosen = best[i][j]
            for k in range(i):
                _, heaviest, lightest, _ = best[k][j - 1]
                part = prefix[i] - prefix[k]
                high, low = max(heaviest, part), min(lightest, part)
                if chosen[0] >= high - low:
                    chosen = (high - low, high, low, k)
            best[i][j] = chosen
    cuts = [n]
    for j in range(parts, 0, -1):
        cuts.append(best[cuts[-1]][j][3])
    return cuts[::-1]


def deepspeed_split(method: str, units: Sequence[tuple[str, int]], pipeline: int) -> tuple[int, ...]:
    """Transformer layers per stage of DeepSpeed's partition_method over `units`; the embedding must land on the
    first stage and the final norm and head on the last, where rapidtrain's stages keep them."""
    flag = f"--pp-partition-method {method}"
    kind = method.lower()
    if kind == "uniform":
        cuts = uniform_boundaries(len(units), pipeline)
    elif kind == "parameters":
        cuts = balanced_boundaries([n for _, n in units], pipeline)
    elif kind.startswith("type:"):
        try:
            pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        except re.error as error:
            raise SplitError(f"{flag}: not a regular expression ({error})") from None
        weights = [1 if pattern.search(name) else 0 for name, _ in units]
        if not any(weights):
            raise SplitError(f"{flag} matches none of the model's layers ({', '.join(sorted({n for n, _ in units}))})")
        cuts = balanced_boundaries(weights, pipeline)
    else:
        raise SplitError(f"{flag}: DeepSpeed's methods are uniform, parameters and type:REGEX")
    names = [name for name, _ in units]
    stage_of = {i: s for s in range(pipeline) for i in range(cuts[s], cuts[s + 1])}
    embedding, head = names.index("EmbeddingPipe"), _head_index(names)
    norm = head - 1
    if stage_of[embedding] != 0 or stage_of[norm] != pipeline - 1 or stage_of[head] != pipeline - 1:
        raise SplitError(f"{flag} over {pipeline} stages puts the embedding on stage {stage_of[embedding]} and the "
                         f"final norm and head on stages {stage_of[norm]}, {stage_of[head]}; rapidtrain keeps them "
                         "on the first and last stage. Choose another method or --pipeline-model-parallel-size.")
    counts = [sum(1 for i in range(cuts[s], cuts[s + 1]) if names[i] == "ParallelTransformerLayerPipe")
              for s in range(pipeline)]
    empty = [s for s, c in enumerate(counts) if c == 0 and 0 < s < pipeline - 1]
    if empty:
        raise SplitError(f"{flag} over {pipeline} stages leaves stage(s) {', '.join(map(str, empty))} without "
                         "layers. Choose another method or a smaller --pipeline-model-parallel-size.")
    return tuple(counts)


def _head_index(names: list[str]) -> int:
    return max(i for i, name in enumerate(names) if name in ("EmbeddingPipe", "LMHeadPipe"))


# ---- schedules ----


def stages_of_rank(rank: int, pipeline: int, virtual: int, schedule: str) -> list[int]:
    """The stages pipeline rank `rank` runs: Megatron's interleaving (chunk·P + rank), or the V (rank, 2P-1-rank)."""
    if schedule in V_SHAPED:
        return [rank, 2 * pipeline - 1 - rank]
    return [chunk * pipeline + rank for chunk in range(virtual)]


def rank_of_stage(stage: int, pipeline: int, schedule: str) -> int:
    if schedule in V_SHAPED:
        return stage if stage < pipeline else 2 * pipeline - 1 - stage
    return stage % pipeline


def bubble_fraction(schedule: str, stages: int, micro_batches: int, virtual: int = 1) -> float:
    """The pipeline's idle time over its useful time, with forward, input-gradient and weight-gradient passes of
    equal length (the zero-bubble paper's model, Qi et al. 2024): 1F1B (p - 1)/m, interleaved (p - 1)/(v·m); GPipe
    as 1F1B; ZB-H1 a third of 1F1B's (its bubble (p - 1)·(F + B - W) with F = B = W); the interleaved ZB1P, ZBV
    and DualPipeV fill their bubbles with weight passes once there are enough micro-batches (ZB1P: m ≥ p; ZBV and
    DualPipeV: m ≥ 2p), which leaves their warm-up's one forward per extra stage: (p - 1)/(3·v·m)."""
    p, m, v = stages, max(micro_batches, 1), max(virtual, 1)
    if p <= 1:
        return 0.0
    if schedule in ("1f1b", "gpipe"):
        return (p - 1) / (v * m)
    if schedule == "zero-bubble" and v == 1:
        return (p - 1) / (3 * m)
    enough = m >= (2 * p if schedule in V_SHAPED else p)
    return (p - 1) / (3 * v * m) if enough else (p - 1) / (v * m)


def schedule_title(schedule: str, virtual: int) -> str:
    """The schedule's name in the plan."""
    if schedule == "1f1b":
        return "interleaved 1F1B" if virtual > 1 else "1F1B"
    if schedule == "zero-bubble":
        return "interleaved zero bubble (ZB1P)" if virtual > 1 else "zero bubble ZB-H1"
    return {"gpipe": "GPipe", "zbv": "zero bubble V (ZBV)", "dualpipev": "DualPipeV"}[schedule]
