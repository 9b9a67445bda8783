"""JSON lines → Megatron `PREFIX_{key}_document.bin/.idx` (`_sentence` with --split-sentences): the work
behind scripts/preprocess_data.py.

Chunks of lines are tokenized in a process pool, written in input order, and published under their
final names only when every file is complete. Temporary files a killed run left behind are removed by the
next run for the same output (or named, when their writer still lives); an input without documents writes
nothing.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import multiprocessing
import os
import re
import signal
import time
from collections import deque
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from rapidtrain.core.errors import UserError
from rapidtrain.data.indexed import IndexedDatasetBuilder, best_dtype
from rapidtrain.data.sentences import split_sentences
from rapidtrain.data.tokenizer import Tokenizer, TokenizerSettings, build_tokenizer

_MAX_REPORTED_BAD_LINES = 10


class PreprocessError(UserError, ValueError):
    """The input or the preprocessing flags are unusable; the message names the file, line or flag."""


@dataclass
class PreprocessSettings:
    """The flags of scripts/preprocess_data.py."""

    input: str
    output_prefix: str
    tokenizer: TokenizerSettings
    json_keys: Sequence[str] = ("text",)
    append_eod: bool = False
    workers: int = 1
    log_interval: int = 1000  # documents between progress updates
    skip_bad_lines: bool = False
    progress: bool = True
    lines_per_chunk: int = 256  # lines a worker tokenizes per task
    split_sentences: bool = False  # one sequence per sentence; documents group them (BERT's input)
    keep_newlines: bool = False  # with split_sentences: each sentence keeps the whitespace after it


@dataclass
class PreprocessResult:
    """What was written: the data prefix of each JSON key and the totals."""

    data_prefixes: dict[str, str]
    num_documents: int
    num_tokens: int  # over all keys
    seconds: float
    skipped_lines: int = 0
    bad_line_examples: list[str] = field(default_factory=list)  # the first few, as "file:line: reason"
    removed_stale: list[str] = field(default_factory=list)  # temporary files of killed runs, removed

    @property
    def documents_per_second(self) -> float:
        return self.num_documents / max(self.seconds, 1e-9)

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / max(self.seconds, 1e-9)


def data_prefix_for(output_prefix: str, json_key: str, split_sentences: bool = False) -> str:
    """The `--data-path` prefix that preprocessing writes for one JSON key (Megatron's level names)."""
    return f"{output_prefix}_{json_key}_{'sentence' if split_sentences else 'document'}"


_TEMPORARY = re.compile(r"\.(bin|idx)\.tmp-(\d+)$")


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def remove_stale_temporaries(prefixes: list[str]) -> list[str]:
    """Remove `PREFIX.bin.tmp-PID` / `.idx.tmp-PID` files whose writer is gone (a SIGKILLed run cleans nothing);
    refuse when the writer still runs: two runs would publish over each other."""
    removed = []
    for prefix in prefixes:
        folder = os.path.dirname(os.path.abspath(prefix)) or "."
        base = os.path.basename(prefix)
        if not os.path.isdir(folder):
            continue
        for name in sorted(os.listdir(folder)):
            match = _TEMPORARY.search(name)
            if not match or name[: match.start()] != base:
                continue
            path, pid = os.path.join(folder, name), int(match.group(2))
            if pid != os.getpid() and _process_alive(pid):
                raise PreprocessError(
                    f"--output-prefix: {path} is being written by another preprocess (pid {pid}) with the same "
                    "output; wait for it to finish, or give another --output-prefix (remove the file if no such "
                    "process is a preprocess)"
                )
            os.remove(path)
            removed.append(path)
    return removed


def preprocess(settings: PreprocessSettings) -> PreprocessResult:
    """Tokenize `settings.input` into one indexed dataset per JSON key; see the module docstring."""
    _check_settings(settings)
    started = time.perf_counter()
    tokenizer = build_tokenizer(settings.tokenizer)
    if settings.append_eod and tokenizer.eod is None:
        raise PreprocessError(
            f"--append-eod: {settings.tokenizer.tokenizer_type} has no end-of-document token; "
            "leave out --append-eod or choose a tokenizer that has one"
        )
    prefixes = {key: data_prefix_for(settings.output_prefix, key, settings.split_sentences)
                for key in settings.json_keys}
    _make_output_folder(settings.output_prefix)
    removed = remove_stale_temporaries(list(prefixes.values()))
    temporary = {
        key: (f"{p}.bin.tmp-{os.getpid()}", f"{p}.idx.tmp-{os.getpid()}") for key, p in prefixes.items()
    }
    builders: dict[str, IndexedDatasetBuilder] = {}
    try:
        for key, (bin_path, _) in temporary.items():
            builders[key] = IndexedDatasetBuilder(bin_path, dtype=best_dtype(tokenizer.vocab_size))
        result = _write_documents(settings, tokenizer, builders)
        if result.num_documents == 0:
            skipped = f", {result.skipped_lines} bad line(s) skipped" if result.skipped_lines else ""
            raise PreprocessError(
                f"--input {settings.input}: no documents (every line blank{skipped}): nothing was written. "
                "Give a JSON-lines file with one object per line holding the --json-keys"
            )
        for key, (_, idx_path) in temporary.items():
            builders[key].finalize(idx_path)
    except OSError as error:  # a full disk, a file-size limit (ulimit -f), a quota: said with the prefix, no traceback
        _discard(builders, temporary)
        raise PreprocessError(f"--output-prefix {settings.output_prefix}: writing the output failed "
                              f"({error.strerror or error}); nothing was kept. Free space or raise the limit "
                              "(df -h, ulimit -f), or give a prefix on another disk") from None
    except BaseException:
        _discard(builders, temporary)
        raise
    for key, (bin_path, idx_path) in temporary.items():
        os.replace(bin_path, prefixes[key] + ".bin")  # the .idx last: it is what readers open first
        os.replace(idx_path, prefixes[key] + ".idx")
    result.data_prefixes = prefixes
    result.removed_stale = removed
    result.seconds = time.perf_counter() - started
    return result


def _discard(builders: dict[str, IndexedDatasetBuilder], temporary: dict[str, tuple[str, str]]) -> None:
    """Close the builders and remove their temporary files: an interrupted run leaves no half-written output."""
    for builder in builders.values():
        builder.close()
    for path in (path for pair in temporary.values() for path in pair if os.path.exists(path)):
        os.remove(path)


def _make_output_folder(output_prefix: str) -> None:
    folder = os.path.dirname(os.path.abspath(output_prefix))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as error:  # a path through a regular file, no permission
        raise PreprocessError(f"--output-prefix {output_prefix}: cannot create the folder {folder} "
                              f"({error.strerror or error}); give a prefix in a writable folder") from None
    if not os.access(folder, os.W_OK):
        raise PreprocessError(f"--output-prefix {output_prefix}: the folder {folder} is not writable; give a "
                              "prefix in a writable folder")


def _check_settings(settings: PreprocessSettings) -> None:
    if not os.path.isfile(settings.input):
        raise PreprocessError(
            f"--input {settings.input}: no such file; give a JSON-lines file (.jsonl or .gz)"
        )
    keys = list(settings.json_keys)
    if not keys or len(set(keys)) != len(keys):
        raise PreprocessError(f"--json-keys {' '.join(keys)}: give one or more distinct keys")
    if settings.workers < 1:
        raise PreprocessError(f"--workers {settings.workers}: must be at least 1")
    if settings.log_interval < 1:
        raise PreprocessError(f"--log-interval {settings.log_interval}: must be at least 1")


def _write_documents(
    settings: PreprocessSettings, tokenizer: Tokenizer, builders: dict[str, IndexedDatasetBuilder]
) -> PreprocessResult:
    result = PreprocessResult(data_prefixes={}, num_documents=0, num_tokens=0, seconds=0.0)
    progress = _Progress(settings)
    try:
        # closing() stops the worker pool at once when a bad line ends the run.
        with contextlib.closing(_encoded_chunks(settings, tokenizer)) as chunks:
            for chunk in chunks:
                if chunk.bad_lines and not settings.skip_bad_lines:
                    raise PreprocessError(f"{chunk.bad_lines[0]}; fix the line or pass --skip-bad-lines")
                result.skipped_lines += len(chunk.bad_lines)
                room = _MAX_REPORTED_BAD_LINES - len(result.bad_line_examples)
                result.bad_line_examples.extend(chunk.bad_lines[:room])
                for key, builder in builders.items():
                    encoded = chunk.keys[key]
                    builder.add_documents(
                        encoded.tokens, encoded.sequence_lengths, encoded.sequences_per_document
                    )
                tokens = sum(len(encoded.tokens) for encoded in chunk.keys.values())
                result.num_documents += chunk.documents
                result.num_tokens += tokens
                progress.advance(chunk.documents, tokens)
    finally:
        progress.close()
    return result


class _Progress:
    """A tqdm bar of documents/s with tokens/s beside it, refreshed every --log-interval documents."""

    def __init__(self, settings: PreprocessSettings) -> None:
        from tqdm import tqdm

        self.interval = settings.log_interval
        self.bar = tqdm(desc="preprocess", unit=" docs", disable=not settings.progress, mininterval=0)
        self.pending = self.tokens = 0
        self.started = time.perf_counter()

    def advance(self, documents: int, tokens: int) -> None:
        self.pending += documents
        self.tokens += tokens
        if self.pending >= self.interval:
            self._flush()

    def _flush(self) -> None:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        self.bar.set_postfix_str(f"{self.tokens / elapsed:,.0f} tokens/s", refresh=False)
        self.bar.update(self.pending)
        self.pending = 0

    def close(self) -> None:
        self._flush()
        self.bar.close()


@dataclass
class _EncodedKey:
    tokens: np.ndarray
    sequence_lengths: list[int]
    sequences_per_document: list[int]


@dataclass
class _EncodedChunk:
    documents: int
    keys: dict[str, _EncodedKey]
    bad_lines: list[str]


class _BadLine(ValueError):
    pass


class _Encoder:
    """Turns numbered JSON lines into token ids per key, exactly as Megatron's Encoder.encode does."""

    def __init__(self, tokenizer: Tokenizer, json_keys: Sequence[str], append_eod: bool, input_name: str,
                 split_sentences: bool = False, keep_newlines: bool = False):
        self.tokenizer = tokenizer
        self.json_keys = list(json_keys)
        self.eod_tokens = [tokenizer.eod] if append_eod and tokenizer.eod is not None else []
        self.input_name = input_name
        self.split_sentences = split_sentences
        self.keep_newlines = keep_newlines

    def encode_chunk(self, chunk: tuple[int, list[bytes]]) -> _EncodedChunk:
        first_line, lines = chunk
        tokens: dict[str, list[int]] = {key: [] for key in self.json_keys}
        lengths: dict[str, list[int]] = {key: [] for key in self.json_keys}
        per_document: dict[str, list[int]] = {key: [] for key in self.json_keys}
        bad_lines, documents = [], 0
        for number, line in enumerate(lines, first_line):
            if not line.strip():
                continue  # a blank line (often the last one) is no document
            try:
                encoded = self.encode_line(line)
            except _BadLine as reason:
                bad_lines.append(f"{self.input_name}:{number}: {reason}")
                continue
            documents += 1
            for key, sequences in encoded.items():
                for ids in sequences:
                    tokens[key].extend(ids)
                    lengths[key].append(len(ids))
                per_document[key].append(len(sequences))
        keys = {
            key: _EncodedKey(np.array(tokens[key], dtype=np.int32), lengths[key], per_document[key])
            for key in self.json_keys
        }
        return _EncodedChunk(documents, keys, bad_lines)

    def encode_line(self, line: bytes) -> dict[str, list[list[int]]]:
        """Each key's non-empty sequences: a string is one sequence, a list of strings one each."""
        record = _parse_record(line)
        encoded = {}
        for key in self.json_keys:
            if key not in record:
                present = ", ".join(repr(k) for k in list(record)[:8]) or "none"
                raise _BadLine(f"missing key {key!r} (keys present: {present}); choose keys with --json-keys")
            value = record[key]
            texts = [value] if isinstance(value, str) else value
            if not isinstance(texts, list) or not all(isinstance(text, str) for text in texts):
                raise _BadLine(
                    f"key {key!r} holds {type(value).__name__}; expected a string or a list of strings"
                )
            if self.split_sentences:
                texts = [s for text in texts for s in split_sentences(text, self.keep_newlines)]
            try:
                encoded[key] = [ids for ids in map(self.tokenizer.tokenize, texts) if ids]
            except ValueError as error:  # NullTokenizer's complaint about non-integer text
                raise _BadLine(str(error)) from None
            if encoded[key]:
                encoded[key][-1] = encoded[key][-1] + self.eod_tokens
        return encoded


def _parse_record(line: bytes) -> dict:
    try:
        record = json.loads(line.rstrip(b"\r\n"))  # so a column number counts within the line
    except UnicodeDecodeError:
        raise _BadLine("not UTF-8 text") from None
    except json.JSONDecodeError as error:
        raise _BadLine(f"malformed JSON: {error.msg} at column {error.colno}") from None
    if not isinstance(record, dict):
        raise _BadLine(f"expected a JSON object, found {type(record).__name__}")
    return record


def _read_chunks(path: str, lines_per_chunk: int) -> Iterator[tuple[int, list[bytes]]]:
    """(number of the first line, lines) for consecutive chunks of the input; .gz is decompressed."""
    opener = gzip.open if path.endswith(".gz") else open
    chunk: list[bytes] = []
    first = 1
    try:
        with opener(path, "rb") as lines:
            for number, line in enumerate(lines, 1):
                chunk.append(line)
                if len(chunk) == lines_per_chunk:
                    yield first, chunk
                    chunk, first = [], number + 1
    except (OSError, EOFError) as error:  # a corrupt or cut-off .gz
        raise PreprocessError(
            f"--input {path}: cannot read past line {first + len(chunk) - 1}: {error}"
        ) from None
    if chunk:
        yield first, chunk


_worker_encoder: _Encoder | None = None


def _start_worker(settings: PreprocessSettings) -> None:
    global _worker_encoder
    # The parent alone answers Ctrl-C and SIGTERM, and stops the pool; workers just end with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _worker_encoder = _encoder(settings, build_tokenizer(settings.tokenizer))


def _encoder(settings: PreprocessSettings, tokenizer: Tokenizer) -> _Encoder:
    return _Encoder(tokenizer, settings.json_keys, settings.append_eod, settings.input, settings.split_sentences,
                    settings.keep_newlines)


def _encode_in_worker(chunk: tuple[int, list[bytes]]) -> _EncodedChunk:
    assert _worker_encoder is not None, "_start_worker runs first in every pool process"
    return _worker_encoder.encode_chunk(chunk)


def _encoded_chunks(
    settings: PreprocessSettings, tokenizer: Tokenizer
) -> Generator[_EncodedChunk, None, None]:
    """Encoded chunks in input order: in this process for one worker, else from a pool."""
    chunks = _read_chunks(settings.input, settings.lines_per_chunk)
    if settings.workers == 1:
        yield from map(_encoder(settings, tokenizer).encode_chunk, chunks)
        return
    with multiprocessing.Pool(settings.workers, initializer=_start_worker, initargs=(settings,)) as pool:
        # Pool.imap would read the whole input ahead into its queue; a bounded window of
        # apply_async keeps memory flat for corpora larger than RAM and still yields in order.
        pending: deque = deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_encode_in_worker, (chunk,)))
            if len(pending) >= 4 * settings.workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
