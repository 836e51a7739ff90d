"""Stop strings: which can be stop token ids, and how an engine sees one complete.

A recipe's stop strings are text. One that the tokenizer writes as a single token (the demo's "\\n") is
cheapest as a stop token id: an engine checks it with no decoding. Any other has to be matched against
the decoded completion (`SamplingParams.stop`): splitting it into its tokens and stopping on each would
stop on any of its pieces ("Ans" of "Answer:").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


def split_stops(tokenizer: Any, stops: Iterable[str]) -> tuple[list[int], list[str]]:
    """(stop token ids, stop strings) for `stops`: a string that encodes to exactly one token whose
    decode is the string itself becomes that token's id, every other stays a string. Order is kept and
    duplicates dropped."""
    ids: list[int] = []
    strings: list[str] = []
    for s in stops:
        if not s:
            raise ValueError("an empty stop string would end every completion at its first token; remove it")
        enc = tokenizer.encode(s, add_special_tokens=False)
        if len(enc) == 1 and tokenizer.decode(enc) == s:
            if enc[0] not in ids:
                ids.append(enc[0])
        elif s not in strings:
            strings.append(s)
    return ids, strings


def stop_window(stops: Sequence[str]) -> int:
    """How many trailing completion tokens to decode to see any of `stops` complete: every token that
    holds part of a stop string holds at least one of its bytes, and one more token in front keeps a
    tokenizer that drops a leading space at the start of a decode (SentencePiece) from hiding it."""
    return max((len(s.encode()) for s in stops), default=0) + 1


def stop_string_ended(tokenizer: Any, tail: Sequence[int], stops: Sequence[str]) -> bool:
    """Whether the last token of `tail` (the last `stop_window(stops)` completion tokens, or all of them
    when fewer) completed one of `stops`: the decoded tail holds a stop string that ends in the text that
    last token added (one that ended earlier would have stopped the completion then)."""
    text = tokenizer.decode(tail, skip_special_tokens=True)
    found = [s for s in stops if s in text]
    if not found:
        return False
    before = len(tokenizer.decode(tail[:-1], skip_special_tokens=True)) if len(tail) > 1 else 0
    return any(text.find(s, max(0, min(before, len(text)) - len(s) + 1)) >= 0 for s in found)
