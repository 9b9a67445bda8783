"""A white-box pretraining script in Megatron-LM's pretrain_gpt.py shape (2021-2023: get_batch with
mpu.broadcast_data, Megatron's masks, the loss function returning {"lm loss": ...}, pretrain(...)), written
against rapidtrain: only the import lines differ from a Megatron user's script."""

from functools import partial

import torch

from rapidtrain import (
    GPTModel,
    ModelType,
    average_losses_across_data_parallel_group,
    build_train_valid_test_datasets,
    get_args,
    get_ltor_masks_and_position_ids,
    get_timers,
    get_tokenizer,
    mpu,
    print_rank_0,
)
from rapidtrain.training import pretrain


def model_provider(pre_process=True, post_process=True):
    print_rank_0("building GPT model ...")
    return GPTModel(num_tokentypes=0, parallel_output=True, pre_process=pre_process, post_process=post_process)


def get_batch(data_iterator):
    """One micro-batch of {"text": seq_length + 1 ids}: inputs, targets and Megatron's masks."""
    args, tokenizer = get_args(), get_tokenizer()
    data = next(data_iterator) if data_iterator is not None else None
    text = mpu.broadcast_data(["text"], data, torch.int64)["text"].long()
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
        tokens, tokenizer.eod, args.reset_position_ids, args.reset_attention_mask, args.eod_mask_loss)
    return tokens, labels, loss_mask, attention_mask, position_ids


def loss_func(loss_mask, output_tensor):
    mask = loss_mask.view(-1).float()
    loss = (output_tensor.float().view(-1) * mask).sum() / mask.sum()
    reported = average_losses_across_data_parallel_group([loss])
    return loss, {"lm loss": reported[0]}


def forward_step(data_iterator, model):
    timers = get_timers()
    timers("batch-generator").start()
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    timers("batch-generator").stop()
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels)
    return output_tensor, partial(loss_func, loss_mask)


def train_valid_test_datasets_provider(train_val_test_num_samples):
    args = get_args()
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    return build_train_valid_test_datasets(
        data_prefix=args.data_path, data_impl=args.data_impl, splits_string=args.split,
        train_valid_test_num_samples=train_val_test_num_samples, seq_length=args.seq_length, seed=args.seed,
        skip_warmup=not args.mmap_warmup)


if __name__ == "__main__":
    pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
             args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
