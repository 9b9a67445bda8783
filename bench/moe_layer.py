"""One fine-grained MoE layer, forward and backward, three ways on the same weights and tokens: rapidtrain's dropless
path (the assignments sorted by expert through torch's grouped_mm), rapidtrain's capacity buffers made dropless
(every expert a buffer of all T tokens: what --disable-moe-token-dropping ran before, and what expert parallelism
still exchanges), and Hugging Face's Qwen2-MoE sparse block (a Python loop over the experts hit). Systems run
interleaved (A B C A B C ...), each round's times per system; the table gives each system's median, spread and the
median of per-round ratios to rapidtrain's grouped path. The outputs are checked equal before timing.

    python bench/moe_layer.py [--experts 16 --topk 4 --hidden 512 --ffn 256 --tokens 4096 --rounds 5 --steps 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rapidtrain.models import ModelConfig  # noqa: E402
from rapidtrain.models.moe import MoELayer  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=256, help="each routed expert's hidden size")
    parser.add_argument("--shared", type=int, default=512, help="the shared expert's hidden size (0: none)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of one micro-batch (batch × sequence)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="forward + backward passes timed per round")
    return parser.parse_args()


def build(args: argparse.Namespace) -> dict[str, torch.nn.Module]:
    import transformers

    config = ModelConfig(num_layers=1, hidden_size=args.hidden, num_attention_heads=1, swiglu=True,
                         add_bias_linear=False, num_experts=(args.experts,), moe_router_topk=args.topk,
                         moe_token_dropping=False, moe_ffn_hidden_size=args.ffn, moe_router_pre_softmax=True,
                         moe_shared_expert_intermediate_size=args.shared or None,
                         moe_shared_expert_gate=bool(args.shared), moe_aux_loss_coeff=0.0)
    torch.manual_seed(0)
    grouped = MoELayer(config, args.experts)
    capacity = MoELayer(config, args.experts)
    capacity.load_state_dict(grouped.state_dict())
    capacity.experts.takes_grouped_rows = False  # this instance only: the [E, C = T, h] buffers
    hf_config = transformers.Qwen2MoeConfig(hidden_size=args.hidden, moe_intermediate_size=args.ffn,
                                            shared_expert_intermediate_size=args.shared or 1,
                                            num_experts=args.experts, num_experts_per_tok=args.topk,
                                            norm_topk_prob=False)
    hf = transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock(hf_config)
    with torch.no_grad():
        hf.gate.weight.copy_(grouped.router.weight)
        hf.experts.gate_up_proj.copy_(torch.cat([grouped.experts.w_gate, grouped.experts.w1], dim=2).transpose(1, 2))
        hf.experts.down_proj.copy_(grouped.experts.w2.transpose(1, 2))
        if args.shared:
            hf.shared_expert.gate_proj.weight.copy_(grouped.shared_experts.gate.weight)
            hf.shared_expert.up_proj.weight.copy_(grouped.shared_experts.fc1.weight)
            hf.shared_expert.down_proj.weight.copy_(grouped.shared_experts.fc2.weight)
            hf.shared_expert_gate.weight.copy_(grouped.shared_expert_gate.weight)
        else:  # Hugging Face's block always has a shared expert: one of zeros adds nothing
            for param in (*hf.shared_expert.parameters(), hf.shared_expert_gate.weight):
                param.zero_()
    return {"rapidtrain grouped (dropless)": grouped, "rapidtrain capacity buffers (dropless)": capacity,
            "HF Qwen2MoeSparseMoeBlock": hf}


def step(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = module(x)
    out = out[0] if isinstance(out, tuple) else out
    out.square().mean().backward()
    return out.detach()


def main() -> None:
    args = parse_args()
    systems = build(args)
    x = torch.randn(1, args.tokens, args.hidden, generator=torch.Generator().manual_seed(1))
    outputs = {name: step(module.train(), x) for name, module in systems.items()}  # also the warm-up
    first = next(iter(outputs.values()))
    for name, out in outputs.items():
        worst = float((out - first).abs().max())
        assert worst < 1e-4, f"{name} computes another output ({worst})"
    times: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(args.rounds):
        for name, module in systems.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                module.zero_grad(set_to_none=True)
                step(module, x)
            times[name].append((time.perf_counter() - start) / args.steps * 1e3)
    base = "rapidtrain grouped (dropless)"
    cpu = torch.cpu._is_avx512_bf16_supported()
    print(f"MoE layer, fp32 forward + backward: {args.experts} experts top-{args.topk}, hidden {args.hidden}, expert "
          f"ffn {args.ffn}, shared {args.shared}, {args.tokens} tokens; {args.rounds} interleaved rounds of "
          f"{args.steps} steps; torch {torch.__version__}, {torch.get_num_threads()} threads, AVX512-BF16 {cpu}")
    print(f"{'system':42s} {'median ms':>10s} {'min ms':>8s} {'max ms':>8s} {'time vs grouped':>16s}")
    for name, values in times.items():
        ratio = statistics.median(a / b for a, b in zip(values, times[base], strict=True))
        print(f"{name:42s} {statistics.median(values):10.1f} {min(values):8.1f} {max(values):8.1f} {ratio:15.2f}×")


if __name__ == "__main__":
    main()
