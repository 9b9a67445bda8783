"""Megatron-LM's user-code API over rapidtrain: what white-box scripts import from `megatron`,
`megatron.utils`, `megatron.model` and `megatron.data.gpt_dataset`, under the same names and contracts.

`from rapidtrain import get_args, get_tokenizer, print_rank_0, get_timers, mpu, GPTModel, ModelType,
average_losses_across_data_parallel_group, get_ltor_masks_and_position_ids, build_train_valid_test_datasets`
replaces those imports; a Megatron forward step (`(output_tensor, partial(loss_func, loss_mask))`, the loss
function returning `(loss, {"lm loss": averaged})`) trains as it does in Megatron, the dict in the log line.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist

from rapidtrain.core.errors import UserError
from rapidtrain.models.bert import BertModel as _BuiltinBert
from rapidtrain.models.config import ModelConfig
from rapidtrain.models.gpt import GPTModel as _BuiltinGPT


def _engine() -> Any:
    from rapidtrain.train.engine import current_engine

    return current_engine()


def get_tokenizer() -> Any:
    """The tokenizer of the run's flags (--tokenizer-type and its files, or the demo corpus's), built once:
    `.eod`, `.vocab_size`, `.tokenize(text)`, `.detokenize(ids)`, `.cls`/`.sep`/`.pad`/`.mask`."""
    engine = _engine()
    if engine._tokenizer is None:
        settings = engine.plan.tokenizer
        if settings is None:
            raise UserError("get_tokenizer(): this run names no tokenizer. Give --tokenizer-type and its files "
                            "(--vocab-file, --merge-file or --tokenizer-model).")
        from rapidtrain.data.tokenizer import build_tokenizer

        engine._tokenizer = build_tokenizer(settings)
    return engine._tokenizer


def print_rank_0(message: Any) -> None:
    """Print on global rank 0 only (every rank when torch.distributed is not started)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def is_last_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1


def print_rank_last(message: Any) -> None:
    if is_last_rank():
        print(message, flush=True)


def get_timers() -> Any:
    """The run's named timers (`timers("name").start()` / `.stop()`); --log-timers-to-tensorboard writes them."""
    return _engine().timers


def average_losses_across_data_parallel_group(losses: Sequence[torch.Tensor]) -> torch.Tensor:
    """The losses, each averaged over the data-parallel ranks (one all-reduce), as a 1-D tensor."""
    from rapidtrain.compat import mpu

    averaged = torch.cat([loss.clone().detach().view(1) for loss in losses])
    group = mpu.get_data_parallel_group()
    if group is not None:
        dist.all_reduce(averaged, group=group)
        averaged = averaged / dist.get_world_size(group)
    return averaged


def get_ltor_masks_and_position_ids(
    data: torch.Tensor,
    eod_token: int,
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's left-to-right masks of tokens [b, s]: (attention_mask bool [b or 1, 1, s, s], True where
    attention is masked out; loss_mask float [b, s], 0 on end-of-document tokens with eod_mask_loss;
    position_ids [b, s], restarting after each end of document with reset_position_ids)."""
    batch, seq = data.shape
    positions = torch.arange(seq, device=data.device)
    # segment[b, j] = end-of-document tokens before position j: a new document starts after each.
    segment = torch.cat([torch.zeros_like(data[:, :1]), (data[:, :-1] == eod_token).long().cumsum(dim=1)], dim=1)
    causal = positions[None, :] <= positions[:, None]
    if reset_attention_mask:
        allowed = causal[None] & (segment[:, None, :] == segment[:, :, None])
        attention_mask = ~allowed[:, None]
    else:
        attention_mask = ~causal[None, None]
    loss_mask = torch.ones(data.shape, dtype=torch.float, device=data.device)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0
    position_ids = positions.expand(batch, seq).clone()
    if reset_position_ids:
        starts = torch.where(torch.diff(segment, dim=1, prepend=torch.zeros_like(segment[:, :1])) > 0,
                             positions.expand(batch, seq), torch.zeros_like(position_ids))
        position_ids = positions - starts.cummax(dim=1).values
    return attention_mask, loss_mask, position_ids


class ModelType(enum.Enum):
    """Megatron's model types; a user script may set `args.model_type` to one (rapidtrain reads its plan)."""

    encoder_or_decoder = 1
    encoder_and_decoder = 2
    retro_encoder = 3
    retro_decoder = 4


def _built_in_config(kind: str, num_tokentypes: int, pre_process: bool, post_process: bool,
                     **changes: Any) -> ModelConfig:
    if not (pre_process and post_process):
        raise UserError(f"{kind}(pre_process={pre_process}, post_process={post_process}): rapidtrain splits the "
                        "model into pipeline stages itself (--pipeline-model-parallel-size); build the whole model "
                        "(pre_process=True, post_process=True).")
    config = _engine().plan.model
    if config is None:
        raise UserError(f"{kind}(): the model's shape comes from the flags (--num-layers, --hidden-size, ...) and its "
                        "vocabulary from the tokenizer; this run names no tokenizer (--tokenizer-type).")
    return dataclasses.replace(config, model_type=kind[:-5].lower(), num_tokentypes=num_tokentypes, **changes)


def _initialise(model: torch.nn.Module) -> None:
    """As the built-in pretraining does: seeded per parameter name, then any Hugging Face weights."""
    from rapidtrain.models import init_weights

    init_weights(model, _engine().plan.training.seed)
    # The built-in models keep their ModelConfig as .config (nn.Module's __getattr__ types it Tensor | Module).
    config = cast(ModelConfig, model.config)
    if config.hf_weights:
        from rapidtrain.models.hf_weights import load_hf_weights

        load_hf_weights(model, config.hf_weights)


class GPTModel(_BuiltinGPT):
    """Megatron's GPTModel(num_tokentypes, parallel_output, pre_process, post_process) over the built-in GPT,
    shaped by the flags. `model(tokens, position_ids, attention_mask, labels=labels)` returns the per-token
    loss [b, s] (logits without labels); `attention_mask` is Megatron's (True = masked out): its causal form
    [1, 1, s, s] is the causal attention the model always applies, a per-sample one [b, 1, s, s]
    (--reset-attention-mask) is applied as given.

    `parallel_output`: with tensor parallelism the logits stay a DTensor sharded over the vocabulary and the
    loss is computed vocabulary-parallel either way.
    """

    def __init__(self, num_tokentypes: int = 0, parallel_output: bool = True, pre_process: bool = True,
                 post_process: bool = True, config: ModelConfig | None = None) -> None:
        super().__init__(config or _built_in_config("GPTModel", num_tokentypes, pre_process, post_process))
        self.parallel_output = parallel_output
        _initialise(self)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,  # type: ignore[override]
                attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                tokentype_ids: torch.Tensor | None = None, **ignored: Any) -> torch.Tensor:
        return super().forward(input_ids, position_ids, _may_attend(attention_mask), labels, tokentype_ids)


def _may_attend(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Megatron's mask (True = masked out) as the built-in models take it (True = may attend); the shared causal
    mask is the causal attention they always apply."""
    if attention_mask is None or attention_mask.dim() == 4 and attention_mask.shape[0] == 1:
        return None
    return ~attention_mask.bool()


class BertModel(_BuiltinBert):
    """Megatron's BertModel(num_tokentypes, add_binary_head, parallel_output, pre_process, post_process) over the
    built-in BERT. `model(tokens, padding_mask, tokentype_ids=types, lm_labels=labels)` returns the per-token
    masked-LM loss, and with the binary head (lm loss, binary logits), as Megatron's."""

    def __init__(self, num_tokentypes: int = 2, add_binary_head: bool = True, parallel_output: bool = True,
                 pre_process: bool = True, post_process: bool = True, config: ModelConfig | None = None) -> None:
        super().__init__(config or _built_in_config("BertModel", num_tokentypes, pre_process, post_process,
                                                    bert_binary_head=add_binary_head))
        self.parallel_output = parallel_output
        _initialise(self)


# ---- megatron.data.gpt_dataset.build_train_valid_test_datasets ----

class TextSamples(torch.utils.data.Dataset):
    """Megatron's GPT samples: {"text": seq_length + 1 token ids} (tokens and labels are its shifts)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        sample = self.dataset[idx]
        return {"text": np.concatenate([sample["tokens"], sample["labels"][-1:]]).astype(np.int64)}


def build_train_valid_test_datasets(
    data_prefix: Sequence[str] | str,
    data_impl: str,
    splits_string: str,
    train_valid_test_num_samples: Sequence[int],
    seq_length: int,
    seed: int,
    skip_warmup: bool = True,
    **unused: Any,
) -> tuple[Any, Any, Any]:
    """Megatron's GPT datasets of --data-path (a prefix or a weighted blend) split by `splits_string`: rapidtrain's
    GPT dataset (Megatron's sample order) whose samples are {"text": ...}; `skip_warmup=False` reads the files
    once first (--mmap-warmup)."""
    from rapidtrain.data.blending import parse_data_path
    from rapidtrain.data.gpt_dataset import GPTDatasetConfig, build_gpt_datasets
    from rapidtrain.data.indexed import warm_up

    prefixes = [data_prefix] if isinstance(data_prefix, str) else list(data_prefix)
    if not skip_warmup:
        for prefix in parse_data_path(prefixes)[0]:
            warm_up(prefix)
    plan = _engine().plan
    config = GPTDatasetConfig(data_prefix=prefixes, split=splits_string, seq_length=seq_length, seed=seed,
                              eod=get_tokenizer().eod, eod_mask_loss=False, data_impl=data_impl,
                              cache_dir=plan.data.cache_path,
                              vocab_size=plan.model.vocab_size if plan.model else None)
    splits = build_gpt_datasets(config, list(train_valid_test_num_samples))
    train, valid, test = (TextSamples(d) if d is not None else None for d in splits)
    return train, valid, test


# ---- megatron.training.pretrain ----

def pretrain(
    train_valid_test_dataset_provider: Any,
    model_provider: Any,
    model_type: Any,
    forward_step_func: Any,
    process_non_loss_data_func: Any = None,
    extra_args_provider: Any = None,
    args_defaults: dict | None = None,
    **unused: Any,
) -> dict[str, float]:
    """Megatron's `pretrain(...)`: parse the flags (with `args_defaults` for those not given), then train the
    model of `model_provider(pre_process, post_process)` on the datasets of
    `train_valid_test_dataset_provider(train_val_test_num_samples)` with `forward_step_func(data_iterator,
    model)` through rapidtrain's PreTrainer (its loop, layouts, checkpoints and log line)."""
    from rapidtrain.train.engine import Engine
    from rapidtrain.train.pretrainer import PreTrainer

    class MegatronScript(PreTrainer):
        # PreTrainer's hook takes the sample counts where Trainer's takes none (as PreTrainer itself declares).
        def train_valid_test_datasets_provider(  # type: ignore[override]
            self, train_val_test_num_samples: list[int]
        ) -> tuple[Any, Any, Any]:
            return train_valid_test_dataset_provider(train_val_test_num_samples)

        def model_optimizer_lr_scheduler_provider(self) -> tuple:
            return model_provider(pre_process=True, post_process=True), None, None

        def run_forward_step(self, data_iterator: Any, model: Any) -> Any:
            return forward_step_func(data_iterator, model)

    engine = Engine(extra_args_provider=extra_args_provider, defaults=args_defaults)
    results = MegatronScript(engine).train()
    engine.shutdown()
    return results
