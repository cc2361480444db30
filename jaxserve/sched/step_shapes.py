"""The fixed shapes of the engine's compiled step, shared by the engine (which compiles one program per shape)
and by the cost model measured on it (which prices a batch by the program that runs it).

A step is padded to a (tokens, rows) bucket, powers of two. Its prefill chunks are cut into attention tiles of
`tile` tokens, each tile from one request; a step has room for tokens // tile tiles plus one partial tile per
prefill chunk, so the number of prefill chunks a step may hold bounds the tile axis (and the attention's work,
which runs over every tile, padding included).
"""

from __future__ import annotations

import bisect
import dataclasses


def powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 2lo, 4lo, ... up to the first value >= hi."""
    out = [lo]
    while out[-1] < hi:
        out.append(out[-1] * 2)
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class StepShapes:
    tokens: tuple[int, ...]
    rows: tuple[int, ...]
    tile: int
    max_prefills: int  # prefill chunks (rows of more than one token) per step

    def shapes(self) -> list[tuple[int, int]]:
        """Every (tokens, rows) program: a step never has more rows than tokens."""
        return [(t, r) for t in self.tokens for r in self.rows if r <= t]

    def tiles(self, t: int, r: int) -> int:
        """Tiles a step of t tokens in r rows has: whole tiles of its tokens plus one partial per prefill chunk."""
        return t // self.tile + min(r, self.max_prefills)

    def fit(self, tokens: int, rows: int) -> tuple[int, int]:
        """The smallest (tokens, rows) bucket holding a step; ValueError past the largest."""
        i = bisect.bisect_left(self.rows, rows)
        r = self.rows[i] if i < len(self.rows) else None
        j = bisect.bisect_left(self.tokens, max(tokens, r or 0))
        if r is None or j == len(self.tokens):
            raise ValueError(f"a step of {tokens} tokens in {rows} rows exceeds the largest bucket "
                             f"({self.tokens[-1]} tokens, {self.rows[-1]} rows)")
        return self.tokens[j], r

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> StepShapes:
        return cls(tuple(d["tokens"]), tuple(d["rows"]), d["tile"], d["max_prefills"])
