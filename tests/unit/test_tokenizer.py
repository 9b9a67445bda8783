"""Tokenizers by --tokenizer-type, each trained here on local text: ids, special tokens and vocabulary
sizes as Megatron's tokenizers give them; clear errors naming the flag when a file is missing."""

import json
import unicodedata
from itertools import pairwise
from pydoc_data.topics import topics

import pytest
import sentencepiece

from rapidtrain.data.tokenizer import (
    TOKENIZER_TYPES,
    NullTokenizer,
    TokenizerFileNotFoundError,
    TokenizerSettings,
    TokenizerSettingsError,
    build_tokenizer,
    padded_vocab_size,
)

CORPUS = [line for name in sorted(topics)[:20] for line in topics[name].splitlines() if line.strip()]
SAMPLES = [
    "The for statement is used to iterate over the elements of a sequence.",
    "  Leading spaces, tabs\tand\nnewlines; naïve café ÜBER 3.14 <|endoftext|> [SEP]",
    "",
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Tiny GPT-2 BPE, BERT WordPiece and SentencePiece files trained on Python's help topics."""
    from tokenizers import BertWordPieceTokenizer, ByteLevelBPETokenizer

    folder = tmp_path_factory.mktemp("tokenizers")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=600, special_tokens=["<|endoftext|>"], show_progress=False)
    bpe.save_model(str(folder))
    wordpiece = BertWordPieceTokenizer()
    wordpiece.train_from_iterator(CORPUS, vocab_size=500, show_progress=False)
    wordpiece.save_model(str(folder))
    for name, extra in (("sp", {}), ("sp_pad", {"pad_id": 3})):
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(CORPUS),
            model_prefix=str(folder / name),
            vocab_size=300,
            minloglevel=2,
            **extra,
        )
    return folder


def gpt2_reference_ids(text, vocab_path, merges_path):
    """GPT-2's original byte-level BPE, written out plainly: regex split, bytes as unicode, merge by rank."""
    regex = pytest.importorskip("regex")
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    extra = iter(range(256, 512))
    byte_char = {b: chr(b if b in printable else next(extra)) for b in range(256)}
    vocab = json.load(open(vocab_path, encoding="utf-8"))
    merges = [
        tuple(line.split()) for line in open(merges_path, encoding="utf-8").read().splitlines()[1:] if line
    ]
    rank = {pair: i for i, pair in enumerate(merges)}
    pattern = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    ids = []
    for word in regex.findall(pattern, text):
        parts = [byte_char[b] for b in word.encode("utf-8")]
        while len(parts) > 1:
            pairs = [(rank.get(pair, len(rank)), i) for i, pair in enumerate(pairwise(parts))]
            best, i = min(pairs)
            if best == len(rank):
                break
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        ids.extend(vocab[p] for p in parts)
    return ids


def bert_reference_ids(text, vocab, lower_case):
    """BERT's basic tokenizer (ASCII punctuation) and greedy longest-match WordPiece."""
    if lower_case:
        text = "".join(
            c for c in unicodedata.normalize("NFD", text.lower()) if unicodedata.category(c) != "Mn"
        )
    words = []
    for chunk in text.split():
        word = ""
        for c in chunk:
            if unicodedata.category(c).startswith("P") or c in "$+<=>^`|~":
                words += [word, c] if word else [c]
                word = ""
            else:
                word += c
        words += [word] if word else []
    ids = []
    for word in words:
        start, pieces = 0, []
        while start < len(word):
            end = len(word)
            while end > start and ("##" if start else "") + word[start:end] not in vocab:
                end -= 1
            if end == start:
                pieces = [vocab["[UNK]"]]
                break
            pieces.append(vocab[("##" if start else "") + word[start:end]])
            start = end
        ids += pieces
    return ids


def test_gpt2_bpe_matches_the_original_algorithm(files):
    vocab, merges = str(files / "vocab.json"), str(files / "merges.txt")
    tokenizer = build_tokenizer(TokenizerSettings("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges))
    entries = json.load(open(vocab))
    assert tokenizer.vocab_size == len(entries) == 600
    assert tokenizer.eod == entries["<|endoftext|>"] == 0
    assert (tokenizer.pad, tokenizer.cls, tokenizer.sep, tokenizer.mask) == (None, None, None, None)
    for text in SAMPLES:
        ids = tokenizer.tokenize(text)
        assert ids == gpt2_reference_ids(text, vocab, merges)
        assert tokenizer.detokenize(ids) == text
    # "<|endoftext|>" typed in the text is ordinary text in Megatron's GPT-2 tokenizer, never the eod id.
    assert tokenizer.eod not in tokenizer.tokenize("a <|endoftext|> b")


@pytest.mark.parametrize("kind", ["BertWordPieceLowerCase", "BertWordPieceCase"])
def test_bert_wordpiece_matches_greedy_wordpiece(files, kind):
    lines = open(files / "vocab.txt", encoding="utf-8").read().splitlines()
    vocab = {token: i for i, token in enumerate(lines)}
    tokenizer = build_tokenizer(TokenizerSettings(kind, vocab_file=str(files / "vocab.txt")))
    # Megatron appends [BOS] and [EOS] to the vocabulary; it has no end-of-document token for BERT.
    assert tokenizer.vocab_size == len(lines) + 2
    assert tokenizer.eod is None
    assert (tokenizer.cls, tokenizer.sep, tokenizer.pad, tokenizer.mask) == tuple(
        vocab[t] for t in ("[CLS]", "[SEP]", "[PAD]", "[MASK]")
    )
    lower = kind == "BertWordPieceLowerCase"
    for text in SAMPLES:
        assert tokenizer.tokenize(text) == bert_reference_ids(text, vocab, lower)
    assert (tokenizer.tokenize("The Café") == tokenizer.tokenize("the cafe")) == lower
    assert tokenizer.tokenize("[SEP]") != [tokenizer.sep]  # typed text is never a special token
    assert tokenizer.detokenize(tokenizer.tokenize("the statement is used")) == "the statement is used"


def test_megatron_sentencepiece_appends_its_special_tokens(files):
    model = str(files / "sp.model")
    sp = sentencepiece.SentencePieceProcessor(model_file=model)
    tokenizer = build_tokenizer(TokenizerSettings("SentencePieceTokenizer", tokenizer_model=model))
    n = len(sp)  # bos <s> and eos </s> exist; <CLS> <SEP> <EOD> <MASK> and <PAD> are appended in that order
    assert (tokenizer.cls, tokenizer.sep, tokenizer.eod, tokenizer.mask, tokenizer.pad) == (
        n,
        n + 1,
        n + 2,
        n + 3,
        n + 4,
    )
    assert tokenizer.vocab_size == n + 5
    text = "the list<EOD>object</s>"
    ids = tokenizer.tokenize(text)
    assert ids == sp.encode("the list") + [n + 2] + sp.encode("object") + [sp.eos_id()]
    assert tokenizer.detokenize(ids) == "the list <EOD> object </s> "
    assert tokenizer.tokenize(SAMPLES[0]) == sp.encode(SAMPLES[0])


def test_megatron_sentencepiece_reuses_a_pad_the_model_has(files):
    model = str(files / "sp_pad.model")
    tokenizer = build_tokenizer(TokenizerSettings("SentencePieceTokenizer", tokenizer_model=model))
    n = len(sentencepiece.SentencePieceProcessor(model_file=model))
    assert tokenizer.pad == 3 and tokenizer.vocab_size == n + 4 and tokenizer.eod == n + 2


@pytest.mark.parametrize("kind", ["GPTSentencePieceTokenizer", "Llama2Tokenizer"])
def test_plain_sentencepiece_types_use_the_model_as_is(files, kind):
    sp = sentencepiece.SentencePieceProcessor(model_file=str(files / "sp_pad.model"))
    tokenizer = build_tokenizer(TokenizerSettings(kind, tokenizer_model=str(files / "sp_pad.model")))
    assert tokenizer.vocab_size == len(sp) == 300
    assert tokenizer.eod == sp.eos_id() == 2 and tokenizer.pad == 3
    assert (tokenizer.cls, tokenizer.sep, tokenizer.mask) == (None, None, None)
    bos = [sp.bos_id()] if kind == "Llama2Tokenizer" else []
    assert tokenizer.tokenize(SAMPLES[0]) == bos + sp.encode(SAMPLES[0])
    assert tokenizer.detokenize(sp.encode(SAMPLES[0])) == SAMPLES[0]


def test_hugging_face_folder_loads_offline(files, tmp_path):
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    rust = RustTokenizer(models.BPE.from_file(str(files / "vocab.json"), str(files / "merges.txt")))
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=rust, eos_token="<|endoftext|>").save_pretrained(tmp_path / "hf")
    tokenizer = build_tokenizer(
        TokenizerSettings("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "hf"))
    )
    assert tokenizer.vocab_size == 600 and tokenizer.eod == 0 and tokenizer.pad is None
    assert tokenizer.tokenize(SAMPLES[0]) == rust.encode(SAMPLES[0]).ids
    assert tokenizer.detokenize(tokenizer.tokenize(SAMPLES[0])) == SAMPLES[0]


def test_null_tokenizer_reads_integers_and_puts_eod_past_them():
    tokenizer = build_tokenizer(TokenizerSettings("NullTokenizer", vocab_size=1000))
    assert isinstance(tokenizer, NullTokenizer)
    assert tokenizer.vocab_size == 1001 and tokenizer.eod == 1000
    assert tokenizer.tokenize("3 1  4\n1 999") == [3, 1, 4, 1, 999]
    assert tokenizer.tokenize("") == []
    assert tokenizer.detokenize([3, 14]) == "3 14"
    with pytest.raises(ValueError, match="integers separated by spaces"):
        tokenizer.tokenize("3 x")
    with pytest.raises(ValueError, match=r"\[0, 1000\]"):
        tokenizer.tokenize("1001")


def test_padded_vocab_size_is_a_multiple_of_divisor_times_tp():
    assert padded_vocab_size(50257) == 50304
    assert padded_vocab_size(50257, 128, 8) == 51200
    assert padded_vocab_size(128) == 128 and padded_vocab_size(1) == 128
    assert padded_vocab_size(8005, 64, 2) == 8064
    settings = TokenizerSettings("NullTokenizer", vocab_size=1000, tensor_model_parallel_size=4)
    assert settings.padded_vocab_size_of(build_tokenizer(settings)) == 1024  # 1001 ids, multiple of 512
    with pytest.raises(ValueError, match="must be positive"):
        padded_vocab_size(100, 0)


MISSING = [
    (dict(tokenizer_type="GPT2BPETokenizer"), "--vocab-file"),
    (dict(tokenizer_type="GPT2BPETokenizer", vocab_file="vocab.json"), "--merge-file"),
    (dict(tokenizer_type="BertWordPieceCase"), "--vocab-file"),
    (dict(tokenizer_type="SentencePieceTokenizer"), "--tokenizer-model"),
    (dict(tokenizer_type="Llama2Tokenizer"), "--tokenizer-model"),
    (dict(tokenizer_type="HuggingFaceTokenizer"), "--tokenizer-model"),
    (dict(tokenizer_type="NullTokenizer"), "--vocab-size"),
]


@pytest.mark.parametrize(("fields", "flag"), MISSING)
def test_missing_flag_is_named(files, fields, flag):
    if "vocab_file" in fields:
        fields = {**fields, "vocab_file": str(files / fields["vocab_file"])}
    with pytest.raises(TokenizerSettingsError, match=f"needs {flag}"):
        build_tokenizer(TokenizerSettings(**fields))


@pytest.mark.parametrize(
    ("fields", "flag"),
    [
        (dict(tokenizer_type="BertWordPieceLowerCase", vocab_file="nope.txt"), "--vocab-file"),
        (dict(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model="nope.model"), "--tokenizer-model"),
        (dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="gpt2"), "--tokenizer-model"),
    ],
)
def test_missing_file_is_named_and_never_downloaded(tmp_path, fields, flag):
    fields = {k: (v if k == "tokenizer_type" else str(tmp_path / v)) for k, v in fields.items()}
    with pytest.raises(TokenizerFileNotFoundError, match=f"{flag} {tmp_path}") as error:
        build_tokenizer(TokenizerSettings(**fields))
    assert isinstance(error.value, FileNotFoundError)


def test_unknown_type_lists_the_choices():
    with pytest.raises(TokenizerSettingsError, match="choose one of GPT2BPETokenizer") as error:
        build_tokenizer(TokenizerSettings("WordLevel"))
    assert all(kind in str(error.value) for kind in TOKENIZER_TYPES)


def test_a_file_of_the_wrong_kind_is_refused(files):
    with pytest.raises(TokenizerSettingsError, match="not a SentencePiece model"):
        build_tokenizer(TokenizerSettings("SentencePieceTokenizer", tokenizer_model=str(files / "vocab.txt")))
    with pytest.raises(TokenizerSettingsError, match=r"lacks \[UNK\]"):
        build_tokenizer(TokenizerSettings("BertWordPieceCase", vocab_file=str(files / "merges.txt")))


def test_swapped_vocab_and_merges_files_are_named_in_one_message(files):
    vocab, merges = str(files / "vocab.json"), str(files / "merges.txt")
    with pytest.raises(TokenizerSettingsError) as refused:
        build_tokenizer(TokenizerSettings("GPT2BPETokenizer", vocab_file=merges, merge_file=vocab))
    message = str(refused.value)
    assert f"--vocab-file {merges} / --merge-file {vocab}" in message and "swapped" in message
