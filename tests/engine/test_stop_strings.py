"""Stop strings matched as text streams in (engine/stop_strings.py) against a direct search of the whole text."""

from __future__ import annotations

import random

import pytest

from jaxserve.engine.stop_strings import StopMatcher


def first_stop(text: str, stops: list[str]) -> int | None:
    """Where the stop string that completes first starts (ties at one end: the longest), by brute force."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            return end - max(map(len, hits))
    return None


def held(text: str, stops: list[str]) -> int:
    return max((k for s in stops for k in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:k])), default=0)


@pytest.mark.parametrize("seed", range(40))
def test_streamed_matches_equal_a_search_of_the_whole_text(seed):
    rng = random.Random(seed)
    alphabet = "ab" if seed % 2 else "abc"  # small alphabets: many overlaps and partial matches
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4))]
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
    m, fed, found = StopMatcher(stops), "", None
    while len(fed) < len(text) and found is None:  # pieces of any size, as a detokenizer gives them
        piece = text[len(fed) : len(fed) + rng.randint(0, 4)]
        found = m.feed(piece)
        fed += piece
        if found is None:
            assert m.held == held(fed, stops)
    assert found == first_stop(text, stops)


def test_the_longest_partial_match_is_held_back_until_the_string_completes():
    """The old hold-back's worst case (O(len^2) per token): a 1,024-character string of one letter but the last
    against a long run of that letter."""
    m = StopMatcher(["a" * 1023 + "b"])
    for _ in range(4096):
        assert m.feed("a") is None
    assert m.held == 1023
    assert m.feed("b") == 4096 - 1023
