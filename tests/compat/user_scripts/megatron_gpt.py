"""A user's GPT pretraining script in Megatron-LM's shape (model provider, dataset provider, forward step handed
to `pretrain`), written against rapidtrain's Megatron API: `from rapidtrain import ...` where Megatron's own
scripts import `megatron`."""

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


def build_model(pre_process=True, post_process=True):
    print_rank_0("building GPT model ...")
    return GPTModel(num_tokentypes=0, parallel_output=True, pre_process=pre_process, post_process=post_process)


def build_datasets(num_samples):
    args = get_args()
    return build_train_valid_test_datasets(data_prefix=args.data_path, data_impl=args.data_impl,
                                           splits_string=args.split, train_valid_test_num_samples=num_samples,
                                           seq_length=args.seq_length, seed=args.seed,
                                           skip_warmup=not args.mmap_warmup)


def next_batch(data_iterator):
    """Inputs shifted from targets by one token, with the masks the flags ask for; rank 0 of each tensor-parallel
    group reads, the others receive."""
    args = get_args()
    sample = next(data_iterator) if data_iterator is not None else None
    ids = mpu.broadcast_data(["text"], sample, torch.int64)["text"]
    inputs, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    mask, loss_mask, positions = get_ltor_masks_and_position_ids(inputs, get_tokenizer().eod, args.reset_position_ids,
                                                                 args.reset_attention_mask, args.eod_mask_loss)
    return inputs, targets, mask, loss_mask, positions


def masked_mean(loss_mask, token_losses):
    weights = loss_mask.view(-1).float()
    mean = torch.sum(token_losses.view(-1).float() * weights) / weights.sum()
    return mean, {"lm loss": average_losses_across_data_parallel_group([mean])[0]}


def step(data_iterator, model):
    timer = get_timers()("batch-generator")
    timer.start()
    inputs, targets, mask, loss_mask, positions = next_batch(data_iterator)
    timer.stop()
    return model(inputs, positions, mask, labels=targets), partial(masked_mean, loss_mask)


if __name__ == "__main__":
    pretrain(build_datasets, build_model, ModelType.encoder_or_decoder, step,
             args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
