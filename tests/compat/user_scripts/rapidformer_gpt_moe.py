"""A user's GPT(-MoE) pretraining template in PAI-Rapidformer's shape (a PreTrainer subclass with its three hooks),
written against rapidtrain: `from rapidtrain import ...` where Rapidformer's scripts import `rapidformer`.

The forward step hands back what Megatron's contract allows: per-token losses [b, s] with their loss mask [b, s]
for a dense model; with experts, the output and a loss function adding the weighted balancing losses."""

import torch

from rapidtrain import (
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


class GPTMoEPreTrainer(PreTrainer):
    def train_valid_test_datasets_provider(self, train_val_test_num_samples):
        args = get_args()
        return build_train_valid_test_datasets(args.data_path, args.data_impl, args.split,
                                               train_val_test_num_samples, args.seq_length, args.seed)

    def model_optimizer_lr_scheduler_provider(self, pre_process=True, post_process=True):
        return GPTModel(num_tokentypes=0, parallel_output=True, pre_process=pre_process,
                        post_process=post_process), None, None

    def run_forward_step(self, data_iterator, model):
        args = get_args()
        batch = mpu.broadcast_data(["text"], next(data_iterator) if data_iterator else None, torch.int64)
        inputs, targets = batch["text"][:, :-1].contiguous(), batch["text"][:, 1:].contiguous()
        mask, loss_mask, positions = get_ltor_masks_and_position_ids(inputs, get_tokenizer().eod, False, False,
                                                                     args.eod_mask_loss)
        token_losses, *balancing = model(inputs, positions, mask, labels=targets)
        if not args.moe:
            return token_losses, loss_mask
        terms = [loss for loss in balancing if loss is not None]  # none in evaluation
        moe_loss = args.moe_loss_coeff * (torch.stack(terms).sum() if terms else token_losses.new_zeros(()))

        def with_balancing(output):
            weights = loss_mask.view(-1).float()
            lm_loss = (output.view(-1).float() * weights).sum() / weights.sum()
            shown = average_losses_across_data_parallel_group([lm_loss, moe_loss])
            return lm_loss + moe_loss, {"lm loss": shown[0], "moe loss": shown[1]}

        return token_losses, with_balancing


if __name__ == "__main__":
    GPTMoEPreTrainer(engine=RapidformerEngine()).train()
