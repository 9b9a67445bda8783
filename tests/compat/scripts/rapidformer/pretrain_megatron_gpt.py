"""A white-box PreTrainer in the shape of Rapidformer's GPT-MoE pretraining example (EasyNLP's
examples/rapidformer/gpt_moe/pretrain_megatron_gpt.py): Megatron's GPT datasets and masks, Rapidformer's
GPTModel that hands the MoE balancing losses back, router type 0 adding them to the loss. Written against
rapidtrain: the import lines are the only difference from a Rapidformer user's script."""

from functools import partial

import torch

from rapidtrain import (
    ModelType,
    PreTrainer,
    RapidformerEngine,
    average_losses_across_data_parallel_group,
    build_train_valid_test_datasets,
    get_args,
    get_ltor_masks_and_position_ids,
    get_tokenizer,
    mpu,
)
from rapidtrain.rapidformer import GPTModel


class MegatronGPTPreTrainer(PreTrainer):
    def __init__(self, engine):
        super().__init__(engine=engine)

    def train_valid_test_datasets_provider(self, train_val_test_num_samples):
        args = get_args()
        return build_train_valid_test_datasets(
            data_prefix=args.data_path, data_impl=args.data_impl, splits_string=args.split,
            train_valid_test_num_samples=train_val_test_num_samples, seq_length=args.seq_length, seed=args.seed,
            skip_warmup=not args.mmap_warmup)

    def model_optimizer_lr_scheduler_provider(self, pre_process=True, post_process=True):
        args = get_args()
        args.model_type = ModelType.encoder_or_decoder  # Rapidformer scripts set it; rapidtrain reads its plan
        model = GPTModel(num_tokentypes=0, parallel_output=True, pre_process=pre_process, post_process=post_process)
        return model, None, None

    def run_forward_step(self, data_iterator, model):
        args, tokenizer = get_args(), get_tokenizer()
        data = next(data_iterator) if data_iterator is not None else None
        text = mpu.broadcast_data(["text"], data, torch.int64)["text"].long()
        tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
        attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
            tokens, tokenizer.eod, args.reset_position_ids, args.reset_attention_mask, args.eod_mask_loss)
        output_tensor, *other_losses = model(tokens, position_ids, attention_mask, labels=labels)
        moe_loss = None
        if args.moe:
            moe_loss = sum(loss for loss in other_losses if loss is not None) * args.moe_loss_coeff

        def loss_func(loss_mask, moe_loss, output_tensor):
            mask = loss_mask.view(-1).float()
            loss = (output_tensor.float().view(-1) * mask).sum() / mask.sum()
            averaged = average_losses_across_data_parallel_group([loss])
            if args.router_type == 0 and args.moe:
                loss = loss + moe_loss
            if args.moe:
                return loss, {"lm loss": averaged[0], "moe loss": moe_loss}
            return loss, {"lm loss": averaged[0]}

        return output_tensor, partial(loss_func, loss_mask, moe_loss)


if __name__ == "__main__":
    engine = RapidformerEngine()
    trainer = MegatronGPTPreTrainer(engine=engine)
    trainer.train()
