"""Flags whose meaning differs between the parsers users come from, and which origin's meaning rapidtrain takes and
how it tells: written once here, rendered into docs/megatron-compat.md by scripts/make_megatron_compat.py. The
decisions themselves live where the flags are read (surface_meanings.py, meanings.py, deepspeed_keys.py); each
leaves a line in the plan saying which meaning it took."""

from __future__ import annotations

# (flags, what each origin means, what rapidtrain takes and how it decides)
DIFFERING_MEANINGS: tuple[tuple[str, str, str], ...] = (
    ("`--num-experts` without a capacity flag",
     "Megatron-Core: dropless (every token reaches its k experts) unless `--moe-expert-capacity-factor` is given. "
     "Megatron-DeepSpeed (DeepSpeed-MoE) and Rapidformer: capacity factor 1 (`--moe-train-capacity-factor`), "
     "tokens over an expert's capacity dropped unless `--disable-moe-token-dropping`",
     "by the MoE flags typed: only Megatron-Core's (`--moe-router-topk`, `--moe-token-dispatcher-type`, "
     "`--moe-grouped-gemm`, ...) → dropless; DeepSpeed-MoE's or Rapidformer's (`--topk`, `--moe-min-capacity`, "
     "`--moe-loss-coeff`, ...) or none → capacity 1, dropping. The plan's note names the origin and the flags"),
    ("`--num-experts` without `--moe-aux-loss-coeff` / `--moe-loss-coeff`",
     "Megatron-Core: no balancing loss (`--moe-aux-loss-coeff` defaults to 0). Megatron-DeepSpeed (DeepSpeed-MoE): "
     "weight 0.1. Pai-Megatron-Patch: 0.01",
     "0.01 (Pai's and rapidtrain's default) whatever the flags: rapidtrain's MoE flags are Megatron-Core's spellings, "
     "so they cannot tell the origin, and a run that silently lost its balancing loss would collapse onto a few "
     "experts. The plan's note gives the three defaults and the flag to type"),
    ("`--moe-expert-capacity-factor`, `--moe-train-capacity-factor`, `--moe-capacity-factor`",
     "Megatron-Core's, Megatron-DeepSpeed's and rapidtrain's names of the capacity factor; in every origin a "
     "capacity factor given means tokens over capacity are dropped",
     "the factor as given, with dropping (`--disable-moe-token-dropping` still turns dropping off)"),
    ("`--pretrained-model-name-or-path` of a Megatron-format folder",
     "Rapidformer: the checkpoint to start from (or to resume, when it is also `--save`); elsewhere a Hugging Face "
     "folder",
     "by the folder's contents: a Megatron/rapidtrain checkpoint folder is `--load` (model only from iteration 0 "
     "with `--finetune`); a Hugging Face folder is the model (or initialises the built-in one)"),
    ("`--pretrained-checkpoint`",
     "Megatron's tasks (`tasks/main.py --task MNLI/RACE`): the BERT the task model starts from; Pai and "
     "Megatron-DeepSpeed scripts: the weights to fine-tune",
     "by `--task`: a Megatron task starts its model from it; otherwise `--load DIR --finetune`"),
    ("`--epochs`",
     "Rapidformer's and Megatron's task fine-tuning: passes over the task data; Pai's SFT: passes over its JSON "
     "records; Megatron pretraining has none",
     "passes over the fine-tuning data (Hugging Face tasks, a Finetuner, Pai's `--dataset JSON-SFT` / `LLama-SFT` "
     "on the built-in model: whole global batches an epoch, the iterations written into the plan); refused for "
     "pretraining on a sample stream"),
    ("`--eod-mask-loss` with SFT data",
     "Megatron: no loss on end-of-document labels; Pai's SFT batches: the loss mask comes from the labels (its "
     "`--eod-mask-loss` changes nothing there)",
     "Pai's with `--dataset JSON-SFT` / `LLama-SFT` (the answers' end token carries loss; the plan says the flag "
     "has no effect); Megatron's on indexed data"),
    ("`--reset-position-ids`, `--reset-attention-mask` with SFT data",
     "Megatron: positions and attention restart after each end-of-document token of a packed sample; Pai: "
     "sequence packing of its SFT data",
     "with `--dataset JSON-SFT`: whole conversations packed into each row, positions and attention restarting at "
     "each conversation (by the packing's own boundaries); Megatron's on indexed data"),
    ("`--train-mode finetune`",
     "Pai: SFT on `JSON-SFT` records, or on its SFT builder's sequence/label-pair indexed data (`MMAP`)",
     "the JSON kinds train; the indexed sequence/label pairs are refused by name"),
    ("a DeepSpeed config's `optimizer.params.lr` / `weight_decay`",
     "DeepSpeed alone: the optimizer's rate and decay; Megatron-DeepSpeed: overwritten at every step by "
     "Megatron's schedule from `--lr` / `--weight-decay`",
     "Megatron-DeepSpeed's: the flags' schedule (the plan names each key); `betas` and `eps` are read"),
    ("`--tokenizer-type JiebaBPETokenizer`, `--patch-tokenizer-type JiebaBPETokenizer`",
     "Pai-Megatron-Patch (RapidformerPro): jieba's words through the BPE of a tokenizer.json; Pai's other patch "
     "types are Hugging Face tokenizer folders",
     "the Jieba BPE (rjieba or jieba must be installed) from `--vocab-file`; other patch types a Hugging Face "
     "folder"),
    ("`--lora-rank`",
     "rapidtrain's black-box fine-tuning: peft adapters on a Hugging Face model",
     "by the model: peft's on a Hugging Face model; rapidtrain's own adapters on the built-in model (split with "
     "their layers under tensor parallelism, folded into the weights on export)"),
)


def origin_meanings_markdown() -> str:
    rows = "\n".join(f"| {flags} | {origins} | {taken} |" for flags, origins, taken in DIFFERING_MEANINGS)
    return ("Where the parsers users come from give one flag different meanings, rapidtrain takes one origin's by "
            "what the command line shows, and the plan says which.\n\n| flags | the origins' meanings | what "
            "rapidtrain takes, and how it tells |\n|---|---|---|\n" + rows)
