"""A run's tokenizer in the form `transformers.AutoTokenizer.from_pretrained` loads, so that a `--hf` export stands
alone: the same ids for the same text and the same end of document as rapidtrain's tokenizer (data/tokenizer.py).
SentencePiece models are converted with transformers' own converter, Megatron's appended pieces added as special
tokens at their ids; GPT-2 BPE and BERT WordPiece files are read by the tokenizers library's matching models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rapidtrain.data.tokenizer import (
    BertWordPieceTokenizer,
    GPT2BPETokenizer,
    Llama2Tokenizer,
    SentencePieceTokenizer,
    TokenizerSettings,
    build_tokenizer,
)

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")


def hf_tokenizer(settings: TokenizerSettings) -> Any:
    """A transformers tokenizer that encodes and decodes as `build_tokenizer(settings)` does, or None for the
    NullTokenizer (ids without text)."""
    kind = settings.tokenizer_type
    if kind == "HuggingFaceTokenizer":
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(settings.tokenizer_model, local_files_only=True)
    if kind == "NullTokenizer":
        return None
    ours = build_tokenizer(settings)
    if kind in SENTENCEPIECE_TYPES:
        assert settings.tokenizer_model is not None  # build_tokenizer required it
        return _sentencepiece(settings.tokenizer_model, ours)
    if isinstance(ours, GPT2BPETokenizer):
        return _gpt2_bpe(settings)
    if isinstance(ours, BertWordPieceTokenizer):
        return _bert_wordpiece(settings, kind == "BertWordPieceLowerCase")
    raise ValueError(f"no Hugging Face form for --tokenizer-type {kind}")


def special_token_ids(settings: TokenizerSettings, tokenizer: Any) -> dict[str, int]:
    """The ids an exported model's config.json names (eos_token_id, bos_token_id, pad_token_id), each only where
    the tokenizer defines it: eos is the run's end of document (what `rapidtrain generate` stops at, and what the
    data appended after every document), so that transformers' `generate` stops there with no argument; bos and pad
    are those of `tokenizer`, the Hugging Face form written beside the model (`hf_tokenizer`)."""
    ids: dict[str, int] = {}
    eod = None if settings.tokenizer_type == "HuggingFaceTokenizer" else build_tokenizer(settings).eod
    eos = eod if eod is not None else tokenizer.eos_token_id
    for name, value in (("eos_token_id", eos), ("bos_token_id", tokenizer.bos_token_id),
                        ("pad_token_id", tokenizer.pad_token_id)):
        if isinstance(value, int):
            ids[name] = value
    if "eos_token_id" in ids and tokenizer.eos_token_id != ids["eos_token_id"]:
        raise ValueError(f"the Hugging Face tokenizer's eos ({tokenizer.eos_token_id}) is not the run's end of "
                         f"document ({ids['eos_token_id']})")
    return ids


def _sentencepiece(model_file: str, ours: Any) -> Any:
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf

    proto = import_protobuf().ModelProto()
    proto.ParseFromString(Path(model_file).read_bytes())
    pieces = [(piece.piece, piece.score) for piece in proto.pieces]
    unigram = proto.trainer_spec.model_type == 1  # else BPE: its vocabulary as a dict, merges ranked by score
    vocab: Any = pieces if unigram else {piece: i for i, (piece, _) in enumerate(pieces)}
    backend = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab)
    sp = ours._sp
    special = {"bos_token": sp.id_to_piece(sp.bos_id()) if sp.bos_id() >= 0 else None,
               "eos_token": sp.id_to_piece(sp.eos_id()) if sp.eos_id() >= 0 else None,
               "unk_token": sp.id_to_piece(sp.unk_id()) if sp.unk_id() >= 0 else None,
               "pad_token": sp.id_to_piece(sp.pad_id()) if sp.pad_id() >= 0 else None}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **{k: v for k, v in special.items() if v})
    if isinstance(ours, SentencePieceTokenizer):  # Megatron's pieces after the model's, at the ids it gives them
        appended = sorted((i, piece) for piece, i in ours._special.items() if i >= len(pieces))
        tokenizer.add_special_tokens({"additional_special_tokens": [piece for _, piece in appended]})
        for piece, i in ours._special.items():
            if tokenizer.convert_tokens_to_ids(piece) != i:
                raise ValueError(f"the Hugging Face tokenizer puts {piece} at another id than {i}")
        roles = {"eos_token": "<EOD>", "cls_token": "<CLS>", "sep_token": "<SEP>", "mask_token": "<MASK>"}
        pad = next(p for p, i in ours._special.items() if i == ours.pad)
        tokenizer.add_special_tokens({**roles, "pad_token": pad})
    if isinstance(ours, Llama2Tokenizer) and sp.bos_id() >= 0:  # Llama 2 puts bos before every text
        bos = sp.id_to_piece(sp.bos_id())
        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, sp.bos_id())])
    return tokenizer


def _gpt2_bpe(settings: TokenizerSettings) -> Any:
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    backend = ByteLevelBPETokenizer(settings.vocab_file, settings.merge_file)
    return PreTrainedTokenizerFast(tokenizer_object=backend._tokenizer, eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>", unk_token="<|endoftext|>")


def _bert_wordpiece(settings: TokenizerSettings, lower_case: bool) -> Any:
    from tokenizers import BertWordPieceTokenizer as Backend
    from transformers import PreTrainedTokenizerFast

    backend = Backend(settings.vocab_file, lowercase=lower_case)
    return PreTrainedTokenizerFast(tokenizer_object=backend._tokenizer, unk_token="[UNK]", sep_token="[SEP]",
                                   pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]")
