"""Sentence splitting for `preprocess_data.py --split-sentences`, with no model to download.

Megatron splits with NLTK's Punkt, whose English model is a separate download; rapidtrain reads no network,
so it splits by rule: a sentence ends at `.`, `!`, `?` or `…` (closing quotes and brackets included) followed by
whitespace and a capital letter, digit, opening quote or a letter of a script without case; not after a known
abbreviation (Mr., e.g., Fig.), an initial (J. R. R. Tolkien) or inside a number (3.14). Chinese and Japanese
full stops (。！？) end a sentence without whitespace. Newlines alone do not end one, as in Punkt.
"""

from __future__ import annotations

import re

# Abbreviations that end with a period inside a sentence (lower case, without the final period).
ABBREVIATIONS = frozenset("""
mr mrs ms dr prof sr jr st mt rev hon gen col capt lt sgt cmdr gov sen rep pres supt
vs etc al cf ca approx dept est fig figs eq eqs no nos vol vols pp ch sec ser ed eds trans
inc ltd co corp bros llc plc assn univ
jan feb mar apr jun jul aug sep sept oct nov dec mon tue tues wed thu thur thurs fri sat sun
e.g i.e a.m p.m u.s u.k u.n e.u ph.d b.a m.a m.sc b.sc d.c
""".split())

_CANDIDATE = re.compile(r"[.!?…]+[\"'”’»)\]]*(\s+)")
_CJK_END = re.compile(r"[。！？]+[」』”’）)]*")
_OPENERS = "\"'“‘«([¿¡"
_WORD_BEFORE = re.compile(r"([\w.\-]+)\.$")


def _starts_sentence(text: str, position: int) -> bool:
    while position < len(text) and text[position] in _OPENERS:
        position += 1
    if position >= len(text):
        return False
    first = text[position]
    return first.isupper() or first.isdigit() or (first.isalpha() and not first.islower())


def _ends_with_abbreviation(text: str, end: int) -> bool:
    """True when the period at text[end - 1] belongs to an abbreviation or an initial."""
    word = _WORD_BEFORE.search(text[max(0, end - 40):end])
    if word is None:
        return False
    token = word.group(1).lower().lstrip("-")
    return token in ABBREVIATIONS or (len(token) == 1 and token.isalpha()) or bool(re.fullmatch(r"(\w\.)+\w", token))


def split_sentences(text: str, keep_newlines: bool = False) -> list[str]:
    """The sentences of `text` in order. Without `keep_newlines` each is stripped of surrounding whitespace;
    with it each keeps the whitespace that follows it (Megatron's --keep-newlines), so newlines survive."""
    ends = []
    for match in _CANDIDATE.finditer(text):
        punctuation_end = match.start(1)
        if not _starts_sentence(text, match.end()):
            continue
        if text[punctuation_end - 1] == "." and _ends_with_abbreviation(text, text.rindex(".", 0, punctuation_end) + 1):
            continue
        ends.append((punctuation_end, match.end()))
    for match in _CJK_END.finditer(text):
        gap = re.match(r"\s*", text[match.end():])
        ends.append((match.end(), match.end() + (gap.end() if gap else 0)))
    sentences, start = [], 0
    for punctuation_end, next_start in sorted(set(ends)):
        if punctuation_end <= start:
            continue
        sentences.append(text[start:next_start] if keep_newlines else text[start:punctuation_end])
        start = next_start
    sentences.append(text[start:])
    if keep_newlines:
        return [s for s in sentences if s.strip()]
    return [s.strip() for s in sentences if s.strip()]
