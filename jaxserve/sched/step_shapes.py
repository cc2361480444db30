"""The fixed shapes of the engine's compiled step, shared by the engine (which compiles one program per shape)
and by the cost model measured on it (which prices a batch by the program that runs it).

A step runs in one of two kinds of program, each padded to powers of two:
- decode: only decodes, one token per row, in `decode_rows` buckets (tokens = rows, no attention tiles);
- mixed: prefill chunks and decodes, padded to a (tokens, rows) bucket. Its prefill chunks are cut into attention
  tiles of `tile` tokens, each tile from one request; a step has room for tokens // tile tiles plus one partial
  tile per prefill chunk, so the number of prefill chunks a step may hold bounds the tile axis (and the
  attention's work, which runs over every tile, padding included).
A decode program reads the weights with as many rows as the batch has, not the mixed programs' 16-token minimum.
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
    decode_rows: tuple[int, ...]  # row buckets of the decode programs

    def shapes(self) -> list[tuple[int, int]]:
        """Every mixed (tokens, rows) program: a step never has more rows than tokens."""
        return [(t, r) for t in self.tokens for r in self.rows if r <= t]

    def fit_decode(self, rows: int) -> int:
        """The smallest decode program's rows holding `rows` decodes; ValueError past the largest."""
        i = bisect.bisect_left(self.decode_rows, rows)
        if i == len(self.decode_rows):
            raise ValueError(f"{rows} decodes exceed the largest decode program ({self.decode_rows[-1]} rows)")
        return self.decode_rows[i]

    def tiles(self, t: int, r: int) -> int:
        """Tiles a step of t tokens in r rows has: whole tiles of its tokens plus one partial per prefill chunk."""
        return t // self.tile + min(r, self.max_prefills)

    def fit(self, tokens: int, rows: int) -> tuple[int, int]:
        """The smallest (tokens, rows) bucket holding a step; ValueError past the largest."""
        i = bisect.bisect_left(self.rows, rows)
        r = self.rows[i] if i < len(self.rows) else None
        j = bisect.bisect_left(self.tokens, max(tokens, r or 0))
        if r is None or j == len(self.tokens):
            raise ValueError(
                f"a step of {tokens} tokens in {rows} rows exceeds the largest bucket "
                f"({self.tokens[-1]} tokens, {self.rows[-1]} rows)"
            )
        return self.tokens[j], r

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> StepShapes:
        return cls(tuple(d["tokens"]), tuple(d["rows"]), d["tile"], d["max_prefills"], tuple(d["decode_rows"]))
