"""--attention-backend: the kernel each name runs, the refusals, numerical agreement of the CPU kernels with SDPA's
math kernel, equal training losses, and --reset-attention-mask through FlexAttention's block-sparse mask."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask

from rapidtrain.config import arguments, rules
from rapidtrain.config.plan import from_args
from rapidtrain.config.settings import RunContext
from rapidtrain.data.gpt_dataset import ltor_masks_and_position_ids
from rapidtrain.models import build_model
from rapidtrain.models.attention import attend, flex_block_mask
from rapidtrain.models.attention_backends import NAMES, SHORT_KERNEL_MAX_KEYS, resolve
from rapidtrain.models.config import ModelConfig
from rapidtrain.train.engine import Engine
from rapidtrain.train.trainer import Trainer

CPU_TRAINING_BACKENDS = ("auto", "sdpa", "flash", "flash_attention_2", "unfused", "local", "eager")
CPU_KERNELS = ("sdpa", "sdpa_flash", "eager", "flex")  # flex: forward only on CPU


def with_length(flags: tuple[str, ...]) -> list[str]:
    return ["--lr", "1e-3", *(["--epochs", "1"] if "--task" in flags else ["--train-iters", "2"]), *flags]


def plan_of(*flags: str, device: str = "cpu"):
    args = arguments.parse_args(with_length(flags))
    ctx = RunContext(device_type=device)
    rules.validate(args, ctx)
    return from_args(args, ctx)


def refusal(*flags: str, device: str = "cpu") -> str:
    args = arguments.parse_args(with_length(flags))
    with pytest.raises(rules.FlagConflict) as conflict:
        rules.validate(args, RunContext(device_type=device))
    return str(conflict.value)


def test_the_flag_takes_megatron_and_hugging_face_names():
    assert arguments.ATTENTION_BACKENDS == NAMES
    assert arguments.parse_args([]).attention_backend == "auto"  # Megatron's default


@pytest.mark.parametrize(("name", "kernel"), [
    ("auto", "auto"), ("sdpa", "sdpa"), ("flash", "sdpa_flash"), ("flash_attention_2", "sdpa_flash"),
    ("unfused", "eager"), ("local", "eager"), ("eager", "eager")])
def test_built_in_model_runs_the_kernel_the_name_chooses(name, kernel):
    plan = plan_of("--attention-backend", name, "--attention-dropout", "0")
    assert plan.attention.kernel == kernel and plan.model.attention_kernel == kernel
    choice = plan.engine_for("--attention-backend")
    assert choice is not None and f"--attention-backend {name}:" in choice.reason
    model = build_model(plan.model, seed=1)
    assert {layer.attention.kernel for layer in model.layers.values()} == {kernel}


def test_cuda_kernels_are_planned_on_cuda():
    plan = plan_of("--attention-backend", "fused", "--bf16", device="cuda")
    assert plan.model.attention_kernel == "sdpa_cudnn"
    assert "CUDNN_ATTENTION" in plan.engine_for("--attention-backend").engine
    flex = plan_of("--attention-backend", "flex_attention", "--attention-dropout", "0", "--reset-attention-mask",
                   device="cuda")
    assert flex.attention.document_ids and "BlockMask from document ids" in flex.engine_for(
        "--attention-backend").engine


def test_plan_is_silent_about_the_default_backend_where_sdpa_serves_it():
    """auto under torch SDPA (fp32 without attention dropout, CUDA) needs no line; where it runs rapidtrain's
    short-sequence kernel (a CPU with the default attention dropout of 0.1, or bf16) the plan says so and why."""
    assert plan_of("--attention-dropout", "0").engine_for("--attention-backend") is None
    assert plan_of("--bf16", device="cuda").engine_for("--attention-backend") is None
    for flags in ((), ("--bf16", "--attention-dropout", "0")):
        choice = plan_of(*flags).engine_for("--attention-backend")
        assert choice is not None and "short-sequence attention" in choice.engine, flags
        assert "Megatron's auto" in choice.reason


@pytest.mark.parametrize(("flags", "device", "says"), [
    (("--attention-backend", "fused"), "cpu", "cuDNN's fused attention, a CUDA kernel"),
    (("--attention-backend", "flash"), "cpu", "pass --attention-dropout 0"),
    (("--attention-backend", "flex_attention", "--attention-dropout", "0"), "cpu", "no backward pass on CPU"),
    (("--attention-backend", "flex_attention", "--attention-dropout", "0.1"), "cuda", "no attention dropout"),
    (("--attention-backend", "flash"), "cuda", "add --bf16 or --fp16"),
    (("--attention-backend", "flash", "--bf16", "--reset-attention-mask"), "cuda", "takes no attention mask"),
])
def test_backend_the_device_cannot_run_is_refused_with_the_fix(flags, device, says):
    message = refusal(*flags, device=device)
    assert "--attention-backend" in message and says in message


def test_hugging_face_models_take_attn_implementation(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from rapidtrain.tasks import build_task, load_task_model, toy

    folder = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)).save_pretrained(folder)
    flags = ("--task", "casual_lm", "--pretrained-model-name-or-path", str(folder))
    assert plan_of(*flags, "--attention-backend", "local").attention.hf_implementation == "eager"
    assert "flash_attn package" in refusal(*flags, "--attention-backend", "flash_attention_2")
    assert "a Hugging Face model takes" in refusal(*flags, "--attention-backend", "fused")
    tokenizer = toy.train_tokenizer(toy.texts_of(toy.text_records(20, seed=0)), tmp_path / "tok", vocab_size=64)
    task = build_task("casual_lm", tokenizer, 16)
    for implementation in ("eager", "sdpa"):
        model = load_task_model(task, str(folder), attn_implementation=implementation)
        assert model.config._attn_implementation == implementation


def random_qkv(heads: int = 4, groups: int = 2, s: int = 40, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, s, 16, generator=generator)
    k, v = (torch.randn(2, groups, s, 16, generator=generator) for _ in range(2))
    return q, k, v


def math_reference(q, k, v, mask, is_causal):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=True)


@pytest.mark.parametrize("kernel", CPU_KERNELS)
def test_cpu_kernels_match_sdpa_math(kernel):
    """fp32, grouped-query (4 heads over 2 groups), causal and a padded causal mask: within 1e-5."""
    q, k, v = random_qkv()
    s = q.shape[2]
    padding = torch.ones(2, s, dtype=torch.bool)
    padding[1, 30:] = False
    dense = padding[:, None, None, :] & torch.ones(s, s, dtype=torch.bool).tril() | torch.eye(s, dtype=torch.bool)
    for mask, is_causal, flex_mask in (
            (None, True, lambda: flex_block_mask(2, s, s, q.device, causal=True)),
            (dense, False, lambda: flex_block_mask(2, s, s, q.device, causal=True, attention_mask=padding))):
        expected = math_reference(q, k, v, mask, is_causal)
        given = flex_mask() if kernel == "flex" else mask
        out = attend(q, k, v, given, is_causal and kernel != "flex", 0.0, kernel)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


class TinyTrainer(Trainer):
    def run_forward_step(self, data_iterator, model):
        batch = next(data_iterator)
        losses = model(batch["tokens"], labels=batch["labels"])
        return losses, lambda per_token: (per_token.sum(), torch.tensor(float(per_token.numel())))


def test_tiny_gpt_trains_three_steps_with_equal_losses_on_every_cpu_backend():
    """fp32, no dropout, grouped-query attention: every backend the CPU trains with gives the default's losses
    within 1e-5 (relative) over three optimizer steps."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 128, (4, 33), generator=generator)
    batches = [[{"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}]] * 3  # one batch thrice: the loss falls
    losses = {}
    for name in CPU_TRAINING_BACKENDS:
        engine = Engine(argv=["--train-iters", "3", "--lr", "1e-3", "--num-layers", "2", "--hidden-size", "64",
                              "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "4",
                              "--global-batch-size", "4", "--hidden-dropout", "0", "--attention-dropout", "0",
                              "--group-query-attention", "--num-query-groups", "2", "--attention-backend", name])
        trainer = TinyTrainer(engine)
        config = ModelConfig(**{**engine.plan.model.__dict__, "vocab_size": 128})
        trainer.model, *_ = engine.compose(build_model(config, seed=7))
        losses[name] = [float(trainer.train_step(batch).loss) for batch in batches]
    for name, values in losses.items():
        assert values == pytest.approx(losses["auto"], rel=1e-5), name
    assert losses["auto"][2] < losses["auto"][0]


def packed_tokens(s: int = 64, eod: int = 0, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 128, size=(2, s + 1))
    tokens[0, [10, 30, 31, 50]] = eod  # documents of 11, 20, 1, 19 and 14 tokens
    tokens[1, [40]] = eod
    return tokens


def test_reset_attention_mask_through_a_block_mask_gives_the_dense_mask_losses():
    """Packed documents: FlexAttention's BlockMask from document ids (causal AND same document) gives the per-token
    losses of SDPA with the dense [s, s] mask within 1e-5 (fp32, eval: FlexAttention has no backward on CPU), and
    the mask is a BlockMask far smaller than s × s."""
    s = 256
    tokens = packed_tokens(s)
    dense_batch, document_batch = ({key: torch.as_tensor(np.stack([
        ltor_masks_and_position_ids(row[:-1], row[1:], 0, False, True, True, document_ids=as_ids)[key]
        for row in tokens])) for key in keys} for as_ids, keys in ((False, ("attention_mask", "position_ids")),
                                                                  (True, ("document_ids", "position_ids"))))
    assert "attention_mask" not in ltor_masks_and_position_ids(tokens[0, :-1], tokens[0, 1:], 0, False, True, True,
                                                               document_ids=True)
    config = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=s, vocab_size=128,
                         max_position_embeddings=s, position_embedding_type="rope", hidden_dropout=0.0,
                         attention_dropout=0.0)
    dense_model = build_model(config, seed=3).eval()
    flex_model = build_model(ModelConfig(**{**config.__dict__, "attention_kernel": "flex"}), seed=3).eval()
    inputs, labels = torch.as_tensor(tokens[:, :-1]), torch.as_tensor(tokens[:, 1:])
    with torch.no_grad():
        dense = dense_model(inputs, dense_batch["position_ids"], ~dense_batch["attention_mask"], labels)
        blocks = flex_model(inputs, document_batch["position_ids"], labels=labels,
                            document_ids=document_batch["document_ids"])
        unmasked = dense_model(inputs, dense_batch["position_ids"], labels=labels)
    torch.testing.assert_close(blocks, dense, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(unmasked, dense, atol=1e-3)  # the mask matters for these samples

    mask = flex_block_mask(2, s, s, torch.device("cpu"), causal=True, document_ids=document_batch["document_ids"])
    assert isinstance(mask, BlockMask) and mask.shape == (2, 1, s, s)
    mask_bytes = sum(t.numel() * t.element_size() for t in mask.as_tuple() if isinstance(t, torch.Tensor))
    dense_bytes = dense_batch["attention_mask"].numel() * dense_batch["attention_mask"].element_size()
    assert mask_bytes * 100 < dense_bytes, (mask_bytes, dense_bytes)


def test_document_ids_need_the_flex_kernel():
    model = build_model(ModelConfig(hidden_dropout=0.0, attention_dropout=0.0), seed=1)
    with pytest.raises(ValueError, match="--attention-backend flex_attention"):
        model(torch.zeros(1, 8, dtype=torch.long), document_ids=torch.zeros(1, 8, dtype=torch.long))


def test_flex_kernel_decodes_with_a_kv_cache_as_sdpa():
    from rapidtrain.models.transformer import KVCache

    config = ModelConfig(hidden_dropout=0.0, attention_dropout=0.0, position_embedding_type="rope")
    models = [build_model(ModelConfig(**{**config.__dict__, "attention_kernel": k}), seed=2).eval()
              for k in ("sdpa", "flex")]
    prompt, step = torch.randint(0, 128, (1, 6)), torch.randint(0, 128, (1, 1))
    outs = []
    with torch.no_grad():
        for model in models:
            cache = KVCache()
            model(prompt, kv_cache=cache)
            outs.append(model(step, kv_cache=cache))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


def test_resolve_marks_document_ids_only_for_flex():
    assert resolve("flex_attention", reset_attention_mask=True).document_ids
    assert not resolve("auto", reset_attention_mask=True).document_ids


def test_flash_generation_of_a_padded_batch_is_refused_on_cuda_only():
    """A padded batch attends under a mask, which CUDA's flash kernel does not take (seen on an H100); one prompt
    at a time has no mask, and PyTorch's CPU flash kernel takes masks."""
    from rapidtrain.models.attention_backends import attention_problem

    padded = "--batch-size 4 (prompts of different lengths padded under a mask)"
    message = attention_problem("flash", "cuda", True, 0.0, True, training=False, masked_by=padded)
    assert message and "--attention-backend flash with --batch-size 4" in message and "choose auto" in message
    assert attention_problem("flash", "cuda", True, 0.0, True, training=False) is None
    assert attention_problem("flash", "cpu", True, 0.0, True, training=False, masked_by=padded) is None


@pytest.mark.parametrize(("dtype", "seq"), [(None, 64), (torch.bfloat16, SHORT_KERNEL_MAX_KEYS + 8),
                                          (torch.bfloat16, 64)])
def test_causal_training_runs_the_cpu_flash_kernel_forward_and_backward(dtype, seq):
    """The default kernel of a causal model without a padding mask (grouped-query attention too) is SDPA's fused CPU
    flash kernel, forward and backward, in fp32 and under bf16 autocast: is_causal with no materialized mask, no
    repeat of the key/value heads, no math fallback (which holds [b, heads, s, s] scores: 4k tokens, 64 MiB a
    head). In bf16 at ≤ SHORT_KERNEL_MAX_KEYS keys it is rapidtrain's short-sequence kernel instead: batched
    matmuls around one softmax, the key/value heads not repeated either."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            self.names.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    config = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                         seq_length=seq, max_position_embeddings=seq, vocab_size=64, hidden_dropout=0.0,
                         attention_dropout=0.0, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                         add_bias_linear=False)
    model = build_model(config, seed=1).train()
    tokens = torch.randint(0, 64, (2, seq), generator=torch.Generator().manual_seed(0))
    with Ops() as ops, torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        model(tokens, labels=tokens).float().mean().backward()
    flash = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"}
    if dtype is not None and seq <= SHORT_KERNEL_MAX_KEYS:
        assert {"baddbmm", "bmm", "_softmax", "_softmax_backward_data"} <= ops.names and not flash & ops.names
        assert not {"_scaled_dot_product_attention_math", "repeat_interleave"} & ops.names
        return
    assert flash <= ops.names
    assert not {"_scaled_dot_product_attention_math", "repeat_interleave", "_softmax"} & ops.names
