"""Pretraining and fine-tuning data: Megatron indexed files, tokenizers, datasets, the demo corpus."""
