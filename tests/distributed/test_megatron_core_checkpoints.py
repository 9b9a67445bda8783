"""Checkpoints that megatron-core 0.16.1 itself writes of today's models (mixture of experts with shared experts and
expert bias, multi-head latent attention with and without a query LoRA, a dense first layer) at TP 2 × EP 2 and
PP 2 × EP 2, in the legacy and the torch_dist format (tests/distributed/write_megatron_core_checkpoint.py, one
4-rank torchrun launch), read by rapidtrain into the built-in GPT at TP 1: its logits are Megatron-Core's own.

megatron-core is not one of rapidtrain's dependencies (and its `megatron` package must stay out of the environment,
where rapidtrain's Megatron facades live): it is looked for as a --target install in `$MEGATRON_CORE_DIR`, or in
`.venv/megatron-core` (`pip install --no-deps --target .venv/megatron-core megatron-core==0.16.1`); without it the
test skips. tests/unit/test_foreign_checkpoints.py checks the same layouts written by rapidtrain's own writer.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from rapidtrain.checkpoint.foreign import read_foreign, whole_model
from rapidtrain.checkpoint.foreign_formats import detect_foreign
from rapidtrain.models import build_model
from rapidtrain.models.config import ModelConfig
from tests.launch import torchrun

WRITER = Path(__file__).with_name("write_megatron_core_checkpoint.py")
SHAPE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, normalization="RMSNorm",
             swiglu=True, add_bias_linear=False, position_embedding_type="rope", tie_embeddings=False, vocab_size=128,
             seq_length=16, max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0,
             moe_ffn_hidden_size=24, moe_router_topk=2, moe_token_dropping=False, multi_latent_attention=True,
             kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8, qk_layernorm=True)
# The writer's MODELS in the built-in model's settings (Megatron-Core's --moe-layer-freq counts from layer 0)
MODELS = {
    "q_lora_tp2_ep2": dict(SHAPE, q_lora_rank=16, num_experts=(0, 4), moe_router_score_function="sigmoid",
                           moe_router_enable_expert_bias=True, moe_shared_expert_intermediate_size=48,
                           mtp_num_layers=1),
    "no_q_lora_pp2_ep2": dict(SHAPE, q_lora_rank=None, num_experts=(4, 4), moe_shared_expert_intermediate_size=32,
                              moe_shared_expert_gate=True),
}


def megatron_core_dir() -> Path | None:
    for candidate in (os.environ.get("MEGATRON_CORE_DIR"), str(Path(sys.prefix) / "megatron-core")):
        if candidate and (Path(candidate) / "megatron" / "core" / "__init__.py").is_file():
            return Path(candidate)
    return None


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    package = megatron_core_dir()
    if package is None:
        pytest.skip("megatron-core is not installed (MEGATRON_CORE_DIR or .venv/megatron-core)")
    out = tmp_path_factory.mktemp("megatron_core")
    torchrun(4, WRITER, [str(package), str(out)], timeout=600)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["legacy", "torch_dist"])
@pytest.mark.parametrize("name", list(MODELS))
def test_megatron_core_moe_mla_checkpoint_gives_megatron_cores_logits(written, name, kind):
    found = detect_foreign(written / name / kind)
    assert found is not None and found.kind == ("megatron-legacy" if kind == "legacy" else "megatron-torch-dist")
    config = ModelConfig(**MODELS[name])
    model = build_model(config, seed=1)
    model.load_state_dict(whole_model(read_foreign(found), config))
    model.eval()
    reference = torch.load(written / name / "reference.pt")
    with torch.no_grad():
        if "logits" in reference:
            torch.testing.assert_close(model(reference["tokens"]), reference["logits"], rtol=1e-4, atol=1e-5)
        loss = model(reference["tokens"], labels=reference["labels"])
    torch.testing.assert_close(loss, reference["loss"], rtol=1e-4, atol=1e-5)
    if "mtp_loss" in reference:  # multi-token prediction's loss, recorded by a training forward
        from rapidtrain.models.mtp import collect_mtp_loss

        model.train()
        model(reference["tokens"], labels=reference["labels"])  # (MTP runs where gradients are wanted)
        recorded = collect_mtp_loss(model)
        assert recorded is not None
        torch.testing.assert_close((recorded[0] / recorded[1]).float(), reference["mtp_loss"][0], rtol=1e-4, atol=1e-5)
