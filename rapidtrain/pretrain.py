"""`torchrun rapidtrain/pretrain.py FLAGS`: pretrain the built-in GPT (or BERT) on Megatron indexed data.

With no data flags it trains a small GPT on the built-in demo corpus (prepared on first use), so
`torchrun --nproc_per_node 1 rapidtrain/pretrain.py --train-iters 200` is a complete first run.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the package importable, not its folder's modules
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from typing import Any  # noqa: E402

import torch  # noqa: E402

from rapidtrain.data.tokenizer import Tokenizer, build_tokenizer  # noqa: E402
from rapidtrain.engine import Engine  # noqa: E402
from rapidtrain.errors import user_errors  # noqa: E402
from rapidtrain.trainers.pretrainer import PreTrainer  # noqa: E402

ENTRY = "pretrain"  # its declared defaults: arguments.ENTRY_DEFAULTS (and the demo's without --data-path)


class MegatronPreTrainer(PreTrainer):
    """The built-in models on --data-path (or the demo corpus), Megatron's datasets and loss."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.data_prefix = self.prepare_data()
        self.tokenizer = self.build_tokenizer()

    def prepare_data(self) -> list[str]:
        """The --data-path prefixes (a blend keeps its weights), or the demo corpus, built on first use."""
        data = self.plan.data
        if data.source != "demo":
            return list(data.data_path)
        from rapidtrain.data.demo import prepare_demo_data

        demo = prepare_demo_data(progress=self.engine.is_main_process)
        self.engine.print_rank0(f" no --data-path: training on the demo corpus ({demo.num_documents:,} "
                                f"documents, {demo.num_tokens:,} tokens) at {demo.data_prefix}")
        return [demo.data_prefix]

    def build_tokenizer(self) -> Tokenizer:
        settings = self.plan.tokenizer
        if settings is None:  # the rules refuse --data-path without a tokenizer before this point
            raise SystemExit("rapidtrain: --data-path needs --tokenizer-type (and its files).")
        return build_tokenizer(settings)

    def train_valid_test_datasets_provider(self, train_val_test_num_samples: list[int]) -> tuple[Any, Any, Any]:
        data, model = self.plan.data, self.plan.model
        assert model is not None
        if model.model_type == "bert":
            from rapidtrain.data.bert_dataset import BERTDatasetConfig, build_bert_datasets

            t = self.tokenizer
            config = BERTDatasetConfig(data_prefix=self.data_prefix, split=data.split, seq_length=model.seq_length,
                                       seed=data.seed, vocab_size=t.vocab_size, cls_id=t.cls, sep_id=t.sep,
                                       mask_id=t.mask, pad_id=t.pad, mask_prob=data.mask_prob,
                                       short_seq_prob=data.short_seq_prob, binary_head=model.bert_binary_head,
                                       data_impl=data.data_impl, cache_dir=data.cache_path)
            return build_bert_datasets(config, train_val_test_num_samples)
        from rapidtrain.data.gpt_dataset import GPTDatasetConfig, build_gpt_datasets

        config = GPTDatasetConfig(data_prefix=self.data_prefix, split=data.split, seq_length=model.seq_length,
                                  seed=data.seed, eod=self.tokenizer.eod, eod_mask_loss=data.eod_mask_loss,
                                  reset_position_ids=data.reset_position_ids,
                                  reset_attention_mask=data.reset_attention_mask, data_impl=data.data_impl,
                                  cache_dir=data.cache_path, vocab_size=model.vocab_size)
        return build_gpt_datasets(config, train_val_test_num_samples)

    def model_optimizer_lr_scheduler_provider(self) -> tuple[Any, None, None]:
        """The built-in model: on the meta device when the plan shards it (each rank materializes its part when
        it is composed), else whole and initialised."""
        from rapidtrain.parallel.meta_init import build_model_for

        return build_model_for(self.plan), None, None

    def model_factory(self) -> Any:
        from rapidtrain.models import build_model

        return lambda: build_model(self.plan.model, seed=None)

    def flops_per_iteration(self) -> float | None:
        from rapidtrain.models.counting import model_flops_per_iteration

        return float(model_flops_per_iteration(self.plan.model, self.plan.batches.global_batch_size))

    def run_forward_step(self, data_iterator: Any, model: Any) -> Any:
        batch = {k: v.to(self.engine.device, non_blocking=True) for k, v in next(data_iterator).items()}
        if self.plan.model.model_type == "bert":
            return self._bert_forward(batch, model)
        mask = batch.get("attention_mask")
        losses = model(batch["tokens"], position_ids=batch["position_ids"],
                       attention_mask=None if mask is None else ~mask, labels=batch["labels"])
        return losses, lambda per_token: masked_sum(per_token, batch["loss_mask"])

    def _bert_forward(self, batch: dict[str, torch.Tensor], model: Any) -> Any:
        output = model(batch["text"], attention_mask=batch["padding_mask"], tokentype_ids=batch["types"],
                       lm_labels=batch["labels"])
        if not self.plan.model.bert_binary_head:
            return output, lambda per_token: masked_sum(per_token, batch["loss_mask"])
        per_token, binary_logits = output
        lm_loss = masked_sum(per_token, batch["loss_mask"])
        sop = torch.nn.functional.cross_entropy(binary_logits.float(), batch["is_random"])
        return lm_loss[0] / lm_loss[1].clamp(min=1) + sop


def masked_sum(per_token: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the loss over tokens that count, how many count): the trainer averages over the global batch."""
    mask = loss_mask.float()
    return (per_token.float() * mask).sum(), mask.sum()


@user_errors()
def main(argv: list[str] | None = None) -> dict[str, float]:
    engine = Engine(argv=argv, entry=ENTRY)
    results = MegatronPreTrainer(engine).train()
    # An undestroyed gloo group can abort the interpreter at exit ("terminate called without an active exception").
    engine.shutdown()
    return results


if __name__ == "__main__":
    main()
