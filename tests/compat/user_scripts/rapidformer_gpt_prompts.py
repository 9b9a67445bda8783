"""A user's prompt-based (PET) fine-tuning of a GPT-MoE in the shape of EasyNLP's Rapidformer ZeroCLUE example:
a GPTFinetuner over PETDataset rows, the script's own flags declared by its extra_args_provider, written against
rapidtrain (`from rapidtrain import ...` where the example imports `rapidformer`)."""

from functools import partial

import torch

from rapidtrain import (
    GPTFinetuner,
    PETDataset,
    RapidformerEngine,
    average_losses_across_data_parallel_group,
    get_args,
    get_ltor_masks_and_position_ids,
    get_tokenizer,
)
from rapidtrain.rapidformer import GPTModel


def prompt_flags(parser):
    group = parser.add_argument_group("prompts")
    group.add_argument("--train-data", nargs="+", help="tab-separated rows to train on")
    group.add_argument("--valid-data", nargs="*", help="tab-separated rows to validate on")
    group.add_argument("--input_schema", help="the rows' column names, comma-separated")
    group.add_argument("--pattern", help="the prompt: column names and literal text, comma-separated")
    group.add_argument("--label_desc", help="one word per label, comma-separated")
    group.add_argument("--label_enumerate_values", help="the labels as the rows write them, comma-separated")
    return parser


class PromptFinetuner(GPTFinetuner):
    def train_valid_test_datasets_provider(self):
        args = get_args()
        schema = (get_tokenizer(), args.seq_length, args.input_schema, args.pattern, args.label_desc,
                  args.label_enumerate_values)
        valid = PETDataset(args.valid_data, *schema)
        return PETDataset(args.train_data, *schema), valid, valid, None

    def model_optimizer_lr_scheduler_provider(self, pre_process=True, post_process=True):
        return GPTModel(num_tokentypes=0, parallel_output=True), None, None

    def run_forward_step(self, batch, model):
        args = get_args()
        ids = batch["text"].long()
        inputs, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
        mask, loss_mask, positions = get_ltor_masks_and_position_ids(inputs, get_tokenizer().eod, False, False,
                                                                     args.eod_mask_loss)
        token_losses, *balancing = model(inputs, positions, mask, labels=targets)
        terms = [loss for loss in balancing if loss is not None]
        moe_loss = args.moe_loss_coeff * (torch.stack(terms).sum() if terms else token_losses.new_zeros(()))
        return token_losses, partial(self.prompt_loss, loss_mask, moe_loss)

    @staticmethod
    def prompt_loss(loss_mask, moe_loss, token_losses):
        weights = loss_mask.view(-1).float()
        lm_loss = (token_losses.view(-1).float() * weights).sum() / weights.sum()
        shown = average_losses_across_data_parallel_group([lm_loss, moe_loss])
        return lm_loss + moe_loss, {"lm loss": shown[0], "moe loss": shown[1]}


if __name__ == "__main__":
    PromptFinetuner(engine=RapidformerEngine(extra_args_provider=prompt_flags)).train()
