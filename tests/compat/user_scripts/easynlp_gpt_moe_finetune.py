"""EasyNLP's Rapidformer ZeroCLUE GPT-MoE fine-tuning (examples/rapidformer/zeroclue/finetune_gpt_moe.py) as its
users wrote it, with rapidtrain's imports in place of rapidformer's and megatron's: Rapidformer's PETDataset
signature ('clue', split, files, tokenizer, length, schema, pattern, label map), a forward step that hands back the
per-token losses and the loss mask of the inputs, and a loss function that adds the experts' balancing losses, or
the plain `0` that `sum([])` gives when no layer returned one."""

from functools import partial

import torch

from rapidtrain import (
    GPTFinetuner,
    RapidformerEngine,
    average_losses_across_data_parallel_group,
    get_args,
    get_ltor_masks_and_position_ids,
    get_tokenizer,
)
from rapidtrain.rapidformer import GPTModel
from rapidtrain.rapidformer import PETDataset as Dataset


def get_tasks_args(parser):
    group = parser.add_argument_group(title="fewclue pet")
    group.add_argument("--train-data", nargs="+", default=None)
    group.add_argument("--valid-data", nargs="*", default=None)
    group.add_argument("--input_schema", type=str, default=None)
    group.add_argument("--pattern", type=str, default=None)
    group.add_argument("--label_desc", type=str, default=None)
    group.add_argument("--label_enumerate_values", type=str, default=None)
    return parser


class MegatronGPTMoEFinetuner(GPTFinetuner):
    def train_valid_test_datasets_provider(self):
        args = get_args()
        tokenizer = get_tokenizer()
        label_map = dict(zip(args.label_enumerate_values.split(","), args.label_desc.split(","), strict=True))
        train = Dataset("clue", "training", args.train_data, tokenizer, args.seq_length, args.input_schema,
                        args.pattern, label_map)
        valid = Dataset("clue", "validation", args.valid_data, tokenizer, args.seq_length, args.input_schema,
                        args.pattern, label_map)
        return train, valid, valid, None

    def model_optimizer_lr_scheduler_provider(self, pre_process=True, post_process=True):
        return GPTModel(num_tokentypes=0, parallel_output=True, pre_process=pre_process,
                        post_process=post_process), None, None

    def run_forward_step(self, data_iterator, model):
        args = get_args()
        tokens_ = data_iterator["text"].long()
        labels = tokens_[:, 1:].contiguous()
        tokens = tokens_[:, :-1].contiguous()
        attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
            tokens, get_tokenizer().eod, args.reset_position_ids, args.reset_attention_mask, args.eod_mask_loss)
        output_tensor, *other_losses = model(tokens, position_ids, attention_mask, labels=labels)
        moe_losses = [moe_loss for moe_loss in other_losses if moe_loss is not None]
        moe_loss = sum(moe_losses) * args.moe_loss_coeff

        def loss_func(loss_mask, moe_loss, output_tensor):
            losses = output_tensor.float()
            loss_mask = loss_mask.view(-1).float()
            loss = torch.sum(losses.view(-1) * loss_mask) / loss_mask.sum()
            averaged_loss = average_losses_across_data_parallel_group([loss])
            if max(args.num_experts) <= 1:
                return loss, {"lm loss": averaged_loss[0]}
            loss = loss + moe_loss
            return loss, {"lm loss": averaged_loss[0], "moe loss": moe_loss}

        return output_tensor, partial(loss_func, loss_mask, moe_loss)


if __name__ == "__main__":
    MegatronGPTMoEFinetuner(engine=RapidformerEngine(extra_args_provider=get_tasks_args)).train()
