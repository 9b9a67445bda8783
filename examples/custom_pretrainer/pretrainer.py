"""A custom PreTrainer: a plain PyTorch LSTM language model (no transformer, no Hugging Face) pretrained on
Megatron indexed data — the built-in demo corpus unless --data-path and --tokenizer-type say otherwise.

    rapidtrain --user-script examples/custom_pretrainer/pretrainer.py --train-iters 100 --seq-length 64 ...

The PreTrainer brings Megatron's sample streams, log line, evaluation, checkpoints and every switch of the
command line (DDP/ZeRO/FSDP, mixed precision, gradient accumulation) to any torch module.
"""

import torch
from torch import nn

from rapidtrain import PreTrainer, RapidformerEngine, get_args
from rapidtrain.cli import tokenizer_settings
from rapidtrain.data.gpt_dataset import GPTDatasetConfig, build_gpt_datasets
from rapidtrain.data.tokenizer import build_tokenizer


class LSTMLanguageModel(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, num_layers: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, hidden_size)
        self.lstm = nn.LSTM(hidden_size, hidden_size, num_layers=num_layers, batch_first=True)
        self.output = nn.Linear(hidden_size, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(self.embedding(tokens))
        return self.output(hidden)


class LSTMPreTrainer(PreTrainer):
    def __init__(self, engine):
        super().__init__(engine=engine)
        args = get_args()
        if not args.data_path:
            from rapidtrain.data.demo import prepare_demo_data

            demo = prepare_demo_data(progress=engine.is_main_process)
            args.data_path = [demo.data_prefix]
            args.tokenizer_type, args.tokenizer_model = demo.tokenizer_type, demo.tokenizer_model
        self.tokenizer = build_tokenizer(tokenizer_settings(args))

    def train_valid_test_datasets_provider(self, train_val_test_num_samples):
        args = get_args()
        config = GPTDatasetConfig(
            data_prefix=args.data_path,
            split=args.split,
            seq_length=args.seq_length,
            seed=args.seed,
            eod=self.tokenizer.eod,
            data_impl=args.data_impl,
            cache_dir=args.data_cache_path,
        )
        return build_gpt_datasets(config, train_val_test_num_samples)

    def model_optimizer_lr_scheduler_provider(self):
        args = get_args()
        return LSTMLanguageModel(self.tokenizer.vocab_size, args.hidden_size, args.num_layers), None, None

    def run_forward_step(self, data_iterator, model):
        batch = next(data_iterator)
        tokens, labels = batch["tokens"].to(self.engine.device), batch["labels"].to(self.engine.device)
        loss_mask = batch["loss_mask"].to(self.engine.device).float()
        logits = model(tokens)
        per_token = nn.functional.cross_entropy(logits.float().transpose(1, 2), labels, reduction="none")
        return (
            per_token * loss_mask
        ).sum(), loss_mask.sum()  # summed: averaged over the global batch's tokens


if __name__ == "__main__":
    LSTMPreTrainer(engine=RapidformerEngine()).train()
