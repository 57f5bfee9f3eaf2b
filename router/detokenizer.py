"""Turns a stream of token ids into a stream of text, and finds stop strings in it.

Text is released only when it is final: never half of a multi-byte character, never a
prefix that a stop string could still turn out to start with.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class IncrementalText:
    tokenizer: object
    stop: tuple[str, ...] = ()
    ids: list[int] = field(default_factory=list)
    emitted: int = 0  # characters of the decoded text already released
    stopped: bool = False

    def add(self, new_ids: list[int]) -> str:
        """Returns the text that is now safe to release (may be empty)."""
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if self.stop:
            hits = [i for i in (text.find(s, max(0, self.emitted - len(s))) for s in self.stop) if i >= 0]
            if hits:
                self.stopped = True
                return self._release(text, min(hits))
        safe = len(text)
        if text.endswith("\ufffd"):
            safe = len(text.rstrip("\ufffd"))  # an incomplete UTF-8 sequence: wait for more
        for s in self.stop:  # hold back a tail that could be the start of a stop string
            for k in range(min(len(s) - 1, safe), 0, -1):
                if text[safe - k : safe] == s[:k]:
                    safe -= k
                    break
        return self._release(text, safe)

    def flush(self) -> str:
        """At the end, release whatever is held back (no stop string can complete any more)."""
        if self.stopped:
            return ""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        return self._release(text, len(text))

    def _release(self, text: str, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        out = text[self.emitted : upto]
        self.emitted = upto
        return out
