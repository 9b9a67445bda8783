#!/usr/bin/env python
"""Megatron's tools/preprocess_data.py: JSON lines → PREFIX_{key}_document.bin/.idx for `--data-path`
(PREFIX_{key}_sentence.bin/.idx with --split-sentences, for BERT's sentence pairs).

    python scripts/preprocess_data.py --input corpus.jsonl --output-prefix data/my-corpus \
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt \
        --append-eod --workers 8
    # then train with --data-path data/my-corpus_text_document
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

if __package__ in (None, ""):
    # Run as a file from a checkout: make the package beside scripts/ importable without installing.
    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.isdir(os.path.join(_root, "rapidtrain")) and _root not in sys.path:
        sys.path.insert(0, _root)

from rapidtrain.config.flag_parser import FlagParser  # noqa: E402
from rapidtrain.core.errors import user_errors  # noqa: E402
from rapidtrain.data.preprocess import PreprocessSettings, preprocess  # noqa: E402
from rapidtrain.data.tokenizer import TOKENIZER_TYPES, TokenizerSettings  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = FlagParser(
        prog="preprocess_data.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    data = parser.add_argument_group("input data")
    data.add_argument("--input", required=True, help="JSON-lines file, one object per line (.gz is read too)")
    data.add_argument(
        "--json-keys", nargs="+", default=["text"], help="keys to tokenize; each writes its own .bin/.idx"
    )
    data.add_argument(
        "--split-sentences", action="store_true",
        help="one sequence per sentence, documents as sentence groups (BERT's input); writes PREFIX_{key}_sentence "
             "(rapidtrain.data.sentences: a rule-based splitter, no model download)",
    )
    data.add_argument(
        "--keep-newlines", action="store_true",
        help="with --split-sentences: each sentence keeps the whitespace after it, newlines included",
    )
    tok = parser.add_argument_group("tokenizer")
    tok.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    tok.add_argument("--vocab-file", help="GPT-2 vocab.json, or BERT vocab.txt")
    tok.add_argument("--merge-file", help="GPT-2 merges.txt")
    tok.add_argument("--tokenizer-model", help="SentencePiece .model file, or a local Hugging Face folder")
    tok.add_argument("--vocab-size", type=int, help="NullTokenizer: ids in the text are below this")
    tok.add_argument("--append-eod", action="store_true", help="end each non-empty document with eod")
    out = parser.add_argument_group("output data")
    out.add_argument("--output-prefix", required=True, help="writes PREFIX_{key}_document.bin and .idx")
    run = parser.add_argument_group("runtime")
    run.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    run.add_argument("--log-interval", type=int, default=1000, help="documents between progress updates")
    run.add_argument("--skip-bad-lines", action="store_true", help="skip malformed lines and count them")
    return parser.parse_args(argv)


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@user_errors("preprocess_data.py")
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = PreprocessSettings(
        input=args.input,
        output_prefix=args.output_prefix,
        tokenizer=TokenizerSettings(
            args.tokenizer_type,
            vocab_file=args.vocab_file,
            merge_file=args.merge_file,
            tokenizer_model=args.tokenizer_model,
            vocab_size=args.vocab_size,
        ),
        json_keys=args.json_keys,
        append_eod=args.append_eod,
        workers=args.workers,
        log_interval=args.log_interval,
        skip_bad_lines=args.skip_bad_lines,
        split_sentences=args.split_sentences,
        keep_newlines=args.keep_newlines,
    )
    # SIGTERM (a scheduler's kill) unwinds like Ctrl-C, so the partial files are removed on the way out.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        result = preprocess(settings)
    except KeyboardInterrupt:
        print("preprocess_data.py: interrupted; no output was written", file=sys.stderr)
        return 130
    for path in result.removed_stale:
        print(f"removed {path}, left by an earlier run that was killed")
    for prefix in result.data_prefixes.values():
        print(f"wrote {prefix}.bin and {prefix}.idx (use --data-path {prefix})")
    print(
        f"{result.num_documents} documents, {result.num_tokens} tokens in {result.seconds:.1f} s "
        f"({result.documents_per_second:,.0f} documents/s, {result.tokens_per_second:,.0f} tokens/s)"
    )
    if result.skipped_lines:
        print(f"skipped {result.skipped_lines} bad lines; the first: {result.bad_line_examples[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
