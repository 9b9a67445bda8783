"""The built-in models' pretraining template: Megatron's datasets on --data-path (a blend, per-split paths, or the
demo corpus), Megatron's masked per-token loss, evaluation over --eval-iters, and the demo's greedy sample.
`rapidtrain/pretrain.py` (and its Megatron names pretrain_gpt.py, pretrain_bert.py) run it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

from rapidtrain.data.bert_dataset import BERTDatasetConfig, build_bert_datasets
from rapidtrain.data.blending import parse_data_path
from rapidtrain.data.chat_sft import SampleLayout, build_raw_json_datasets, encoded_rows
from rapidtrain.data.demo import prepare_demo_data, unigram_entropy
from rapidtrain.data.dynamic_shape import (
    BertTrimCollator,
    LengthBucketBatchSampler,
    PretrainingCollator,
    build_unpacked_datasets,
)
from rapidtrain.data.gpt_dataset import GPTDatasetConfig, build_gpt_datasets, build_weighted_group
from rapidtrain.data.idxmap_sft import IdxmapSftDataset
from rapidtrain.data.indexed import warm_up
from rapidtrain.data.tokenizer import Tokenizer, build_tokenizer
from rapidtrain.models import build_model
from rapidtrain.models.config import ModelConfig
from rapidtrain.models.counting import model_flops_per_iteration
from rapidtrain.parallel.meta_init import build_model_for
from rapidtrain.train import demo_end
from rapidtrain.train.demo_end import DEMO_PROMPT, DEMO_SAMPLE_TOKENS
from rapidtrain.train.engine import Engine
from rapidtrain.train.loss_curve import LossCurve
from rapidtrain.train.pretrainer import PreTrainer
from rapidtrain.train.tracking import Writers

__all__ = ["DEMO_PROMPT", "DEMO_SAMPLE_TOKENS", "MegatronPreTrainer", "demo_sample_unavailable"]


class MegatronPreTrainer(PreTrainer):
    """The built-in models on --data-path (or per-split paths, or the demo corpus), Megatron's datasets and loss."""
    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.data_prefix = self.prepare_data()
        self.tokenizer = self.build_tokenizer()
        self._encoded: dict[str, Any] = {}  # raw JSON files' rows, by path (an epoch-based run reads them first)
        self.loss_curve: LossCurve | None = None  # the demo's, on its logging rank

    def prepare_data(self) -> list[str]:
        """The --data-path prefixes (a blend keeps its weights), or the demo corpus, built on first use (BERT with
        its binary head reads the demo's sentence-split copy)."""
        data = self.plan.data
        if data.mmap_warmup:
            self.warm_up_data()
        if data.source != "demo":
            return list(data.data_path)

        demo = prepare_demo_data(progress=self.engine.is_main_process)
        sentences = self.plan.model is not None and self.model_config.bert_binary_head
        self.engine.print_rank0(f" no --data-path: training on the demo corpus ({demo.num_documents:,} "
                                f"documents, {demo.num_tokens:,} tokens) at "
                                f"{demo.sentence_prefix if sentences else demo.data_prefix}")
        return [demo.sentence_prefix if sentences else demo.data_prefix]

    def warm_up_data(self) -> None:
        """--mmap-warmup: read each .bin file once, so the first iterations do not wait on page faults."""

        paths = [self.plan.data.data_path, *(self.plan.data.split_paths or ())]
        prefixes = {p for path in paths if path for p in parse_data_path(path)[0]}
        prefixes |= {c.prefix for groups in self.plan.data.weighted_splits or () for group in groups
                     for c in group.components}
        read = sum(warm_up(prefix) for prefix in sorted(prefixes))
        self.engine.print_rank0(f" --mmap-warmup: read {read / 2**20:,.1f} MiB of indexed data")

    @property
    def model_config(self) -> ModelConfig:
        """The built-in model's settings: this template trains only the built-in models, which the plan holds."""
        model = self.plan.model
        assert model is not None, "the built-in pretraining runs a plan with a built-in model"
        return model

    def build_tokenizer(self) -> Tokenizer:
        settings = self.plan.tokenizer
        if settings is None:  # the rules refuse --data-path without a tokenizer before this point
            raise SystemExit("rapidtrain: --data-path needs --tokenizer-type (and its files).")
        return build_tokenizer(settings)

    def train_valid_test_datasets_provider(  # type: ignore[override]  # Rapidformer: the PreTrainer hook takes counts
        self, train_val_test_num_samples: list[int]
    ) -> tuple[Any, Any, Any]:
        data, model = self.plan.data, self.model_config
        if data.dynamic_shape and model.model_type == "gpt":
            return self.unpacked_datasets()
        if data.weighted_splits is not None:
            return self.weighted_datasets(data.weighted_splits, train_val_test_num_samples)
        if data.raw_json is not None:
            return self.raw_json_datasets(train_val_test_num_samples)
        build = self.bert_datasets if model.model_type == "bert" else self.gpt_datasets
        if data.split_paths is None:
            return build(self.data_prefix, data.split, train_val_test_num_samples)
        return per_split_datasets(data.split_paths, build, train_val_test_num_samples)

    def bert_datasets(self, prefixes: list[str], split: str, counts: list[int]) -> tuple[Any, Any, Any]:
        data, model, t = self.plan.data, self.model_config, self.tokenizer
        config = BERTDatasetConfig(data_prefix=prefixes, split=split, seq_length=model.seq_length,
                                   seed=data.seed, vocab_size=t.vocab_size, cls_id=t.cls, sep_id=t.sep,
                                   mask_id=t.mask, pad_id=t.pad, mask_prob=data.mask_prob,
                                   short_seq_prob=data.short_seq_prob, binary_head=model.bert_binary_head,
                                   data_impl=data.data_impl, cache_dir=data.cache_path)
        return build_bert_datasets(config, counts)

    def gpt_datasets(self, prefixes: list[str], split: str, counts: list[int]) -> tuple[Any, Any, Any]:
        if self.plan.data.idxmap_sft:
            return self.idxmap_sft_datasets(prefixes, split, counts)
        return build_gpt_datasets(self.gpt_config(prefixes, split), counts)

    def idxmap_sft_datasets(self, prefixes: list[str], split: str, counts: list[int]) -> tuple[Any, Any, Any]:
        """Pai's SFT idxmap: GPT samples of twice the sequence length (a document each: its tokens, then their
        labels) turned into SFT rows. The ids are not checked against the vocabulary: negative ones are markers."""
        seq_length = self.model_config.seq_length
        config = dataclasses.replace(self.gpt_config(prefixes, split), seq_length=2 * seq_length, vocab_size=None,
                                     eod_mask_loss=False, reset_position_ids=False, reset_attention_mask=False,
                                     document_ids=False)
        data = self.plan.data
        layout = SampleLayout(data.reset_position_ids, data.reset_attention_mask, self.plan.attention.document_ids)
        datasets = build_gpt_datasets(config, counts)
        return tuple(IdxmapSftDataset(d, seq_length, layout) if d is not None else None  # type: ignore[return-value]
                     for d in datasets)

    def weighted_datasets(self, splits: tuple, counts: list[int]) -> tuple[Any, Any, Any]:
        """BigScience's weighted split paths: the training group's blend, and each validation and test group by
        its name (each evaluated on its own)."""
        config = self.gpt_config([], "1,0,0")  # the groups name their prefixes and document ranges themselves
        train = build_weighted_group(splits[0][0], config, counts[0], "train") if splits[0] else None
        valid, test = self._named_groups(splits[1:], counts[1:], config)
        return train, valid, test

    def raw_json_datasets(self, counts: list[int]) -> tuple[Any, Any, Any]:
        """Pai's raw JSON kinds: the records tokenized now, the prompt masked out of the loss."""
        data = self.plan.data
        assert data.raw_json is not None and data.max_padding_length is not None  # the plan sets both together
        datasets = build_raw_json_datasets(data.split_paths or (None, None, None), data.raw_json,
                                           data.max_padding_length, self.tokenizer, counts, data.seed,
                                           self.raw_json_layout(), self._encoded)
        train = datasets[0]
        self.engine.print_rank0(f" --dataset {data.raw_json}: {len(train.ids):,} rows tokenized"
                                + (f", {train.dropped:,} records longer than the padded length dropped"
                                   if train.dropped else ""))
        return datasets

    def raw_json_layout(self, whole_passes: bool = True) -> SampleLayout:
        data = self.plan.data
        per_pass = None
        if whole_passes and self.plan.training.epochs and self.steps_per_epoch:  # an epoch: whole global batches
            per_pass = self.steps_per_epoch * self.plan.batches.global_batch_size
        return SampleLayout(data.reset_position_ids, data.reset_attention_mask, self.plan.attention.document_ids,
                            per_pass)

    def samples_per_epoch_of_data(self) -> int:
        """Pai's SFT JSON: an epoch is a pass over the training file's rows (records, or packed rows)."""
        data = self.plan.data
        if data.raw_json is None or not data.split_paths or not data.split_paths[0]:
            return super().samples_per_epoch_of_data()
        assert data.max_padding_length is not None  # the plan sets it with raw_json
        path = data.split_paths[0][0]
        self._encoded[path] = encoded_rows(path, data.raw_json, data.max_padding_length, self.tokenizer,
                                           self.raw_json_layout(whole_passes=False))
        return len(self._encoded[path][0])

    @staticmethod
    def _named_groups(splits: tuple, counts: list[int], config: Any) -> list[dict[str, Any] | None]:
        return [{group.name: build_weighted_group(group, config, count, name) for group in groups} or None
                for groups, count, name in zip(splits, counts, ("valid", "test"), strict=True)]

    def gpt_config(self, prefixes: list[str], split: str) -> Any:
        data, model = self.plan.data, self.model_config
        return GPTDatasetConfig(data_prefix=prefixes, split=split, seq_length=model.seq_length,
                                seed=data.seed, eod=self.tokenizer.eod, eod_mask_loss=data.eod_mask_loss,
                                reset_position_ids=data.reset_position_ids,
                                reset_attention_mask=data.reset_attention_mask, data_impl=data.data_impl,
                                cache_dir=data.cache_path, vocab_size=model.vocab_size,
                                # Context parallelism masks documents by their ids (a dense [s, s] mask cannot
                                # be split along the sequence).
                                document_ids=self.plan.attention.document_ids
                                or self.plan.layout.context_parallel_size > 1)

    # ---- --data-iterator dynamic-shape ----
    def supports_dynamic_shape(self) -> bool:
        return True

    def unpacked_datasets(self) -> tuple[Any, Any, Any]:
        """GPT with dynamic shapes: one document per sample (at most --seq-length + 1 tokens), not packed."""

        return build_unpacked_datasets(self.gpt_config(self.data_prefix, self.plan.data.split))

    def collate_fn(self) -> Any:
        """Dynamic shape: GPT's unpacked documents padded to the batch's longest; BERT's samples (of
        varying length: --short-seq-prob, sentence ends) cut to the batch's longest. Both round up to 8."""
        if not self.plan.data.dynamic_shape:
            return None

        if self.model_config.model_type == "bert":
            return BertTrimCollator()
        return PretrainingCollator(pad_id=self.tokenizer.eod, eod=self.tokenizer.eod,
                                   eod_mask_loss=self.plan.data.eod_mask_loss)

    def train_batch_sampler(self, dataset: Any, consumed_samples: int) -> Any:
        """Dynamic shape: micro-batches of similar-length samples (GPT's documents, BERT's samples), epoch after
        epoch."""
        if not self.plan.data.dynamic_shape:
            return super().train_batch_sampler(dataset, consumed_samples)

        data = self.plan.data
        return EpochsOf(LengthBucketBatchSampler(dataset.lengths, data.micro_batch_size,
                                                 self.engine.mesh.data_parallel_rank,
                                                 self.plan.layout.data_parallel_size, seed=data.seed,
                                                 consumed_samples=consumed_samples))

    # ---- model, FLOPs, forward ----
    def model_optimizer_lr_scheduler_provider(self) -> tuple[Any, None, None]:
        """The built-in model: on the meta device when the plan shards it (each rank materializes its part when
        it is composed), else whole and initialised."""

        return build_model_for(self.plan), None, None

    def model_factory(self) -> Any:
        return lambda: build_model(self.model_config, seed=None)

    def flops_per_iteration(self, interval: Any = None) -> float | None:
        return float(model_flops_per_iteration(self.model_config, self.last_global_batch))

    def end_of_training(self, stopped: bool) -> dict[str, Any]:
        results = super().end_of_training(stopped)
        if self.plan.data.source == "demo" and not stopped and self.finished():
            self.demo_end()
        return results

    def open_writers(self) -> Writers:
        """The demo's logging rank also keeps its losses for the picture it draws at the end."""
        writers = super().open_writers()
        if self.plan.data.source == "demo" and self.is_logging_rank:
            self.loss_curve = LossCurve(self.loss_name)
            writers.writers.append(self.loss_curve)
        return writers

    def demo_end(self) -> None:
        """What the demo prints last (train/demo_end.py): the validation loss against the unigram baseline, a greedy
        and a sampled continuation, the loss curve and the run's files. Every rank evaluates and generates (tensor
        parallel ranks together); rank 0 prints."""
        if self.last_validation[0] != self.iteration and self.valid_ds is not None and self.plan.training.eval_iters:
            self.last_validation = (self.iteration, self.evaluate_each("validation", self.valid_ds))
        iteration, validation = self.last_validation
        if "validation loss" in validation:
            self.engine.print_rank0(demo_end.baseline_line(validation["validation loss"], self.unigram_entropy(),
                                                           iteration))
        reason = demo_sample_unavailable(self.plan)
        if reason:
            save = self.plan.checkpoint.save
            ids = self.plan.tokenizer is not None and self.plan.tokenizer.tokenizer_type == "NullTokenizer"
            prompt = "ID ID ..." if ids else DEMO_PROMPT  # the NullTokenizer's prompt: token ids
            self.engine.print_rank0(f" sample: not generated here ({reason}); "
                                    + (f"`rapidtrain generate --load {save} --prompt '{prompt}'` loads the "
                                       "checkpoint whole in one process" if save else
                                       "save with --save, then `rapidtrain generate --load SAVE --prompt ...`"))
        else:
            self.engine.print_rank0("\n".join(demo_end.sample_lines(self.model, self.tokenizer)))
        if not self.is_logging_rank:
            return
        save, tensorboard = self.plan.checkpoint.save, self.plan.logging.tensorboard_dir
        curve = demo_end.loss_curve_path(save, tensorboard)
        problem = self.loss_curve.draw(curve, demo_end.reference_losses(self.unigram_entropy())) \
            if curve and self.loss_curve else ""
        print("\n".join(demo_end.files_lines(save, tensorboard, curve, problem)), flush=True)

    def unigram_entropy(self) -> float:
        return unigram_entropy(self.data_prefix[0])

    def run_forward_step(self, data_iterator: Any, model: Any) -> Any:
        batch = {k: v.to(self.engine.device, non_blocking=True) for k, v in next(data_iterator).items()}
        if self.model_config.model_type == "bert":
            return self._bert_forward(batch, model)
        mask = batch.get("attention_mask")
        documents = {"document_ids": batch["document_ids"]} if "document_ids" in batch else {}
        losses = model(batch["tokens"], position_ids=batch["position_ids"],
                       attention_mask=None if mask is None else ~mask, labels=batch["labels"], **documents)
        return losses, lambda per_token: masked_sum(per_token, batch["loss_mask"])

    def _bert_forward(self, batch: dict[str, torch.Tensor], model: Any) -> Any:
        output = model(batch["text"], attention_mask=batch["padding_mask"], tokentype_ids=batch["types"],
                       lm_labels=batch["labels"])
        if not self.model_config.bert_binary_head:
            return output, lambda per_token: masked_sum(per_token, batch["loss_mask"])
        per_token, binary_logits = output
        lm_sum, count = masked_sum(per_token, batch["loss_mask"])
        lm_loss = lm_sum / count.clamp(min=1)
        sop = torch.nn.functional.cross_entropy(binary_logits.float(), batch["is_random"])
        # Megatron's BERT log line shows the two losses apart.
        return lm_loss + sop, {"lm loss": lm_loss.detach(), "sop loss": sop.detach()}


class EpochsOf:
    """A batch sampler that walks one epoch per `iter()` (the length buckets), walked again and again: the
    sample stream of iteration-based pretraining."""
    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield from self.sampler


def per_split_datasets(split_paths: tuple, build: Callable[[list[str], str, list[int]], tuple],
                       counts: list[int]) -> tuple[Any, Any, Any]:
    """Megatron's --train-data-path / --valid-data-path / --test-data-path: each split from all the documents of
    its own data (a prefix or a blend); a split without a path is empty."""
    datasets: list[Any] = []
    for index, paths in enumerate(split_paths):
        if not paths:
            datasets.append(None)
            continue
        only = [0, 0, 0]
        only[index] = 1
        wanted = [count if i == index else 0 for i, count in enumerate(counts)]
        datasets.append(build(list(paths), ",".join(map(str, only)), wanted)[index])
    return tuple(datasets)


def demo_sample_unavailable(plan: Any) -> str:
    """Why the demo's closing sample cannot be generated under this layout, or "" when it can."""
    if plan.model is None or plan.model.model_type != "gpt":
        return "only the GPT generates text"
    if plan.tokenizer is not None and plan.tokenizer.tokenizer_type == "NullTokenizer":
        return "the NullTokenizer reads token ids, not the prompt's text (--mock-data with --tokenizer-type " \
               "NullTokenizer has no text tokenizer)"
    if plan.layout.pipeline_parallel_size > 1:
        return "pipeline parallelism: each stage holds some layers only"
    if plan.layout.context_parallel_size > 1:
        return "context parallelism: its attention spans the ranks' parts of one sequence"
    if plan.switches.partitioning in ("fsdp", "sdp", "zero-3") or (
            plan.switches.partitioning in ("zero-1", "zero-2") and plan.switches.partitioning_engine == "fsdp2"):
        return f"{plan.switches.partitioning} partitioning shards the parameters over the ranks"
    return ""


def masked_sum(per_token: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the loss over tokens that count, how many count): the trainer averages over the global batch."""
    mask = loss_mask.float()
    return (per_token.float() * mask).sum(), mask.sum()
