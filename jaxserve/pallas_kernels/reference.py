"""Pure-jnp references of the attention kernels: the semantics every kernel and sharded path is checked against.

Masks come from positions, so one function serves history + causal-within-chunk, any sequence layout
(contiguous / striped / zigzag shards carry their own positions) and padding: a padded key has position
NO_POSITION (never visible), a padded query has position -1 (sees nothing). A query that sees no key gets
output 0 and log-sum-exp -inf, which is what `merge_attention` expects of an empty shard. With a sliding `window`
(Mistral, Phi-3) a query at p sees the keys at p - window < j <= p only (`visible`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jaxserve.pallas_kernels.paged_attention import page_slots, pages_in_order, walk_bounds

NO_POSITION = 2**30  # position of a padded key: larger than any query position
_NEG = -1e30  # finite: a row that sees no key stays NaN-free


def visible(k_pos: Int[Array, "..."], q_pos: Int[Array, "..."], window: int | None) -> Array:
    """Is a key at k_pos visible to a query at q_pos (broadcast): causal, and within a sliding window if any."""
    seen = k_pos <= q_pos
    return seen if window is None else seen & (k_pos > q_pos - window)


def chunk_attention(
    q: Float[Array, "t h d"],
    k: Float[Array, "s kvh d"],
    v: Float[Array, "s kvh d"],
    q_pos: Int[Array, " t"],
    k_pos: Int[Array, " s"],
    window: int | None = None,
    key_step: int | None = None,
) -> tuple[Float[Array, "t h d"], Float[Array, "t h"]]:
    """Softmax attention of each query over the keys `visible` to it (GQA: h a multiple of kvh).

    Returns the float32 output and the float32 log-sum-exp of the scaled scores, per query and head. key_step:
    the keys that many at a time, each step's partial merged into the last (the same result; KEY_STEP, the CPU's).
    """
    if key_step is not None and k.shape[0] > key_step:
        return _stepped(q, k, v, q_pos, k_pos, window, key_step)
    t, h, d = q.shape
    kvh = k.shape[1]
    qg = q.reshape(t, kvh, h // kvh, d).astype(jnp.float32) * d**-0.5
    scores = jnp.einsum("tkgd,skd->kgts", qg, k.astype(jnp.float32))
    visible_ = visible(k_pos[None, :], q_pos[:, None], window)
    scores = jnp.where(visible_, scores, -jnp.inf)
    lse = jax.nn.logsumexp(scores, axis=-1)  # [kvh, g, t]; -inf where nothing is visible
    probs = jnp.where(visible_, jnp.exp(scores - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    out = jnp.einsum("kgts,skd->tkgd", probs, v.astype(jnp.float32))
    return out.reshape(t, h, d), lse.reshape(h, t).T


# a CPU's chunk attention reads this many keys at a time, so that a long chunk's scores stay [t, KEY_STEP] a head:
# dense, one ring step of an 8,192-row shard holds 1 GB of them (docs/BENCHMARKS.md, "Long contexts")
KEY_STEP = 1024


def _stepped(q, k, v, q_pos, k_pos, window, key_step):
    """chunk_attention over the keys key_step at a time (a scan), the partials merged as they come."""
    kvh, d = k.shape[1:]
    pad = -k.shape[0] % key_step
    k, v = (jnp.pad(x, ((0, pad), (0, 0), (0, 0))).reshape(-1, key_step, kvh, d) for x in (k, v))
    k_pos = jnp.pad(k_pos, (0, pad), constant_values=NO_POSITION).reshape(-1, key_step)

    def step(carry, keys):
        part = chunk_attention(q, *keys[:2], q_pos, keys[2], window)
        return merge_attention(*(jnp.stack(x) for x in zip(carry, part))), None

    empty = (jnp.zeros(q.shape, jnp.float32), jnp.full(q.shape[:2], -jnp.inf, jnp.float32))
    return jax.lax.scan(step, empty, (k, v, k_pos))[0]


def merge_attention(
    o: Float[Array, "n ... d"], lse: Float[Array, "n ..."]
) -> tuple[Float[Array, "... d"], Float[Array, "..."]]:
    """Combine n partial results over disjoint key sets into the exact softmax result (-inf partials drop out)."""
    m = jnp.max(lse, axis=0)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse - m_safe)  # 0 for empty partials
    total = jnp.sum(w, axis=0)
    out = jnp.sum(o * w[..., None], axis=0) / jnp.where(total > 0, total, 1.0)[..., None]
    return out, jnp.where(total > 0, m_safe + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)


def paged_decode_attention(
    q: Float[Array, "b h d"],
    k_cache: Float[Array, "slots kvh d"],
    v_cache: Float[Array, "slots kvh d"],
    block_tables: Int[Array, "b nblk"],
    kv_lens: Int[Array, " b"],
    *,
    block_size: int,
    num_splits: int,
) -> tuple[Float[Array, "b n h d"], Float[Array, "b n h"]]:
    """One new query per request over its first kv_lens cached tokens, split into num_splits KV ranges.

    Split i covers block-table columns [i * nblk / n, (i + 1) * nblk / n); merge the partials with
    `merge_attention` over axis 1 (after moving it first) for the full result.
    """
    b, nblk = block_tables.shape
    if nblk % num_splits:
        raise ValueError(f"block table width {nblk} is not a multiple of num_splits {num_splits}")
    per = nblk // num_splits
    slots = page_slots(block_tables, block_size).reshape(b, num_splits, per * block_size)
    pos = jnp.arange(nblk * block_size).reshape(num_splits, per * block_size)

    def one(qb, slot_b, kv_len):
        def split(slot_s, pos_s):
            k_pos = jnp.where(pos_s < kv_len, pos_s, NO_POSITION)
            o, lse = chunk_attention(qb[None], k_cache[slot_s], v_cache[slot_s], jnp.array([kv_len - 1]), k_pos)
            return o[0], lse[0]

        return jax.vmap(split)(slot_b, pos)

    return jax.vmap(one)(q, slots, kv_lens)


# keys tiled_paged_attention reads a loop step where queries and keys meet (the causal edge): few, so a decode
# reads few keys past its context and a step's scores stay in a CPU core's cache. A lone decode row reads more:
# its steps cost more than its keys (docs/BENCHMARKS.md, "Generation vs Hugging Face transformers").
DECODE_KEYS, ONE_ROW_KEYS, TILE_KEYS = 32, 128, 64
# Keys before every query of a loop's rows are all visible: there a step reads HISTORY_KEYS, a GEMM of hundreds
# of keys (a long chunk's history, a long decode's context), and TILE_GROUP prefill tiles (32 tokens each) go
# together, so a long chunk runs as few large products, not many small ones (docs/BENCHMARKS.md, "Long contexts").
HISTORY_KEYS, TILE_GROUP = 1024, 8


def tiled_paged_attention(
    q: Float[Array, "n tq h d"],
    q_pos: Int[Array, "n tq"],
    k_cache: Float[Array, "slots kvh d"],
    v_cache: Float[Array, "slots kvh d"],
    tables: Int[Array, "n w"],
    *,
    block_size: int,
    key_block: int,
    window: int | None = None,
    page_pos: Int[Array, "n w"] | None = None,
) -> tuple[Float[Array, "n tq h d"], Float[Array, "n tq h"]]:
    """Each tile's queries over its own request's pages: a key at position j is visible to a query at position p
    when `visible` (j <= p, within the window) and its block entry is not -1 (p = -1 marks padding: it sees
    nothing). `tables` rows are block tables whose width is a multiple of key_block / block_size; blocks past a
    request's length may hold anything (never visible). page_pos: the first key position of each entry, increasing
    along a row (None: entry c holds positions [c * block_size, (c + 1) * block_size)); a KV-parallel device passes
    the blocks it holds first (`paged_attention.held_pages`), so that it walks those alone. Softmax in float32
    whatever the cache dtype. Returns the output (0 where no key is visible) and its float32 log-sum-exp (-inf there).

    Decode tiles (one token) run together, as far as the longest context among them (on a 2-core CPU faster than
    one row at a time). Longer tiles run TILE_GROUP at a time, one group after another, each group to its own
    last position (a group of padding tiles runs none). Each loop reads the keys every query of its rows sees
    HISTORY_KEYS a step, then the rest (the causal edge) DECODE_KEYS a step for decode tiles (ONE_ROW_KEYS for
    one), TILE_KEYS for the others. Pages are gathered whole (a block_size x kvh x d piece each)."""
    n, tq, h, d = q.shape
    kvh = k_cache.shape[-2]
    g = h // kvh
    width = tables.shape[1]  # a multiple of key_block's pages: a step that divides it never reads past the table

    def pages_for(keys: int, unit: int = 1) -> int:
        """Pages a loop step reads: the most (a multiple of unit, dividing the width) within `keys` keys."""
        keys = max(keys, unit * block_size)
        return max(p for p in range(unit, width + 1, unit) if width % p == 0 and p * block_size <= keys)

    edge = pages_for(TILE_KEYS if tq > 1 else ONE_ROW_KEYS if n == 1 else DECODE_KEYS)
    # [n, kvh, g*tq, d]: each KV head's query group and tokens as one matrix (row r is token r % tq)
    qg = (q.astype(jnp.float32) * d**-0.5).reshape(n, tq, kvh, g, d).transpose(0, 2, 3, 1, 4).reshape(n, kvh, g * tq, d)
    rows_pos = jnp.tile(q_pos, (1, g))[:, None, :, None]  # [n, 1, g*tq, 1]
    if page_pos is None:
        page_pos = pages_in_order(tables, block_size)
    k_pages, v_pages = (c.reshape(-1, block_size, kvh, d) for c in (k_cache, v_cache))
    # the history's steps a multiple of the edge's, so that the edge's loop starts where the history's ended
    loops = _Loops(k_pages, v_pages, pages_for(HISTORY_KEYS, edge), edge, window)
    # each row's loop bounds, once, before the loops (reduced inside the tile loop, a long chunk ran slower)
    bounds, has_query = jnp.stack(walk_bounds(q_pos, page_pos, block_size, window), axis=1), jnp.any(q_pos >= 0, 1)
    if tq == 1:  # decode rows together: the keys they all see, then to the longest context
        carry, first = loops.history(qg, rows_pos, tables, page_pos, bounds, has_query)
        m, l, acc = loops.edge(qg, rows_pos, tables, page_pos, bounds, has_query, first, carry)
    else:  # tiles a group at a time over the keys the whole group sees, then each tile to its own last position
        group = max(k for k in range(1, TILE_GROUP + 1) if n % k == 0)

        def one_group(i, state):
            rows = [
                jax.lax.dynamic_slice_in_dim(x, i * group, group)
                for x in (qg, rows_pos, tables, page_pos, bounds, has_query)
            ]
            carry, first = loops.history(*rows)
            return (
                [jax.lax.dynamic_update_slice_in_dim(x, y, i * group, 0) for x, y in zip(state[0], carry)],
                jax.lax.dynamic_update_slice_in_dim(state[1], jnp.full(group, first), i * group, 0),
            )

        history, first = jax.lax.fori_loop(
            0, n // group, one_group, (_Loops.empty(n, kvh, g * tq, d), jnp.zeros(n, jnp.int32))
        )

        def one_tile(i, out):  # reads `history`, writes `out`: no buffer both read and written in the loop
            mine = [
                jax.lax.dynamic_slice_in_dim(x, i, 1)
                for x in (qg, rows_pos, tables, page_pos, bounds, has_query, *history)
            ]
            return [
                jax.lax.dynamic_update_slice_in_dim(x, y, i, 0)
                for x, y in zip(out, loops.edge(*mine[:6], first[i], mine[6:]))
            ]

        m, l, acc = jax.lax.fori_loop(0, n, one_tile, _Loops.empty(n, kvh, g * tq, d))
    seen = l > 0
    out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
    out = out.reshape(n, kvh, g, tq, d).transpose(0, 3, 1, 2, 4).reshape(n, tq, h, d)
    return out.astype(q.dtype), lse.reshape(n, kvh, g, tq).transpose(0, 3, 1, 2).reshape(n, tq, h)


def _fewest(entries: Int[Array, " n"], has_query: Bool[Array, " n"]) -> Int[Array, ""]:
    """The fewest entries over the rows with a query (0 without one)."""
    return jnp.where(jnp.any(has_query), jnp.min(jnp.where(has_query, entries, entries.max())), 0)


@dataclasses.dataclass(frozen=True)
class _Loops:
    """The online softmax's two key loops over pages: `pages` a step over the keys every query of the rows sees
    (their history), then `edge_pages` a step (a divisor of pages) from there to the rows' last position. Steps
    count table entries, which hold increasing positions: the keys below a position are a row's leading entries."""

    k_pages: Float[Array, "pages bs kvh d"]
    v_pages: Float[Array, "pages bs kvh d"]
    pages: int
    edge_pages: int
    window: int | None

    @staticmethod
    def empty(n: int, kvh: int, r: int, d: int) -> list[Array]:
        """The carry before any key: running max, sum and unnormalised output."""
        return [
            jnp.full((n, kvh, r), _NEG, jnp.float32),
            jnp.zeros((n, kvh, r), jnp.float32),
            jnp.zeros((n, kvh, r, d), jnp.float32),
        ]

    def history(self, qg, rows_pos, tables, page_pos, bounds, has_query) -> tuple[list[Array], Int[Array, ""]]:
        """The carry over the whole history steps below each row's earliest query (from the first entry any query
        sees), and the edge step the rest starts at. bounds: the rows' paged_attention.walk_bounds, stacked."""
        n, kvh, r, d = qg.shape
        start = _fewest(bounds[:, 0], has_query) // self.pages
        split = jnp.maximum(_fewest(bounds[:, 1], has_query) // self.pages, start)
        empty = self.empty(n, kvh, r, d)
        carry = jax.lax.cond(
            split > start,
            lambda: self._loop(qg, rows_pos, tables, page_pos, self.pages, start, split, empty),
            lambda: empty,
        )
        return carry, split * (self.pages // self.edge_pages)

    def edge(self, qg, rows_pos, tables, page_pos, bounds, has_query, first, carry) -> list[Array]:
        """The carry after the edge steps from `first` to each row's last query (none for a row without one)."""
        first = jnp.maximum(first, _fewest(bounds[:, 0], has_query) // self.edge_pages)
        return self._loop(
            qg,
            rows_pos,
            tables,
            page_pos,
            self.edge_pages,
            first,
            (jnp.max(bounds[:, 2]) + self.edge_pages - 1) // self.edge_pages,
            carry,
        )

    def _loop(self, qg, rows_pos, tables, page_pos, pages: int, lo, hi, carry) -> list[Array]:
        """The carry after the steps [lo, hi) of `pages` entries each."""
        n, kvh, r, d = qg.shape
        block_size = self.k_pages.shape[1]
        key_block = pages * block_size

        def body(j, carry):
            m, l, acc = carry
            blk = jax.lax.dynamic_slice_in_dim(tables, j * pages, pages, axis=1)  # [n, pages]
            here = jnp.repeat(blk >= 0, block_size, axis=1)[:, None, None, :]  # [n, 1, 1, kb]
            k_pos = (
                jax.lax.dynamic_slice_in_dim(page_pos, j * pages, pages, axis=1)[:, :, None] + jnp.arange(block_size)
            ).reshape(n, 1, 1, key_block)
            k, v = (
                c[jnp.maximum(blk, 0)].reshape(n, key_block, kvh, d).astype(jnp.float32)
                for c in (self.k_pages, self.v_pages)
            )
            s = jnp.einsum("nhrd,nkhd->nhrk", qg, k)  # [n, kvh, r, kb]
            seen = visible(k_pos, rows_pos, self.window) & here
            s = jnp.where(seen, s, _NEG)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.where(seen, jnp.exp(s - m_new[..., None]), 0.0)  # a row with no key yet must not count masked
            scale = jnp.exp(m - m_new)
            return [m_new, l * scale + p.sum(-1), acc * scale[..., None] + jnp.einsum("nhrk,nkhd->nhrd", p, v)]

        return jax.lax.fori_loop(lo, hi, body, carry)
