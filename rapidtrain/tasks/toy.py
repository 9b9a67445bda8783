"""Tiny local models, tokenizers and learnable data for examples, tests and benchmarks: nothing is downloaded,
everything is built in seconds from a seed (`python -m rapidtrain.tasks.toy --help`).

The data follow simple rules a small transformer learns within a few epochs: a sentence's label is the
sentiment of the marked words it contains, names and places are entities, an answer is the word the
question asks for, a target repeats its source.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

POSITIVE = ["good", "great", "fine", "lovely", "superb", "happy", "bright", "warm"]
NEGATIVE = ["bad", "awful", "poor", "dull", "sad", "grim", "cold", "weak"]
FILLER = [
    "the",
    "a",
    "movie",
    "plot",
    "actor",
    "film",
    "story",
    "scene",
    "music",
    "was",
    "is",
    "very",
    "quite",
    "and",
    "but",
    "with",
    "of",
    "this",
    "that",
    "it",
    "cast",
    "ending",
    "script",
    "show",
]
PEOPLE = [["alice"], ["bob"], ["carol"], ["mary", "jane"], ["john", "smith"], ["eve"]]
PLACES = [["paris"], ["rome"], ["new", "york"], ["oslo"], ["cairo"], ["hong", "kong"]]
THINGS = ["sky", "sea", "car", "door", "cup", "hat", "wall", "bird"]
COLOURS = ["red", "blue", "green", "black", "white", "pink", "gray", "gold"]
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def sentiment_records(count: int, seed: int) -> list[dict[str, Any]]:
    """SST-2 style rows: `sentence`, `label` (1 when its marked words are positive)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        label = rng.randrange(2)
        words = rng.choices(FILLER, k=rng.randint(4, 9)) + rng.choices(POSITIVE if label else NEGATIVE, k=2)
        rng.shuffle(words)
        rows.append({"sentence": " ".join(words), "label": label})
    return rows


def ner_records(count: int, seed: int) -> list[dict[str, Any]]:
    """CoNLL style rows: `tokens` and BIO `ner_tags` for people (PER) and places (LOC)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        tokens, tags = [], []
        for _ in range(rng.randint(3, 6)):
            choice = rng.random()
            if choice < 0.5:
                kind, name = ("PER", rng.choice(PEOPLE)) if choice < 0.25 else ("LOC", rng.choice(PLACES))
                tokens += name
                tags += [f"B-{kind}"] + [f"I-{kind}"] * (len(name) - 1)
            else:
                tokens.append(rng.choice(FILLER))
                tags.append("O")
        rows.append({"tokens": tokens, "ner_tags": tags})
    return rows


def qa_records(count: int, seed: int) -> list[dict[str, Any]]:
    """SQuAD style rows: the context states the colour of three things, the question asks for one."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        things = rng.sample(THINGS, 3)
        colours = [rng.choice(COLOURS) for _ in things]
        context = " ".join(f"the {t} is {c} ." for t, c in zip(things, colours, strict=True))
        asked = rng.randrange(3)
        sentence_start = context.index(f"the {things[asked]} is ")
        start = sentence_start + len(f"the {things[asked]} is ")
        rows.append(
            {
                "id": str(index),
                "question": f"what colour is the {things[asked]} ?",
                "context": context,
                "answers": {"text": [colours[asked]], "answer_start": [start]},
            }
        )
    return rows


def text_records(count: int, seed: int) -> list[dict[str, Any]]:
    """Language-model rows (`text`): sentences from a small grammar."""
    rng = random.Random(seed)
    return [
        {
            "text": f"the {rng.choice(THINGS)} is {rng.choice(COLOURS)} and the {rng.choice(THINGS)} is "
            f"{rng.choice(POSITIVE + NEGATIVE)} ."
        }
        for _ in range(count)
    ]


def copy_records(count: int, seed: int) -> list[dict[str, Any]]:
    """seq2seq rows: `target` repeats `source`."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        words = " ".join(rng.choices(THINGS + COLOURS, k=rng.randint(2, 5)))
        rows.append({"source": words, "target": words})
    return rows


def texts_of(rows: Iterable[dict[str, Any]]) -> list[str]:
    """Every string in the rows (lists of words joined), for training a tokenizer."""
    texts = []
    for row in rows:
        for value in row.values():
            if isinstance(value, str):
                texts.append(value)
            elif isinstance(value, list) and value and isinstance(value[0], str):
                texts.append(" ".join(value))
    return texts


def train_tokenizer(
    texts: list[str], directory: str | Path, vocab_size: int = 400, max_length: int = 128
) -> Any:
    """A lower-case WordPiece tokenizer (BERT's special tokens, [PAD] = 0) trained on `texts` and saved."""
    # transformers 5 exports BertTokenizerFast lazily (an alias of BertTokenizer), which its stubs do not show.
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertTokenizerFast  # type: ignore[attr-defined]

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.train_from_iterator(
        texts, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS)
    )
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    wrapped = BertTokenizerFast(tokenizer_object=tokenizer, model_max_length=max_length)
    wrapped.save_pretrained(str(directory))
    return wrapped


def save_tiny_model(
    kind: str,
    directory: str | Path,
    tokenizer: Any,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 2,
    max_length: int = 128,
    seed: int = 0,
    dropout: float = 0.1,
) -> Path:
    """A randomly initialised `bert` (masked LM), `gpt2` (causal LM) or `t5` saved with its tokenizer."""
    import torch
    import transformers as t

    ids = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id}
    special = {"bos_token_id": tokenizer.cls_token_id, "eos_token_id": tokenizer.sep_token_id}
    configs = {
        "bert": (
            t.BertForMaskedLM,
            t.BertConfig(
                hidden_size=hidden,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                intermediate_size=2 * hidden,
                max_position_embeddings=max_length,
                hidden_dropout_prob=dropout,
                attention_probs_dropout_prob=dropout,
                **ids,
            ),
        ),
        "gpt2": (
            t.GPT2LMHeadModel,
            t.GPT2Config(
                n_embd=hidden,
                n_layer=layers,
                n_head=heads,
                n_positions=max_length,
                resid_pdrop=dropout,
                embd_pdrop=dropout,
                attn_pdrop=dropout,
                **ids,
                **special,
            ),
        ),
        "t5": (
            t.T5ForConditionalGeneration,
            # T5Config's typed signature omits decoder_start_token_id, which it still takes and keeps.
            t.T5Config(  # type: ignore[call-arg]
                d_model=hidden,
                d_ff=2 * hidden,
                num_layers=layers,
                num_heads=heads,
                d_kv=hidden // heads,
                decoder_start_token_id=tokenizer.pad_token_id,
                dropout_rate=dropout,
                eos_token_id=tokenizer.sep_token_id,
                **ids,
            ),
        ),
    }
    model_class, config = configs[kind]
    torch.manual_seed(seed)
    model = model_class(config)
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return Path(directory)


def write_tsv(path: Path, rows: list[dict[str, Any]]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(
            f, fieldnames=list(rows[0]), delimiter="\t", quoting=csv.QUOTE_NONE, lineterminator="\n"
        )
        writer.writeheader()
        writer.writerows(rows)


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


def write_glue_folder(
    root: str | Path, name: str = "sst2", train: int = 512, dev: int = 128, seed: int = 0
) -> Path:
    """GLUE's SST-2 layout: train.tsv and dev.tsv (`sentence`, `label`), test.tsv (`index`, `sentence`)."""
    folder = Path(root) / name
    folder.mkdir(parents=True, exist_ok=True)
    write_tsv(folder / "train.tsv", sentiment_records(train, seed))
    write_tsv(folder / "dev.tsv", sentiment_records(dev, seed + 1))
    test = [{"index": i, "sentence": r["sentence"]} for i, r in enumerate(sentiment_records(dev, seed + 2))]
    write_tsv(folder / "test.tsv", test)
    return folder


TASK_DATA = {
    "sequence_classification": (sentiment_records, "bert"),
    "token_classification": (ner_records, "bert"),
    "question_answering": (qa_records, "bert"),
    "masked_lm": (text_records, "bert"),
    "casual_lm": (text_records, "gpt2"),
    "seq2seq_lm": (copy_records, "t5"),
}


def make_task(
    task: str,
    root: str | Path,
    train: int = 256,
    dev: int = 64,
    seed: int = 0,
    hidden: int = 32,
    dropout: float = 0.1,
) -> tuple[Path, Path]:
    """(model folder, data folder) for `task`: its data as train/dev .jsonl and a tiny model trained on nothing."""
    records, kind = TASK_DATA[task]
    root = Path(root)
    data = root / "data" / task
    data.mkdir(parents=True, exist_ok=True)
    splits = {"train": records(train, seed), "dev": records(dev, seed + 1)}
    for split, rows in splits.items():
        write_jsonl(data / f"{split}.jsonl", rows)
    tokenizer = train_tokenizer(texts_of(splits["train"] + splits["dev"]), root / "tokenizer")
    model = save_tiny_model(kind, root / f"tiny-{kind}", tokenizer, hidden=hidden, seed=seed, dropout=dropout)
    return model, data


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build a tiny local model and learnable data for a task.")
    parser.add_argument("task", choices=sorted(TASK_DATA))
    parser.add_argument("root", help="Folder to write `tiny-<kind>/` and `data/<task>/` into.")
    parser.add_argument("--train", type=int, default=256)
    parser.add_argument("--dev", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args(argv)
    model, data = make_task(
        options.task, options.root, options.train, options.dev, options.seed, options.hidden
    )
    print(f"--pretrained-model-name-or-path {model} --data-dir {data.parent} --data-name {data.name}")


if __name__ == "__main__":
    main()
