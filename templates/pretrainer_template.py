"""PreTrainer template: your own model, pretrained on Megatron indexed data (iteration-based). Run it with

    rapidtrain --user-script pretrainer_template.py --train-iters 200 --micro-batch-size 8 \
        --global-batch-size 32 --seq-length 128 --lr 1e-3 --lr-warmup-iters 10 \
        [--data-path PREFIX --tokenizer-type ... (default: the built-in demo corpus)] [--bf16] [--zero-2-...]

rapidtrain builds the GPT-style samples (`tokens`, `labels`, `loss_mask`, `position_ids`) from --data-path
with Megatron's index files, wraps the model per the flags, and prints Megatron's log line; --save and
--load checkpoint and resume exactly; --eval-interval/--eval-iters evaluate on the validation split.
The model here is a Hugging Face GPT-2 built from a config (any torch module works).
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from rapidtrain import PreTrainer, RapidformerEngine, get_args
from rapidtrain.data.gpt_dataset import GPTDatasetConfig, build_gpt_datasets
from rapidtrain.data.tokenizer import build_tokenizer


class MyPreTrainer(PreTrainer):
    def __init__(self, engine):
        super().__init__(engine=engine)
        args = get_args()
        if not args.data_path:  # no data given: the built-in demo corpus (prepared on first use)
            from rapidtrain.data.demo import prepare_demo_data

            demo = prepare_demo_data(progress=engine.is_main_process)
            args.data_path = [demo.data_prefix]
            args.tokenizer_type, args.tokenizer_model = demo.tokenizer_type, demo.tokenizer_model
        from rapidtrain.cli import tokenizer_settings

        self.tokenizer = build_tokenizer(tokenizer_settings(args))

    def train_valid_test_datasets_provider(self, train_val_test_num_samples):
        """→ (train, valid, test) datasets with at least the asked number of samples each."""
        args = get_args()
        config = GPTDatasetConfig(
            data_prefix=args.data_path,
            split=args.split,
            seq_length=args.seq_length,
            seed=args.seed,
            eod=self.tokenizer.eod,
            eod_mask_loss=args.eod_mask_loss,
            data_impl=args.data_impl,
            cache_dir=args.data_cache_path,
        )
        return build_gpt_datasets(config, train_val_test_num_samples)

    def model_optimizer_lr_scheduler_provider(self):
        """→ (model, optimizer, scheduler); None, None: built from the flags (Megatron's schedule)."""
        args = get_args()
        config = GPT2Config(
            vocab_size=self.tokenizer.vocab_size,
            n_positions=args.seq_length,
            n_embd=args.hidden_size,
            n_layer=args.num_layers,
            n_head=args.num_attention_heads,
            resid_pdrop=args.hidden_dropout,
            embd_pdrop=args.hidden_dropout,
            attn_pdrop=args.attention_dropout,
        )
        return GPT2LMHeadModel(config), None, None

    def run_forward_step(self, data_iterator, model):
        """One micro-batch → (loss sum, token count): rapidtrain averages over the global batch's tokens."""
        batch = next(data_iterator)
        tokens = batch["tokens"].to(self.engine.device)
        labels = batch["labels"].to(self.engine.device)
        loss_mask = batch["loss_mask"].to(self.engine.device).float()
        logits = model(input_ids=tokens).logits
        per_token = torch.nn.functional.cross_entropy(
            logits.float().transpose(1, 2), labels, reduction="none"
        )
        return (per_token * loss_mask).sum(), loss_mask.sum()


if __name__ == "__main__":
    engine = RapidformerEngine()
    MyPreTrainer(engine=engine).train()
