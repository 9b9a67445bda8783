"""Write Megatron-Core checkpoints of MoE + MLA GPTs with megatron-core itself, for the --load tests.

Usage: `torchrun --nproc-per-node 4 tests/distributed/write_megatron_core_checkpoint.py MEGATRON_CORE_DIR OUT`:
MEGATRON_CORE_DIR holds the megatron-core 0.16.1 package (`pip install --no-deps --target DIR megatron-core==0.16.1`,
kept out of the environment: rapidtrain has Megatron facades of its own). For each model in MODELS, all four ranks
build Megatron-Core's GPTModel (the local, non-Transformer-Engine layer spec, CPU initialization, gloo) at TP 1 and
save it whole with dist_checkpointing (OUT/NAME/whole), and rank 0 records its logits on fixed tokens
(OUT/NAME/reference.pt); then they build it again in the model's parallel layout, load the whole checkpoint into it
(Megatron-Core cuts it for its ranks) and save it as Megatron-LM's save_checkpoint does: the legacy format
(OUT/NAME/legacy: `mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`, each holding `state_dict_for_save_checkpoint()` and
the run's args) and torch_dist (OUT/NAME/torch_dist). So the folders' names, shapes and cuts are Megatron-Core's
own; the test reads them and compares rapidtrain's logits with Megatron-Core's.

megatron-core on a CPU without Transformer Engine needs four stand-ins, all outside the weights' layout: CUDA calls
(`current_device` → "cpu", `synchronize` → nothing), Transformer Engine's probes (`HAVE_TE` in the MLA module, its
router GEMM) switched off, and the core attention: the local DotProductAttention takes no MLA head sizes, so a causal
SDPA with the scale Megatron hands it stands in (it holds no weights).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

SEQUENCE, VOCAB = 16, 128
# name → (layout (tensor, pipeline, expert parallel), TransformerConfig fields beyond COMMON)
MODELS: dict[str, tuple[tuple[int, int, int], dict[str, Any]]] = {
    # DeepSeek-V3-like: query LoRA, a dense first layer, sigmoid router with expert bias, shared experts, one
    # multi-token prediction layer
    "q_lora_tp2_ep2": ((2, 1, 2), dict(q_lora_rank=16, moe_layer_freq=[0, 1], moe_router_score_function="sigmoid",
                                      moe_router_enable_expert_bias=True, moe_shared_expert_intermediate_size=48,
                                      mtp_num_layers=1)),
    # DeepSeek-V2-Lite-like: queries projected directly, every layer MoE (torch_dist stacks the layers), softmax
    # router, Qwen's gated shared experts
    "no_q_lora_pp2_ep2": ((1, 2, 2), dict(q_lora_rank=None, moe_layer_freq=1, moe_shared_expert_intermediate_size=32,
                                         moe_shared_expert_gate=True)),
}
COMMON = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, normalization="RMSNorm",
              gated_linear_unit=True, add_bias_linear=False, num_moe_experts=4, moe_ffn_hidden_size=24,
              moe_router_topk=2, moe_token_dispatcher_type="allgather", kv_lora_rank=16, qk_head_dim=8,
              qk_pos_emb_head_dim=4, v_head_dim=8, qk_layernorm=True, rope_type="rope", hidden_dropout=0.0,
              attention_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.float32, bf16=False)


def cpu_stand_ins() -> None:
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.multi_latent_attention as latent

    latent.HAVE_TE = False
    moe_utils.te_general_gemm = None


def causal_attention() -> type:
    from megatron.core.transformer.module import MegatronModule

    class CausalAttention(MegatronModule):
        """Megatron's core-attention interface ([s, b, heads, d] in, [s, b, heads·d_v] out), causal SDPA inside."""

        def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                     attention_dropout: float | None = None, softmax_scale: float | None = None,
                     k_channels: int | None = None, v_channels: int | None = None, cp_comm_type: Any = None,
                     pg_collection: Any = None) -> None:
            super().__init__(config=config)
            self.scale = softmax_scale

        def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                    attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None):
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
            return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)

    return CausalAttention


def build(fields: dict[str, Any], layout: tuple[int, int, int]) -> Any:
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    tensor, pipeline, expert = layout
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor, pipeline, expert_model_parallel_size=expert)
    config = MLATransformerConfig(**COMMON, **fields, activation_func=F.silu, pipeline_dtype=torch.float32,
                                  tensor_model_parallel_size=tensor,
                                  pipeline_model_parallel_size=pipeline, expert_model_parallel_size=expert)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    for layer in spec.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = causal_attention()
    mtp = (get_gpt_mtp_block_spec(config, spec.layer_specs[-1], use_transformer_engine=False)
           if config.mtp_num_layers else None)
    torch.manual_seed(5)
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQUENCE * 2, mtp_block_spec=mtp,
                    position_embedding_type="rope", share_embeddings_and_output_weights=False,
                    pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage())


def saved_args(fields: dict[str, Any], layout: tuple[int, int, int]) -> argparse.Namespace:
    """The args Megatron-LM's training saves (after its validation: moe_ffn_hidden_size set, the layer pattern a
    list or an int), in its flag names."""
    names = {"num_moe_experts": "num_experts", "normalization": "normalization"}
    values = {names.get(k, k): v for k, v in {**COMMON, **fields}.items() if not isinstance(v, torch.dtype)}
    tensor, pipeline, expert = layout
    return argparse.Namespace(**values, swiglu=True, multi_latent_attention=True, padded_vocab_size=VOCAB,
                              max_position_embeddings=SEQUENCE * 2, position_embedding_type="rope",
                              untie_embeddings_and_output_weights=True, tensor_model_parallel_size=tensor,
                              pipeline_model_parallel_size=pipeline, expert_model_parallel_size=expert,
                              expert_tensor_parallel_size=tensor, iteration=1, consumed_train_samples=8,
                              make_vocab_size_divisible_by=VOCAB // tensor)


def write_reference(name: str, fields: dict[str, Any], out: Path) -> None:
    """TP 1: every weight moved off its initial value (CPU initialization gives every expert the same draw, every
    norm ones: a mix-up of either would not show), a nonzero expert bias, the logits (losses), and the model saved
    whole."""
    from megatron.core import dist_checkpointing

    model = build(fields, (1, 1, 1))
    with torch.no_grad():
        generator = torch.Generator().manual_seed(7)
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
        for buffer_name, buffer in model.named_buffers():
            if buffer_name.endswith("expert_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.1)
    model.eval()
    sequence = torch.randint(0, VOCAB, (2, SEQUENCE + 1), generator=torch.Generator().manual_seed(1))
    tokens, labels, positions = sequence[:, :-1], sequence[:, 1:], torch.arange(SEQUENCE).expand(2, SEQUENCE)
    reference = {"tokens": tokens, "labels": labels}
    with torch.no_grad():
        if not fields.get("mtp_num_layers"):  # (with MTP, Megatron-Core's forward takes labels and gives losses)
            reference["logits"] = model(tokens, positions, None)
        reference["loss"] = model(tokens, positions, None, labels=labels)
        if fields.get("mtp_num_layers"):  # a training forward records multi-token prediction's loss
            from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

            model.train()
            model(tokens, positions, None, labels=labels)
            reference["mtp_loss"] = MTPLossLoggingHelper.tracker["values"].clone()
            model.eval()
    if dist.get_rank() == 0:
        (out / name / "whole").mkdir(parents=True, exist_ok=True)
        torch.save(reference, out / name / "reference.pt")
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), str(out / name / "whole"))


def write_parallel(name: str, layout: tuple[int, int, int], fields: dict[str, Any], out: Path) -> None:
    from megatron.core import dist_checkpointing, parallel_state

    model = build(fields, layout)
    dist_checkpointing.load(model.sharded_state_dict(), str(out / name / "whole"))
    args = saved_args(fields, layout)
    tensor, pipeline, expert = layout
    if parallel_state.get_expert_data_parallel_rank() == 0:  # Megatron-LM's legacy save: one file per model rank
        folder = (f"mp_rank_{parallel_state.get_tensor_model_parallel_rank():02d}"
                  + (f"_{parallel_state.get_pipeline_model_parallel_rank():03d}" if pipeline > 1 else "")
                  + (f"_{parallel_state.get_expert_model_parallel_rank():03d}" if expert > 1 else ""))
        directory = out / name / "legacy" / "iter_0000001" / folder
        directory.mkdir(parents=True, exist_ok=True)
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 1,
                    "model": model.state_dict_for_save_checkpoint()}, directory / "model_optim_rng.pt")
    directory = out / name / "torch_dist" / "iter_0000001"
    directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save({"model": model.sharded_state_dict(), "args": args, "iteration": 1,
                             "checkpoint_version": 3.0}, str(directory))
    if dist.get_rank() == 0:
        for kind in ("legacy", "torch_dist"):
            (out / name / kind / "latest_checkpointed_iteration.txt").write_text("1")


def main() -> None:
    megatron_core, out = sys.argv[1], Path(sys.argv[2])
    sys.path.insert(0, megatron_core)
    warnings.filterwarnings("ignore")  # megatron-core's notes on Transformer Engine and Apex being absent
    dist.init_process_group("gloo")
    cpu_stand_ins()
    for name, (layout, fields) in MODELS.items():
        write_reference(name, fields, out)
        write_parallel(name, layout, fields, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":  # dist_checkpointing's writer starts helper processes that import this file
    main()
