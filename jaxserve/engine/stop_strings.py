"""Stop strings found as text streams in, in time linear in the text however long the strings are.

Each stop string has a Knuth-Morris-Pratt automaton whose state is the longest prefix of the string that the
text ends with. One character advances it in amortised O(1); the state is also how much of the text must be
held back from the client, since it may begin a stop string. (Searching the text and testing every prefix
against its end instead costs O(len(stop)^2) per token: one long stop string then stalls every request.)
"""

from __future__ import annotations

from typing import Sequence


def _failure(s: str) -> list[int]:
    """fail[i]: the longest proper prefix of s[:i + 1] that is also its suffix."""
    fail = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


class StopMatcher:
    """The first place a stop string ends in a stream of text, and how much of its end may begin one."""

    def __init__(self, stops: Sequence[str]):
        self.stops = list(stops)
        self._fail = [_failure(s) for s in self.stops]
        self._state = [0] * len(self.stops)
        self.seen = 0  # characters fed so far

    def feed(self, text: str) -> int | None:
        """Advance over `text`; the index (in everything fed) where the first stop string to complete starts,
        or None. Ties at one end go to the longest string. After a match the matcher is spent."""
        for ch in text:
            self.seen += 1
            found = None
            for j, s in enumerate(self.stops):
                k, fail = self._state[j], self._fail[j]
                while k and s[k] != ch:
                    k = fail[k - 1]
                if s[k] == ch:
                    k += 1
                if k == len(s):
                    found = max(found or 0, k)
                    k = fail[k - 1]
                self._state[j] = k
            if found is not None:
                return self.seen - found
        return None

    @property
    def held(self) -> int:
        """Characters at the end of the text that may begin a stop string (not yet safe to send)."""
        return max(self._state, default=0)
