"""Turns a stream of token ids into a stream of text, and finds stop strings in it.

Text is released only when it is final: never half of a multi-byte character, never a
prefix that a stop string could still turn out to start with.

Each step decodes only the tokens since the text was last complete (plus those just before,
for the tokenizer's spacing), not the whole output: decoding stays O(1) per token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


def decoder(tokenizer) -> Callable[[list[int]], str]:
    """ids -> text, as tokenizer.decode(ids, skip_special_tokens=True): straight from the fast tokenizer's
    Rust backend where that is all transformers' decode would do (no clean-up of spaces), a third of the cost."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def held_back(text: str, safe: int, stop: tuple[str, ...]) -> int:
    """Where the releasable text ends: text[:safe] less, for each stop string in turn, the longest tail (shorter
    than it) that could be its start, so that a stop string split across tokens is never half released.

    Only the tail's last character can end such a start, so the lengths tried are the places of that character in
    the stop string (str.rfind, from the longest down), each compared at C speed: a few compares per stop string
    and token, where trying every length cost up to len(s)**2 / 2 character compares (16 stop strings of 256
    characters: ~500,000 a token)."""
    for s in stop:
        if safe <= 0:
            break
        last, k = text[safe - 1], min(len(s) - 1, safe)
        while (k := s.rfind(last, 0, k) + 1) > 0:  # s[k-1] == last: a tail of length k may start s
            if text.endswith(s[:k], 0, safe):
                safe -= k
                break
            k -= 1
    return safe


@dataclass
class IncrementalText:
    tokenizer: object
    stop: tuple[str, ...] = ()
    ids: list[int] = field(default_factory=list)
    emitted: int = 0  # characters of the decoded text already released
    stopped: bool = False
    # The decoded text of ids[:_read], complete (no partial character at its end), and where
    # the window decoded next starts: the tokens since _read, after those of the last step.
    _complete: str = ""
    _read: int = 0
    _window: int = 0
    _before: int = 0  # with stop strings: the length of the text before the latest ids (complete characters)
    _decode: Callable[[list[int]], str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._decode = decoder(self.tokenizer)

    def _text(self) -> str:
        """The decoded text of all ids; the same as tokenizer.decode(ids, skip_special_tokens=True)."""
        decode = self._decode
        before = decode(self.ids[self._window : self._read]) if self._read > self._window else ""
        window = decode(self.ids[self._window :])
        if self._window > 0 and not (before and window.startswith(before)):
            # Tokens whose text depends on more than the previous step's: decode everything.
            text = decode(self.ids)
        else:
            text = self._complete + window[len(before) :]
        if not text.endswith("\ufffd"):
            self._complete, self._window, self._read = text, self._read, len(self.ids)
        return text

    def add(self, new_ids: list[int]) -> str:
        """Returns the text that is now safe to release (may be empty). When new_ids complete a stop string
        (stopped), the text released ends where the stop string begins or where new_ids' own text begins,
        whichever is first: the tokens that completed it are not returned, nor is any of their text."""
        self.ids.extend(new_ids)
        text = self._text()
        if self.stop:
            hits = [i for i in (text.find(s, max(0, self.emitted - len(s))) for s in self.stop) if i >= 0]
            if hits:
                self.stopped = True
                return self._release(text, min(*hits, self._before))
            self._before = len(text.rstrip("\ufffd"))  # where the next tokens' text begins
        safe = len(text)
        if text.endswith("\ufffd"):
            safe = len(text.rstrip("\ufffd"))  # an incomplete UTF-8 sequence: wait for more
        return self._release(text, held_back(text, safe, self.stop))

    def flush(self) -> str:
        """At the end, release whatever is held back (no stop string can complete any more)."""
        if self.stopped:
            return ""
        text = self._text()
        return self._release(text, len(text))

    def _release(self, text: str, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        out = text[self.emitted : upto]
        self.emitted = upto
        return out
