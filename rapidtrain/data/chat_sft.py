"""Pai-Megatron-Patch's chat-template SFT data (`--dataset JSON-SFT --train-mode finetune`): each record a
conversation rendered by the tokenizer's own chat template, only the assistant's turns carrying loss, and each
conversation's loss averaged over its own answer tokens first (Pai's per-sequence average). With
--reset-position-ids / --reset-attention-mask the conversations are packed several to a row, each with its own
positions and attention. `build_raw_json_datasets` builds the datasets of every Pai raw JSON kind (raw_json.py's
instruction/output records, and these)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rapidtrain.data.raw_json import (
    ANSWER_KEYS,
    RawJsonDataset,
    RawJsonError,
    SampleLayout,
    encode_file,
    read_records,
)

CHAT_SFT_KINDS = ("JSON-SFT",)
# ShareGPT's speaker names and the chat templates' roles, as the templates expect them.
ROLES = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant", "bot": "assistant",
         "model": "assistant", "system": "system"}
PROMPT_KEYS = ("instruction", "query")  # Pai's JSON-SFT takes the first present, then appends "input"


def conversation_of(record: dict[str, Any], where: str) -> list[dict[str, str]]:
    """The record as chat messages: OpenAI `messages` ({role, content}), ShareGPT `conversations` ({from, value}),
    or Pai's instruction/query + input → output/content/response pair (one user turn, one assistant turn)."""
    turns = record.get("messages", record.get("conversations"))
    if turns is None:
        return _pair_conversation(record, where)
    if not isinstance(turns, list) or not all(isinstance(turn, dict) for turn in turns):
        raise RawJsonError(f"{where}: 'messages' / 'conversations' must be a list of turns like "
                           "{\"role\": \"user\", \"content\": ...}")
    messages: list[dict[str, str]] = []
    if record.get("system"):
        messages.append({"role": "system", "content": str(record["system"])})
    for index, turn in enumerate(turns):
        speaker = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        role = ROLES.get(str(speaker).lower())
        if role is None or content is None:
            raise RawJsonError(f"{where}, turn {index + 1}: a turn needs a role (one of {', '.join(ROLES)}) and its "
                               f"content (found role {speaker!r})")
        messages.append({"role": role, "content": str(content)})
    if not any(message["role"] == "assistant" for message in messages):
        raise RawJsonError(f"{where}: no assistant turn; nothing in it would carry loss")
    return messages


def _pair_conversation(record: dict[str, Any], where: str) -> list[dict[str, str]]:
    prompt_key = next((key for key in PROMPT_KEYS if key in record), None)
    answer_key = next((key for key in ANSWER_KEYS if key in record), None)
    if prompt_key is None or answer_key is None:
        raise RawJsonError(f"{where}: expected 'messages', 'conversations', or an {' / '.join(PROMPT_KEYS)} with "
                           f"its answer ({' / '.join(ANSWER_KEYS)})")
    prompt = str(record[prompt_key] or "") + str(record.get("input") or "")
    messages = [{"role": "system", "content": str(record["system"])}] if record.get("system") else []
    return [*messages, {"role": "user", "content": prompt}, {"role": "assistant", "content": str(record[answer_key])}]


def encode_conversation(messages: Sequence[dict[str, str]], tokenizer: Any, length: int,
                        where: str) -> tuple[list[int], list[tuple[int, int]]] | None:
    """(ids of the rendered conversation, at most `length`; the [start, end) spans of the assistant's turns), or
    None when the first answer starts at or past `length` (Pai drops such a record; a longer answer is cut).

    A turn's span is what rendering the conversation up to it adds to rendering the turns before it with the
    assistant's header (the generation prompt, which a model is given when it answers): the answer and the
    template's end-of-turn token carry loss. (Pai renders the turns before without the header, so its header tokens
    carry loss too; a template whose generation prompt is no prefix of the answer's turn is read that way.)"""
    full = tokenizer.apply_chat_template(messages)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:index], add_generation_prompt=True) if index else []
        if full[:len(before)] != before:
            before = tokenizer.apply_chat_template(messages[:index])
        through = full if index == len(messages) - 1 else tokenizer.apply_chat_template(messages[:index + 1])
        if full[:len(before)] != before or full[:len(through)] != through:
            raise RawJsonError(f"{where}: the tokenizer's chat template does not render a conversation's start as a "
                               "prefix of the whole, so its answers cannot be told from the prompts; use a template "
                               "that only appends (most do)")
        spans.append((len(before), len(through)))
    if not spans or spans[0][0] >= length:
        return None
    return full[:length], [(start, min(end, length)) for start, end in spans if start < length]


def answer_weights(size: int, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """Per position, the weight its token carries as a target: 1 / (answer tokens) inside the answers, so that a
    conversation's loss is the mean over its answer tokens and a batch's loss the mean over its conversations."""
    weights = np.zeros(size, dtype=np.float32)
    for start, end in spans:
        weights[start:end] = 1.0
    total = weights.sum()
    return weights / total if total else weights


def encode_chat_file(path: str, tokenizer: Any, length: int, pack: bool) -> tuple[np.ndarray, np.ndarray,
                                                                                   np.ndarray | None, int]:
    """(ids [rows, length + 1] padded, target weights [rows, length + 1], conversation number of each position
    [rows, length + 1] when packed else None, records dropped). A row's last position only serves as the target
    of the one before it (the batches shift by one)."""
    if not callable(getattr(tokenizer, "apply_chat_template", None)) or not getattr(tokenizer, "chat_template", None):
        raise RawJsonError(f"--dataset JSON-SFT ({path}): the tokenizer has no chat template; give a Hugging Face "
                           "tokenizer folder whose tokenizer_config.json (or chat_template.jinja) has one, with "
                           "--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR (or --patch-tokenizer-type)")
    pad = tokenizer.pad if getattr(tokenizer, "pad", None) is not None else tokenizer.eod
    if pad is None:
        raise RawJsonError(f"{path}: the tokenizer has neither a padding nor an end-of-document token to pad with")
    encoded, dropped = [], 0
    for index, record in enumerate(read_records(path)):
        where = f"{path} record {index + 1}"
        result = encode_conversation(conversation_of(record, where), tokenizer, length, where)
        if result is None:
            dropped += 1
        else:
            encoded.append(result)
    if not encoded:
        raise RawJsonError(f"{path}: every record's prompt is longer than --max-padding-length ({length}); raise it")
    rows = _packed_rows(encoded, length + 1) if pack else [[item] for item in encoded]
    ids = np.full((len(rows), length + 1), pad, dtype=np.int64)
    weights = np.zeros((len(rows), length + 1), dtype=np.float32)
    conversations = np.zeros((len(rows), length + 1), dtype=np.int64)
    for row, items in enumerate(rows):
        at = 0
        for number, (tokens, spans) in enumerate(items):
            ids[row, at:at + len(tokens)] = tokens
            weights[row, at:at + len(tokens)] = answer_weights(len(tokens), spans)
            conversations[row, at:at + len(tokens)] = number
            at += len(tokens)
        conversations[row, at:] = len(items)  # the padding: a segment of its own
    return ids, weights, (conversations if pack else None), dropped


def _packed_rows(encoded: list[tuple[list[int], list[tuple[int, int]]]], capacity: int) -> list[list[Any]]:
    """Conversations in file order, each into the current row while it fits (a conversation is never split)."""
    rows: list[list[Any]] = [[]]
    used = 0
    for item in encoded:
        if used + len(item[0]) > capacity and rows[-1]:
            rows.append([])
            used = 0
        rows[-1].append(item)
        used += len(item[0])
    return rows


def encoded_rows(path: str, kind: str, max_padding_length: int, tokenizer: Any,
                 layout: SampleLayout) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    """(ids, target weights, conversation numbers when packed, records dropped) of one file of `kind`."""
    if kind in CHAT_SFT_KINDS:  # Pai pads JSON-SFT to --max-padding-length, plus one for the shift
        pack = layout.reset_position_ids or layout.reset_attention_mask
        return encode_chat_file(path, tokenizer, max_padding_length, pack)
    length = max_padding_length + 1 if "-Pretrain" in kind else max_padding_length
    return _plain_rows(path, tokenizer, length)


def _plain_rows(path: str, tokenizer: Any, length: int) -> tuple[np.ndarray, np.ndarray, None, int]:
    ids, masks, dropped = encode_file(path, tokenizer, length)
    return ids, masks, None, dropped


def build_raw_json_datasets(paths: Sequence[Sequence[str] | None], kind: str, max_padding_length: int,
                            tokenizer: Any, counts: Sequence[int], seed: int,
                            layout: SampleLayout | None = None,
                            encoded: dict[str, Any] | None = None) -> tuple[Any, Any, Any]:
    """(train, valid, test) from the splits' JSON files; a split without its own file reads the training file,
    as Pai's raw pretraining dataset does. `encoded` caches each file's rows (an epoch-based run counted the
    training file's rows before the counts were known); the training split alone takes the layout's pass size."""
    train_path = paths[0][0] if paths[0] else None
    if train_path is None:
        raise RawJsonError(f"--dataset {kind}: give the JSON file with --train-data-path")
    encoded = {} if encoded is None else encoded
    layout = layout or SampleLayout()
    datasets = []
    for index, (split_paths, count) in enumerate(zip(paths, counts, strict=True)):
        path = split_paths[0] if split_paths else train_path
        if path not in encoded:
            encoded[path] = encoded_rows(path, kind, max_padding_length, tokenizer, layout)
        ids, masks, segments, dropped = encoded[path]
        split_layout = layout if index == 0 else SampleLayout(layout.reset_position_ids,
                                                              layout.reset_attention_mask, layout.document_ids)
        datasets.append(RawJsonDataset(ids, masks, count, seed, dropped, segments, split_layout) if count else None)
    return datasets[0], datasets[1], datasets[2]
