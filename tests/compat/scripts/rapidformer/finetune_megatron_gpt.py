"""A white-box GPTFinetuner in the shape of Rapidformer's GPT-MoE fine-tuning example (EasyNLP's
examples/rapidformer/gpt_moe/finetune_megatron_gpt.py): text-line datasets from --train-data / --valid-data, the
batch handed to run_forward_step, Megatron's masks and loss contract with the MoE losses returned by
Rapidformer's GPTModel. Written against rapidtrain: the import lines are the only difference."""

from functools import partial

from rapidtrain import (
    GPTFinetuner,
    ModelType,
    RapidformerEngine,
    average_losses_across_data_parallel_group,
    get_args,
    get_ltor_masks_and_position_ids,
    get_tokenizer,
)
from rapidtrain.rapidformer import GPTDataset, GPTModel


class MegatronGPTMoEFinetuner(GPTFinetuner):
    def __init__(self, engine):
        super().__init__(engine=engine)

    def train_valid_test_datasets_provider(self):
        args, tokenizer = get_args(), get_tokenizer()
        train_dataset = GPTDataset(args.train_data, tokenizer, args.seq_length)
        valid_dataset = GPTDataset(args.valid_data, tokenizer, args.seq_length)
        test_dataset = GPTDataset(args.valid_data, tokenizer, args.seq_length)
        return train_dataset, valid_dataset, test_dataset, None

    def model_optimizer_lr_scheduler_provider(self, pre_process=True, post_process=True):
        args = get_args()
        args.model_type = ModelType.encoder_or_decoder
        model = GPTModel(num_tokentypes=0, parallel_output=True, pre_process=pre_process, post_process=post_process)
        return model, None, None

    def run_forward_step(self, data_iterator, model):
        # Rapidformer's Finetuner hands this hook the batch itself (named data_iterator in its examples).
        args, tokenizer = get_args(), get_tokenizer()
        text = data_iterator["text"].long()
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
    finetuner = MegatronGPTMoEFinetuner(engine=engine)
    finetuner.train()
