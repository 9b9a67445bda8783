"""Property tests of rapidtrain's short-sequence attention (models/attention.py's short_attention) over drawn calls:
batch 1-3, 1-6 heads over query groups that divide them (MHA, GQA, MQA), 1-70 tokens, odd head sizes and MLA's value
size, causal / unmasked / packed documents with resets (documents of one token, padding rows the mask empties) /
one random mask for the batch, contiguous, transposed (the models' [b, s, heads, d] view) and sliced (MLA's split)
inputs, gradients asked of any subset of q, k, v, grad mode, no_grad and inference_mode: forward and backward
against fp64 SDPA (math) and, with dropout, against an fp64 eager attention under the very mask the kernel drew
(drawn again from the same seed). Then the dropout's statistics read off the output, the plan's choice against what
runs in a built model, and the plan's bytes against what the layer keeps, with and without recompute."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from rapidtrain.config import arguments, rules
from rapidtrain.config.activations import layer_bytes
from rapidtrain.config.memory import activation_context, short_attention_planned
from rapidtrain.config.plan import from_args
from rapidtrain.config.resolve import switches_of
from rapidtrain.config.settings import Layout, Precision, RecomputeSettings, RunContext
from rapidtrain.models import build_model
from rapidtrain.models.attention import attend, short_attention
from rapidtrain.models.config import ModelConfig
from rapidtrain.models.dropout import keep_mask
from rapidtrain.parallel.recompute import count_saved_activations, wrapper_for
from rapidtrain.parallel.runner import autocast

# Tiny drawn calls, derandomized so that a failure reproduces on every run; the file runs in a few seconds.
BOUNDED = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.too_slow])
DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class Call:
    b: int
    heads: int
    groups: int
    s: int
    d: int
    dv: int
    kind: str  # causal, none, documents, padded_documents, shared
    layout: str  # contiguous, transposed, sliced
    dtype: str
    wants_grad: tuple[bool, bool, bool]  # of q, k, v
    mode: str  # grad, no_grad, inference
    seed: int


@st.composite
def calls(draw, dtypes=("fp64", "fp32", "bf16")) -> Call:
    groups = draw(st.integers(1, 3))
    heads = groups * draw(st.integers(1, 6 // groups))
    d = draw(st.sampled_from([1, 3, 5, 8, 16]))
    return Call(b=draw(st.integers(1, 3)), heads=heads, groups=groups, s=draw(st.integers(1, 70)), d=d,
                dv=draw(st.sampled_from([d, 4, 7])),
                kind=draw(st.sampled_from(["causal", "none", "documents", "padded_documents", "shared"])),
                layout=draw(st.sampled_from(["contiguous", "transposed", "sliced"])),
                dtype=draw(st.sampled_from(dtypes)), wants_grad=draw(st.tuples(*[st.booleans()] * 3)),
                mode=draw(st.sampled_from(["grad", "grad", "no_grad", "inference"])), seed=draw(st.integers(0, 2**16)))


def mask_of(call: Call) -> tuple[torch.Tensor | None, bool]:
    """(bool mask, True = may attend; is_causal) of the call's kind, drawn from its seed."""
    b, s = call.b, call.s
    generator = torch.Generator().manual_seed(call.seed)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    if call.kind == "causal":
        return None, True
    if call.kind == "none":
        return None, False
    if call.kind == "shared":  # one random mask for the batch and heads: rows it empties included
        return torch.rand(s, s, generator=generator) < 0.6, False
    # packed documents: a reset before ~30% of the tokens and before the last one (a document of one token)
    starts = torch.rand(b, s, generator=generator) < 0.3
    starts[:, 0] = starts[:, -1] = True
    documents = starts.cumsum(1)
    mask = causal & (documents[:, :, None] == documents[:, None, :])
    if call.kind == "padded_documents":  # padding queries that see nothing
        mask &= ~(torch.rand(b, s, 1, generator=generator) < 0.25)
    return mask[:, None], False


def inputs_of(call: Call) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(the leaves gradients are asked of, [q, k, v] in the call's layout, built from them)."""
    generator = torch.Generator().manual_seed(call.seed)
    leaves, views = [], []
    for n, width, wants in zip((call.heads, call.groups, call.groups), (call.d, call.d, call.dv), call.wants_grad,
                               strict=True):
        shape = {"contiguous": (call.b, n, call.s, width), "transposed": (call.b, call.s, n, width),
                 "sliced": (call.b, n, call.s, width + 3)}[call.layout]
        leaf = torch.randn(shape, generator=generator, dtype=torch.float64).to(DTYPES[call.dtype])
        leaf.requires_grad_(wants)
        view = {"contiguous": leaf, "transposed": leaf.transpose(1, 2), "sliced": leaf[..., :width]}[call.layout]
        leaves.append(leaf)
        views.append(view)
    return leaves, views


def sdpa_reference(q, k, v, mask, is_causal):
    """fp64 SDPA math with grouped-query heads; rows the mask empties give zeros (its safe softmax)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=True)
    return out, (q, k, v)


def eager_reference(q, k, v, mask, is_causal, keep, kept_scale):
    """fp64 softmax(QKᵀ/√d)V written out, the probabilities times `keep` [b, heads, s, s] and `kept_scale`."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    repeat = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(repeat, 1).transpose(-2, -1) * q.shape[-1] ** -0.5
    s = q.shape[2]
    allowed = torch.ones(s, s, dtype=torch.bool).tril() if is_causal else mask
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = scores.softmax(-1).nan_to_num(0.0)
    return (probs * keep * kept_scale) @ v.repeat_interleave(repeat, 1), (q, k, v)


def run(call: Call, views: list[torch.Tensor], mask, is_causal, dropout_p: float = 0.0) -> torch.Tensor:
    if call.mode == "no_grad":
        with torch.no_grad():
            return short_attention(*views, mask, is_causal, dropout_p)
    if call.mode == "inference":
        with torch.inference_mode():
            return short_attention(*views, mask, is_causal, dropout_p)
    return short_attention(*views, mask, is_causal, dropout_p)


def assert_matches(call: Call, leaves, views, out, expected, expected_inputs) -> None:
    """The output and the asked gradients (of the leaves) against the fp64 reference's, to the dtype's accuracy:
    fp64 to rounding, fp32 to 1e-4 of the largest exact value, bf16 (scores rounded to bf16 once, as Megatron's
    unfused attention) to 2⁻⁵ of it: a wrong mask, head or group moves a value by its own size."""
    tolerance = {"fp64": 1e-10, "fp32": 1e-4, "bf16": 2 ** -5}[call.dtype]

    def close(actual: torch.Tensor, exact: torch.Tensor, name: str) -> None:
        assert actual.shape == exact.shape and actual.dtype == DTYPES[call.dtype], name
        error = (actual.double() - exact).abs().max().item()
        assert error <= tolerance * max(1.0, exact.abs().max().item()), (name, error, call)

    close(out, expected, "out")
    if call.mode != "grad":
        assert not out.requires_grad
        return
    if not any(call.wants_grad):
        return
    grad = torch.randn(expected.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(call.seed + 1))
    asked = [i for i, wants in enumerate(call.wants_grad) if wants]
    got = torch.autograd.grad(out, [leaves[i] for i in asked], grad.to(out.dtype))
    exact = torch.autograd.grad(expected, [expected_inputs[i] for i in asked], grad)
    for i, actual, reference_grad in zip(asked, got, exact, strict=True):
        view = {"contiguous": actual, "transposed": actual.transpose(1, 2),
                "sliced": actual[..., :views[i].shape[-1]]}[call.layout]
        close(view, reference_grad, ("dq", "dk", "dv")[i])
        if call.layout == "sliced":  # the columns the slice leaves out get no gradient
            assert not actual[..., views[i].shape[-1]:].any()


@BOUNDED
@given(calls())
def test_matches_sdpa_forward_and_backward(call: Call):
    """Output and asked gradients against fp64 SDPA's, over every drawn shape, mask, layout, dtype and grad mode."""
    leaves, views = inputs_of(call)
    mask, is_causal = mask_of(call)
    out = run(call, views, mask, is_causal)
    expected, expected_inputs = sdpa_reference(*views, mask, is_causal)
    assert_matches(call, leaves, views, out, expected, expected_inputs)


@BOUNDED
@given(calls(dtypes=("fp64",)), st.sampled_from([1e-6, 0.1, 0.5, 0.999]))
def test_dropout_matches_eager_attention_under_the_mask_it_drew(call: Call, dropout_p: float):
    """With dropout the kernel's output and gradients are eager attention's under keep_mask's draw from the same
    torch seed (one draw of [b · groups, heads/groups · s, s], the heads of a group stacked as rows): the forward's
    mask is the one backward uses, and the same seed draws the same mask."""
    leaves, views = inputs_of(call)
    mask, is_causal = mask_of(call)
    torch.manual_seed(call.seed)
    out = run(call, views, mask, is_causal, dropout_p)
    torch.manual_seed(call.seed)
    stacked = (call.b * call.groups, call.heads // call.groups * call.s, call.s)
    keep, kept_scale = keep_mask(stacked, dropout_p, torch.device("cpu"))
    keep = keep.view(call.b, call.heads, call.s, call.s)
    expected, expected_inputs = eager_reference(*views, mask, is_causal, keep, kept_scale)
    assert_matches(call, leaves, views, out, expected, expected_inputs)
    torch.manual_seed(call.seed)
    assert torch.equal(run(call, views, mask, is_causal, dropout_p), out)


@pytest.mark.parametrize("dropout_p", [1e-6, 0.1, 0.5, 0.999])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_keeps_its_share_and_scales_by_the_inverse(dropout_p, dtype):
    """Zero queries and keys (every probability 1/s) over the identity as values: the output is the mask times
    its scale / s, read off directly. The kept share is 1 - p within 5 binomial standard errors over 2¹⁶ draws, the
    kept values carry exactly 65536 / round((1 - p) · 65536) (≈ 1/(1 - p)), a tiny p keeps every probability (the
    output equals the undropped one bitwise), the same seed repeats the output and another seed does not."""
    b, heads, s = 4, 4, 64
    q = torch.zeros(b, heads, s, 8, dtype=dtype)
    v = torch.eye(s, dtype=dtype).expand(b, 2, s, s)
    torch.manual_seed(1)
    out = short_attention(q, q[:, :2], v, None, False, dropout_p)
    kept = out != 0
    share = kept.double().mean().item()
    keep_levels = round((1 - dropout_p) * 65536)
    error = (dropout_p * (1 - dropout_p) / kept.numel()) ** 0.5
    assert abs(share - keep_levels / 65536) <= 5 * error + 1e-12, share
    expected = torch.tensor(65536 / keep_levels / s, dtype=torch.float64).to(dtype)
    assert torch.equal(out[kept], expected.expand(int(kept.sum())))
    torch.manual_seed(1)
    assert torch.equal(short_attention(q, q[:, :2], v, None, False, dropout_p), out)
    if keep_levels == 65536:  # p < 2⁻¹⁷: the nearest keep probability is 1
        assert torch.equal(out, short_attention(q, q[:, :2], v, None, False, 0.0))
    else:
        assert not torch.equal(short_attention(q, q[:, :2], v, None, False, dropout_p), out)


def test_an_empty_batch_or_sequence_gives_an_empty_output_as_sdpa():
    for b, s in ((0, 5), (2, 0)):
        q = torch.randn(b, 4, s, 8, requires_grad=True)
        k = torch.randn(b, 2, s, 8, requires_grad=True)
        out = short_attention(q, k, k, None, True, 0.1)
        assert out.shape == F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True).shape
        out.sum().backward()
        assert q.grad is not None and q.grad.shape == q.shape


def test_a_second_derivative_is_refused_not_computed_wrong():
    """Backward computes from the kept probabilities as constants, so a gradient to be differentiated again (a
    gradient penalty in a user script) is refused, as SDPA's CPU flash kernel refuses it, instead of the wrong
    second derivative it gave (gradgradcheck: a Jacobian mismatch)."""
    q = torch.randn(1, 2, 4, 3, dtype=torch.float64, requires_grad=True)
    out = short_attention(q, q[:, :1], q[:, :1], None, True, 0.0)
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.grad(out.square().sum(), q, create_graph=True)


class _CoreRecorder(TorchFunctionMode):
    """Records which attention core each call ran: short_attention and SDPA both answer torch-function modes."""

    def __init__(self) -> None:
        super().__init__()
        self.cores: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is short_attention:
            self.cores.add("short")
        elif func is F.scaled_dot_product_attention:
            self.cores.add("sdpa")
        return func(*args, **(kwargs or {}))


SMALL = ("--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 32 "
         "--micro-batch-size 2 --train-iters 2 --lr 1e-3 --vocab-size 64 --hidden-dropout 0").split()
MLA = ["--multi-latent-attention", "--position-embedding-type", "rope", "--qk-head-dim", "8", "--qk-pos-emb-head-dim",
       "4", "--v-head-dim", "12", "--kv-lora-rank", "16"]


SHAPES = {"plain": [], "mla": MLA, "alibi": ["--position-embedding-type", "alibi"],
          "sinks": ["--softmax-type", "learnable"],
          "gqa_rope_qk_norm": ["--group-query-attention", "--num-query-groups", "2", "--position-embedding-type",
                               "rope", "--qk-layernorm"]}
# (shape, precision flags, attention dropout): each precision and dropout plainly, and where each other shape could
# turn the choice (bf16 without dropout, fp32 with it)
PLAN_CASES = [("plain", precision, dropout) for precision in ([], ["--bf16"], ["--fp16"]) for dropout in ("0", "0.1")]
PLAN_CASES += [(shape, precision, dropout) for shape in ("mla", "alibi", "sinks", "gqa_rope_qk_norm")
               for precision, dropout in ((["--bf16"], "0"), ([], "0.1"))]


@pytest.mark.parametrize(("shape", "precision", "dropout"), PLAN_CASES,
                         ids=[f"{shape}-{precision[0][2:] if precision else 'fp32'}-dropout{dropout}"
                              for shape, precision, dropout in PLAN_CASES])
def test_the_plan_names_the_kernel_a_training_step_runs(shape, precision, dropout):
    """The plan's short_attention_planned (the memory estimate's and the plan's description's answer) against the
    attention core a built model's training step really calls, under the run's autocast; and the plan's line says
    that kernel, in the run's dtype (it said "bf16 matmuls, the scores rounded to bf16" of fp32 runs too)."""
    args = arguments.parse_args([*SMALL, *SHAPES[shape], *precision, "--attention-dropout", dropout])
    ctx = RunContext(world_size=1)
    rules.validate(args, ctx)
    plan = from_args(args, ctx)
    model = build_model(plan.model, seed=1).train()
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    recorder = _CoreRecorder()
    with recorder, autocast(plan.precision, "cpu"):
        loss = model(tokens[:, :-1], None, None, tokens[:, 1:]).float().mean()
    loss.backward()
    planned = short_attention_planned(plan.model, plan.precision, plan.layout, "cpu")
    assert recorder.cores == ({"short"} if planned else {"sdpa"})
    said = plan.engine_for("--attention-backend")
    assert planned == (said is not None and "short-sequence attention" in said.engine)
    if planned:  # in the run's dtype: an fp32 run with attention dropout rounds nothing to bf16
        assert f"batched {plan.precision.dtype} matmuls" in said.engine
        assert ("rounded to bf16" in said.engine) == (plan.precision.dtype == "bf16")


def _attention_core_bytes(dtype: torch.dtype, dropout_p: float) -> int:
    """Bytes of the storages autograd keeps from one causal grouped-query attend call, beyond q, k and v."""
    b, heads, groups, s, d = 2, 4, 2, 32, 8
    q = torch.randn(b, heads, s, d, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(b, groups, s, d, dtype=dtype, requires_grad=True) for _ in range(2))
    inputs = {t.untyped_storage().data_ptr() for t in (q, k, v)}
    saved: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.untyped_storage().data_ptr() not in inputs:
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        attend(q, k, v, None, True, dropout_p, "auto")
    return sum(saved.values())


@pytest.mark.parametrize(("dtype", "dropout_p"), [("bf16", 0.0), ("bf16", 0.1), ("fp32", 0.1)])
def test_the_plan_counts_the_bytes_the_kernel_keeps(dtype, dropout_p):
    """The plan's score bytes per layer (config/activations.py: those of an activation context that keeps the
    scores, less one that keeps none) equal, byte for byte, what autograd keeps from the short kernel's call:
    the probabilities in the inputs' dtype and, with dropout, one byte of keep-mask each."""
    model = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2, seq_length=32,
                        vocab_size=64, max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=dropout_p)
    one = Layout(world_size=1, data_parallel_size=1)
    switches = switches_of(arguments.parse_args(["--train-iters", "1", "--lr", "1e-3"]), one, RunContext())
    act = activation_context(model, Precision(dtype, "none", ""), one, switches, "cpu")
    assert act.short_attention
    planned = layer_bytes(model, 2, one, act) - layer_bytes(
        model, 2, one, dataclasses.replace(act, scores_kept=False, short_attention=False))
    assert _attention_core_bytes(DTYPES[dtype], dropout_p) == planned


@pytest.mark.parametrize("granularity", ["none", "selective", "op", "full"])
def test_a_layer_keeps_what_the_plan_counts_and_recomputes_the_same_masks(granularity):
    """One fp32 layer with attention (and hidden) dropout, the short kernel's configuration at any length: what its
    forward leaves alive for backward (recompute.py's count_saved_activations: its output out, its input in) is the
    plan's layer_bytes within 2% at every recompute granularity, and the recomputing layer's output and gradients
    equal the plain layer's bitwise (the masks drawn again in the recomputation are the forward's)."""
    s = 48
    config = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2, seq_length=s,
                         vocab_size=128, max_position_embeddings=s, hidden_dropout=0.1, attention_dropout=0.2)
    one = Layout(world_size=1, data_parallel_size=1)
    switches = switches_of(arguments.parse_args(["--train-iters", "1", "--lr", "1e-3"]), one, RunContext())
    act = activation_context(config, Precision("fp32", "none", ""), one, switches, "cpu")
    assert act.short_attention
    x = torch.randn(2, s, 64, generator=torch.Generator().manual_seed(1))

    def forward_backward(granularity: str) -> tuple[int, torch.Tensor, list[torch.Tensor]]:
        layer = build_model(config, seed=3).layers["0"].train()
        module = layer if granularity == "none" else wrapper_for(RecomputeSettings(granularity=granularity))(layer)
        torch.manual_seed(9)
        with count_saved_activations(layer.parameters()) as measured:
            out = module(x)
        # the layer's input, made before the count began, is kept too (the plan counts it)
        kept = measured["bytes"] - out.untyped_storage().nbytes() + x.untyped_storage().nbytes()
        out.square().mean().backward()
        return kept, out.detach(), [p.grad for p in layer.parameters()]

    kept, out, grads = forward_backward(granularity)
    assert kept == pytest.approx(layer_bytes(config, 2, one, act, granularity), rel=0.02)
    if granularity != "none":
        _, plain_out, plain_grads = forward_backward("none")
        assert torch.equal(out, plain_out)
        for plain, recomputed in zip(plain_grads, grads, strict=True):
            assert torch.equal(plain, recomputed)
