"""The built-in model's LoRA adapters in one process: which layers get them and what is frozen, the name-seeded start
(B = 0: the model computes what the base does), the fold into the weights, and a Megatron-LM checkpoint of the base
loaded beside new adapters (tests/distributed/test_builtin_lora.py trains them under TP and PP)."""

from __future__ import annotations

import pytest
import torch

from rapidtrain.checkpoint.foreign import fill_template, whole_model
from rapidtrain.checkpoint.foreign_formats import detect_foreign
from rapidtrain.checkpoint.megatron_legacy import read_megatron_legacy, write_megatron_legacy
from rapidtrain.core.errors import UserError
from rapidtrain.models import build_model
from rapidtrain.models.config import ModelConfig
from rapidtrain.models.lora import LoraSettings, add_builtin_lora, is_adapter_weight, merge_adapters
from rapidtrain.models.transformer import init_weights

LLAMA = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128, max_position_embeddings=16,
                    seq_length=16, normalization="RMSNorm", swiglu=True, num_query_groups=2, add_bias_linear=False,
                    position_embedding_type="rope", tie_embeddings=False)


def adapted(targets: tuple[str, ...] = ()) -> torch.nn.Module:
    model = build_model(LLAMA, seed=3)
    add_builtin_lora(model, LoraSettings(rank=4, alpha=8, target_modules=targets, builtin=True))
    init_weights(model, 3, only=is_adapter_weight)
    return model


def test_adapters_start_as_no_change_and_only_they_train():
    base, model = build_model(LLAMA, seed=3).eval(), adapted().eval()  # eval: no dropout
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(base(ids), model(ids))  # B = 0
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter_weight(name) for name in trainable)
    assert len(trainable) == 2 * 7 * 2  # A and B beside q, k, v, o, fc1, gate, fc2 in 2 layers
    only_q = adapted(("q_proj",))
    assert {name.split(".")[3] for name, p in only_q.named_parameters() if p.requires_grad} == {"q_proj"}
    with pytest.raises(UserError, match="no linear layer named qkv; its layers' linear layers are fc1, fc2, gate"):
        adapted(("qkv",))


def test_merged_weights_compute_what_the_adapted_model_does():
    model = adapted()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_b.weight"):
                param.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    plain = build_model(LLAMA, seed=None).eval()
    plain.load_state_dict(merge_adapters(model.state_dict(), 8 / 4))
    model.eval()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    assert torch.allclose(plain(ids), model(ids), atol=1e-5)
    assert not torch.allclose(plain(ids), build_model(LLAMA, seed=3).eval()(ids), atol=1e-3)


def test_a_megatron_checkpoint_of_the_base_loads_beside_new_adapters(tmp_path):
    base = {name: value.clone() for name, value in build_model(LLAMA, seed=5).state_dict().items()}
    write_megatron_legacy(tmp_path, base, LLAMA, tensor_parallel=2, pipeline_parallel=1, iteration=3,
                          consumed_samples=6, vocab_rows=256)
    whole = whole_model(read_megatron_legacy(detect_foreign(tmp_path)), LLAMA)
    model = adapted()
    template = {name: value.clone() for name, value in model.state_dict().items()}
    fill_template(template, whole, str(tmp_path))
    assert all(torch.equal(template[name], base[name]) for name in base)
    assert all(torch.equal(template[name], model.state_dict()[name]) for name in template if is_adapter_weight(name))
