"""A white-box GPTFinetuner in the shape of Rapidformer's ZeroCLUE example (EasyNLP's examples/rapidformer/
zeroclue/finetune_gpt_moe.py): its own flags through extra_args_provider (--keep-last, --train-data, ... which
rapidtrain also knows), the model built inside deepspeed.zero.Init as Megatron-DeepSpeed scripts do (enabled for
ZeRO-3 only), PET-style prompts, a pyramid of experts with residual MLPs. Written against rapidtrain: the import
lines differ, and Rapidformer's PETDataset (its CLUE prompt builder, not part of rapidtrain) is the small
PromptDataset below."""

from functools import partial

import deepspeed
import numpy as np
import torch

from rapidtrain import (
    GPTFinetuner,
    RapidformerEngine,
    average_losses_across_data_parallel_group,
    get_args,
    get_ltor_masks_and_position_ids,
    get_tokenizer,
    mpu,
)
from rapidtrain.rapidformer import GPTModel


def get_tasks_args(parser):
    group = parser.add_argument_group(title="fewclue pet")
    group.add_argument("--keep-last", action="store_true",
                       help="Keep the last batch (maybe incomplete) in the data loader")
    group.add_argument("--train-data", nargs="+", default=None, help="Training files.")
    group.add_argument("--valid-data", nargs="*", default=None, help="Validation files.")
    group.add_argument("--input_schema", type=str, default=None, help="column names of the input files")
    group.add_argument("--pattern", type=str, default=None, help="the prompt, columns and words")
    group.add_argument("--label_desc", type=str, default=None, help="the words standing for the labels")
    group.add_argument("--label_enumerate_values", type=str, default=None, help="the label values")
    return parser


class PromptDataset(torch.utils.data.Dataset):
    """Tab-separated rows → prompts: each part of `pattern` is a column's value, the label's word, or a literal."""

    def __init__(self, files, tokenizer, seq_length, input_schema, pattern, label_map):
        columns, self.samples = input_schema.split(","), []
        for name in files:
            for line in open(name, encoding="utf-8"):
                row = dict(zip(columns, line.rstrip("\n").split("\t"), strict=False))
                row["label"] = label_map.get(row.get("label"), row.get("label"))
                text = "".join(row.get(part, part) for part in pattern.split(","))
                ids = tokenizer.tokenize(text)[:seq_length] + [tokenizer.eod]
                self.samples.append(ids + [tokenizer.eod] * (seq_length + 1 - len(ids)))

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        return {"text": np.array(self.samples[idx], dtype=np.int64)}


class MegatronGPTMoEFinetuner(GPTFinetuner):
    def __init__(self, engine):
        super().__init__(engine=engine)

    def train_valid_test_datasets_provider(self):
        args, tokenizer = get_args(), get_tokenizer()
        label_map = dict(zip(args.label_enumerate_values.split(","), args.label_desc.split(","), strict=True))
        schema = (tokenizer, args.seq_length, args.input_schema, args.pattern, label_map)
        train_dataset = PromptDataset(args.train_data, *schema)
        valid_dataset = PromptDataset(args.valid_data, *schema)
        return train_dataset, valid_dataset, valid_dataset, None

    def model_optimizer_lr_scheduler_provider(self, pre_process=True, post_process=True):
        args = get_args()
        with deepspeed.zero.Init(data_parallel_group=mpu.get_data_parallel_group(),
                                 remote_device=None if args.remote_device == "none" else args.remote_device,
                                 config_dict_or_path=args.deepspeed_configuration,
                                 enabled=args.zero_stage == 3,
                                 mpu=mpu):
            model = GPTModel(num_tokentypes=0, parallel_output=True, pre_process=pre_process,
                             post_process=post_process)
        return model, None, None

    def run_forward_step(self, data_iterator, model):
        args, tokenizer = get_args(), get_tokenizer()
        text = data_iterator["text"].long()
        tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
        attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
            tokens, tokenizer.eod, args.reset_position_ids, args.reset_attention_mask, args.eod_mask_loss)
        output_tensor, *other_losses = model(tokens, position_ids, attention_mask, labels=labels)
        moe_loss = sum(loss for loss in other_losses if loss is not None) * args.moe_loss_coeff

        def loss_func(loss_mask, moe_loss, output_tensor):
            mask = loss_mask.view(-1).float()
            loss = (output_tensor.float().view(-1) * mask).sum() / mask.sum()
            averaged = average_losses_across_data_parallel_group([loss])
            if max(args.num_experts) <= 1:
                return loss, {"lm loss": averaged[0]}
            return loss + moe_loss, {"lm loss": averaged[0], "moe loss": moe_loss}

        return output_tensor, partial(loss_func, loss_mask, moe_loss)


if __name__ == "__main__":
    engine = RapidformerEngine(extra_args_provider=get_tasks_args)
    finetuner = MegatronGPTMoEFinetuner(engine=engine)
    finetuner.train()
