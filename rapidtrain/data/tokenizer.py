"""Tokenizers by Megatron's `--tokenizer-type`, built from local files only: nothing reaches the network.

Ids, vocabulary sizes and end-of-document tokens follow Megatron's tokenizers, so data preprocessed here
and there is interchangeable.
"""

from __future__ import annotations

import os
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from rapidtrain.core.errors import UserError

TokenizerType = Literal[
    "GPT2BPETokenizer",
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
    "JiebaBPETokenizer",
]
TOKENIZER_TYPES: tuple[str, ...] = get_args(TokenizerType)


class TokenizerSettingsError(UserError, ValueError):
    """A tokenizer flag is missing or names something unusable."""


class TokenizerFileNotFoundError(TokenizerSettingsError, FileNotFoundError):
    """A file or folder given to a tokenizer flag does not exist."""


@dataclass
class TokenizerSettings:
    """The tokenizer flags: `--tokenizer-type` and the files or size each type needs."""

    tokenizer_type: str
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None  # a SentencePiece model file, or a Hugging Face folder
    vocab_size: int | None = None  # NullTokenizer only
    make_vocab_size_divisible_by: int = 128
    tensor_model_parallel_size: int = 1
    # Known without reading the files (the demo corpus's tokenizer, before the corpus is first built).
    known_vocab_size: int | None = None

    def padded_vocab_size_of(self, tokenizer: Tokenizer) -> int:
        """The embedding rows a model needs for `tokenizer` under these settings (Megatron's padding)."""
        return padded_vocab_size(
            tokenizer.vocab_size, self.make_vocab_size_divisible_by, self.tensor_model_parallel_size
        )


class Tokenizer(ABC):
    """What training and preprocessing need of a tokenizer; special ids are None where absent."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Ids in use, before padding (see `padded_vocab_size`)."""

    @property
    def eod(self) -> int | None:
        """End-of-document id, appended by `preprocess_data.py --append-eod`."""
        return None

    pad: int | None = None
    cls: int | None = None
    sep: int | None = None
    mask: int | None = None

    @abstractmethod
    def tokenize(self, text: str) -> list[int]: ...

    @abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str: ...


def padded_vocab_size(vocab_size: int, divisible_by: int = 128, tensor_model_parallel_size: int = 1) -> int:
    """`vocab_size` rounded up to a multiple of divisible_by × TP, as Megatron pads its embedding."""
    multiple = divisible_by * tensor_model_parallel_size
    if vocab_size <= 0 or multiple <= 0:
        raise ValueError(
            f"padded_vocab_size: vocab size {vocab_size} and --make-vocab-size-divisible-by {divisible_by} "
            f"× --tensor-model-parallel-size {tensor_model_parallel_size} must be positive"
        )
    return -(-vocab_size // multiple) * multiple


def tokenizer_vocab_size(settings: TokenizerSettings) -> int:
    """The tokenizer's vocabulary size, read from its files (or known in advance, where that is said)."""
    files = [settings.vocab_file, settings.merge_file, settings.tokenizer_model]
    if settings.known_vocab_size is not None and not all(f and os.path.exists(f) for f in files if f):
        return settings.known_vocab_size
    return build_tokenizer(settings).vocab_size


def build_tokenizer(settings: TokenizerSettings) -> Tokenizer:
    """The tokenizer `settings.tokenizer_type` names, loaded from the files the settings give."""
    kind = settings.tokenizer_type
    if kind == "GPT2BPETokenizer":
        vocab = _required_file(settings.vocab_file, "--vocab-file", kind, "GPT-2 vocab.json")
        return GPT2BPETokenizer(
            vocab, _required_file(settings.merge_file, "--merge-file", kind, "GPT-2 merges.txt")
        )
    if kind in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        vocab = _required_file(settings.vocab_file, "--vocab-file", kind, "BERT vocab.txt")
        return BertWordPieceTokenizer(vocab, lower_case=kind == "BertWordPieceLowerCase")
    sentencepiece_types = {
        "SentencePieceTokenizer": SentencePieceTokenizer,
        "GPTSentencePieceTokenizer": GPTSentencePieceTokenizer,
        "Llama2Tokenizer": Llama2Tokenizer,
    }
    if kind in sentencepiece_types:
        return sentencepiece_types[kind](
            _required_file(settings.tokenizer_model, "--tokenizer-model", kind, "SentencePiece .model")
        )
    if kind == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(_required_folder(settings.tokenizer_model, "--tokenizer-model", kind))
    if kind == "JiebaBPETokenizer":
        return JiebaBPETokenizer(_required_file(settings.vocab_file, "--vocab-file", kind, "tokenizer.json"))
    if kind == "NullTokenizer":
        if settings.vocab_size is None or settings.vocab_size <= 0:
            raise TokenizerSettingsError("--tokenizer-type NullTokenizer needs --vocab-size N (N > 0)")
        return NullTokenizer(settings.vocab_size)
    raise TokenizerSettingsError(
        f"--tokenizer-type {kind!r} is unknown; choose one of {', '.join(TOKENIZER_TYPES)}"
    )


def _required_file(path: str | None, flag: str, kind: str, what: str) -> str:
    if not path:
        raise TokenizerSettingsError(f"--tokenizer-type {kind} needs {flag} (the {what} file)")
    if not os.path.isfile(path):
        raise TokenizerFileNotFoundError(
            f"{flag} {path}: no such file; give the path of the {what} file that {kind} reads"
        )
    return path


def _required_folder(path: str | None, flag: str, kind: str) -> str:
    if not path:
        raise TokenizerSettingsError(f"--tokenizer-type {kind} needs {flag} DIR (a local tokenizer folder)")
    if not os.path.isdir(path):
        raise TokenizerFileNotFoundError(
            f"{flag} {path}: no such folder; {kind} loads a local folder written by save_pretrained "
            "(hub names are not downloaded)"
        )
    return path


class GPT2BPETokenizer(Tokenizer):
    """GPT-2's byte-level BPE from `vocab.json` + `merges.txt`; eod is `<|endoftext|>`."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        from tokenizers import Tokenizer as RustTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        try:
            self._tokenizer = RustTokenizer(models.BPE.from_file(vocab_file, merge_file))
        except Exception as error:  # the tokenizers library says only "Merges text file invalid at line 1"
            raise TokenizerSettingsError(
                f"--vocab-file {vocab_file} / --merge-file {merge_file}: not GPT-2's vocab.json (a JSON object of "
                f"token → id) and merges.txt (one 'a b' pair a line): {str(error).strip() or type(error).__name__}. "
                "Check that the two files are not swapped."
            ) from None
        # GPT-2 splits with its own regex and adds no leading space, as Megatron's GPT2Tokenizer does.
        self._tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tokenizer.decoder = decoders.ByteLevel()
        eod = self._tokenizer.token_to_id("<|endoftext|>")
        if eod is None:
            raise TokenizerSettingsError(
                f"--vocab-file {vocab_file}: no <|endoftext|> token; GPT-2 needs it as eod"
            )
        self._eod: int = eod

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)


class BertWordPieceTokenizer(Tokenizer):
    """BERT's WordPiece from `vocab.txt`; cased or lower-cased (which also strips accents).

    Megatron's BERT tokenizer has no end-of-document token, so `eod` is None here as well; its
    vocabulary size counts the `[BOS]` and `[EOS]` ids Megatron appends when the file lacks them.
    """

    def __init__(self, vocab_file: str, lower_case: bool = True) -> None:
        from tokenizers import Tokenizer as RustTokenizer
        from tokenizers import decoders, models, normalizers, pre_tokenizers

        vocab = _read_wordpiece_vocab(vocab_file)
        # No special tokens are registered, so "[SEP]" typed in text splits like any word, as in Megatron.
        self._tokenizer = RustTokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
        self._tokenizer.normalizer = normalizers.BertNormalizer(
            lowercase=lower_case, strip_accents=lower_case
        )
        self._tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        self._tokenizer.decoder = decoders.WordPiece()
        self._vocab_size = len(vocab) + sum(token not in vocab for token in ("[BOS]", "[EOS]"))
        self.file_vocab_size = len(vocab)  # the ids vocab.txt defines (a Hugging Face BERT's embedding rows)
        self.cls, self.sep, self.pad, self.mask = (vocab[t] for t in ("[CLS]", "[SEP]", "[PAD]", "[MASK]"))

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)


def _read_wordpiece_vocab(vocab_file: str) -> dict[str, int]:
    try:
        with open(vocab_file, encoding="utf-8") as lines:
            vocab = {line.rstrip("\n"): i for i, line in enumerate(lines)}
    except (OSError, UnicodeDecodeError) as error:
        raise TokenizerSettingsError(f"--vocab-file {vocab_file}: cannot read it as UTF-8 text ({error}); give BERT's "
                                     "vocab.txt, one token a line") from None
    missing = [t for t in ("[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]") if t not in vocab]
    if missing:
        raise TokenizerSettingsError(
            f"--vocab-file {vocab_file}: lacks {', '.join(missing)}; not a BERT vocab.txt"
        )
    return vocab


class _SentencePieceBase(Tokenizer):
    def __init__(self, model_file: str) -> None:
        import sentencepiece

        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        except (OSError, RuntimeError) as error:
            raise TokenizerSettingsError(
                f"--tokenizer-model {model_file}: not a SentencePiece model ({error})"
            ) from error
        self.pad = self._sp.pad_id() if self._sp.pad_id() >= 0 else None

    @property
    def vocab_size(self) -> int:
        return len(self._sp)

    @property
    def eod(self) -> int | None:
        return self._sp.eos_id() if self._sp.eos_id() >= 0 else None

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode(list(ids))


class GPTSentencePieceTokenizer(_SentencePieceBase):
    """The SentencePiece model as is: its own vocabulary; eod is the model's eos, pad its pad."""


class Llama2Tokenizer(_SentencePieceBase):
    """As GPTSentencePieceTokenizer, with the model's bos put before every text (Llama 2's habit)."""

    def tokenize(self, text: str) -> list[int]:
        bos = self._sp.bos_id()
        return ([bos] if bos >= 0 else []) + self._sp.encode(text)


class SentencePieceTokenizer(_SentencePieceBase):
    """Megatron's SentencePieceTokenizer: the model's pieces, then <CLS> <SEP> <EOD> <MASK> and the pad,
    bos and eos pieces appended where the model lacks them; eod is <EOD>. Those pieces typed in the
    text are kept whole, as Megatron does."""

    def __init__(self, model_file: str) -> None:
        super().__init__(model_file)
        roles = {"cls": "<CLS>", "sep": "<SEP>", "eod": "<EOD>", "mask": "<MASK>"}
        for role in ("pad", "bos", "eos"):
            piece_id = getattr(self._sp, f"{role}_id")()
            roles[role] = self._sp.id_to_piece(piece_id) if piece_id >= 0 else f"<{role.upper()}>"
        self._special: dict[str, int] = {}  # in Megatron's order of adding, which decides new ids
        next_id = len(self._sp)
        for piece in roles.values():
            if piece in self._special:
                continue
            existing = self._sp.piece_to_id(piece)
            if self._sp.id_to_piece(existing) == piece:
                self._special[piece] = existing
            else:
                self._special[piece], next_id = next_id, next_id + 1
        self._vocab_size = next_id
        self._eod = self._special[roles["eod"]]
        self.cls, self.sep, self.mask, self.pad = (
            self._special[roles[r]] for r in ("cls", "sep", "mask", "pad")
        )
        self._pieces = {i: piece for piece, i in self._special.items()}
        self._special_pattern = re.compile("(" + "|".join(re.escape(p) for p in self._special) + ")")

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = []
        # split() with a group puts each special piece found at the odd positions.
        for position, part in enumerate(self._special_pattern.split(text)):
            if position % 2:
                ids.append(self._special[part])
            else:
                ids.extend(self._sp.encode(part))
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        ids = list(ids)
        text, start = "", 0
        for position, token in enumerate(ids):
            if token in self._pieces:
                text += self._sp.decode(ids[start:position]) + " " + self._pieces[token] + " "
                start = position + 1
        return text + self._sp.decode(ids[start:])


class HuggingFaceTokenizer(Tokenizer):
    """A tokenizer folder written by `save_pretrained`, loaded offline; `tokenize` adds the special
    tokens the tokenizer adds by itself (a Llama bos, for example), as Megatron does."""

    def __init__(self, folder: str) -> None:
        from transformers import AutoTokenizer

        try:
            self._tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
            self._tokenizer.decode(self._tokenizer("a b")["input_ids"])  # settings that only fail once used
        except Exception as error:  # noqa: BLE001 - a damaged file fails deep in transformers, as any exception
            raise TokenizerSettingsError(
                f"--tokenizer-model {folder}: not a loadable tokenizer folder ({type(error).__name__}: "
                f"{str(error).strip()[:300]}); its tokenizer.json or tokenizer_config.json is damaged or not a "
                "tokenizer's: save the tokenizer again with save_pretrained"
            ) from None
        hf = self._tokenizer
        self.pad, self.cls, self.sep, self.mask = (
            hf.pad_token_id,
            hf.cls_token_id,
            hf.sep_token_id,
            hf.mask_token_id,
        )

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)

    @property
    def eod(self) -> int | None:
        return self._tokenizer.eos_token_id

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer(text)["input_ids"]

    def detokenize(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids)))

    @property
    def chat_template(self) -> str | None:
        """The folder's chat template (tokenizer_config.json or chat_template.jinja), None when it has none."""
        return getattr(self._tokenizer, "chat_template", None) or None

    def apply_chat_template(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = False) -> list[int]:
        """The ids of `messages` rendered by the folder's chat template (with the assistant's header after them when
        `add_generation_prompt`)."""
        ids = self._tokenizer.apply_chat_template(list(messages), tokenize=True, return_dict=False,
                                                  add_generation_prompt=add_generation_prompt)
        return [int(i) for i in ids]  # type: ignore[arg-type]  # one conversation: a flat list of ids


class JiebaBPETokenizer(Tokenizer):
    """Pai-Megatron-Patch's (RapidformerPro's) Chinese BPE: the text is first cut into words by jieba (rjieba, the
    binding of jieba-rs, or the jieba package), and the words are encoded as pre-split input by the BPE of a
    `tokenizers` tokenizer.json (--vocab-file); `<|endoftext|>` ends a document. Ids match Pai's tokenizer."""

    END_OF_DOCUMENT = "<|endoftext|>"

    def __init__(self, tokenizer_file: str) -> None:
        from tokenizers import Tokenizer as BPE

        self._cut = _jieba_cut()
        try:
            self._tokenizer = BPE.from_file(tokenizer_file)
        except Exception as error:  # noqa: BLE001 - tokenizers raises its own Exception for a damaged file
            raise TokenizerSettingsError(
                f"--vocab-file {tokenizer_file}: not a tokenizers tokenizer.json ({str(error).strip()[:200]}); "
                "JiebaBPETokenizer reads the tokenizer.json its model was trained with") from None
        eod = self._tokenizer.token_to_id(self.END_OF_DOCUMENT)
        if eod is None:
            raise TokenizerSettingsError(f"--vocab-file {tokenizer_file}: no {self.END_OF_DOCUMENT} token, which "
                                         "JiebaBPETokenizer ends each document with")
        self._eod: int = eod

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        words = list(self._cut(text))
        return self._tokenizer.encode(words, is_pretokenized=True, add_special_tokens=True).ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)


def _jieba_cut():
    """jieba's word cutter: rjieba's (what Pai imports), else the jieba package's."""
    try:
        import rjieba

        return rjieba.cut
    except ImportError:
        pass
    try:
        import jieba

        return jieba.cut
    except ImportError:
        raise TokenizerSettingsError(
            "--tokenizer-type JiebaBPETokenizer cuts Chinese text into words with jieba before its BPE, and neither "
            "rjieba nor jieba is installed: `pip install rjieba` (what Pai-Megatron-Patch uses)") from None


class NullTokenizer(Tokenizer):
    """Text that is already token ids separated by spaces; eod is `--vocab-size`, one past the ids
    the text may use, so vocab_size is `--vocab-size` + 1 (Megatron's convention)."""

    def __init__(self, vocab_size: int) -> None:
        self._eod = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._eod + 1

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        try:
            ids = [int(word) for word in text.split()]
        except ValueError:
            raise ValueError(
                f"NullTokenizer: text must be integers separated by spaces, got {text[:40]!r}"
            ) from None
        if ids and not 0 <= min(ids) <= max(ids) <= self._eod:
            raise ValueError(f"NullTokenizer: ids must lie in [0, {self._eod}] (--vocab-size {self._eod})")
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)
