"""CDSP prefill on devices: each chunk of a prompt runs the whole model over its own SP group (ring attention
inside `shard_map`), the request's history read from per-device stores, and the history is rebalanced onto the
next chunk's larger group in between.

Every device of the pool owns one store: K/V buffers [layers, cap, kvh, d] preallocated on it, for the one
request whose prefill it is serving (the planner books a device for a request from its first chunk there to its
last, so no two requests share one), with each row's position kept on the host (NO_POSITION: empty or padding).
A chunk's step appends this device's shard of the chunk at row `fill` and reads the history through a loop with
a traced trip count, so programs are compiled once per (group, local chunk bucket): none per history length,
none per chunk. The stores are donated (updated in place); only the sampled first token leaves the devices.

With tp > 1 the pool is made of instances of tp devices each, tensor-parallel inside (sharding/tp.py): a group
is a set of instances (each named by its first device's id), its chunk runs on an (sp, tp) mesh, and each
instance's store is split over its devices by KV head.

The chunk's attention over the group is CDSP's ring by default. sp_attention="sp_ntp" makes the pool CSPS's:
heads over the group by all-to-all (sharding/ulysses.py), and with sparse_attention=drop its CSA (sharding/csa.py:
the chunk's contiguous shards as CSA's partitions, the history dense). The stores keep history by sequence in
every mode, so rebalancing and transfers do not change.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxserve.engine.kv_cache import cache_dtype
from jaxserve.engine.sampling import sample
from jaxserve.sampling_params import SamplingParams
from jaxserve.models.config import LlamaConfig
from jaxserve.models.llama import Llama
from jaxserve.pallas_kernels.dispatch import Implementation
from jaxserve.pallas_kernels.reference import NO_POSITION
from jaxserve.sched.cdsp import Stores
from jaxserve.sharding import csa, layouts, processes, rebalance, rows, tp as tensor_parallel
from jaxserve.sharding.mesh import SP, TP, make_mesh
from jaxserve.sharding.ring import StoreMetadata, StoreRingBackend
from jaxserve.sharding.ulysses import StoreUlyssesBackend

Group = tuple[int, ...]  # instance ids (each instance's first device's id) in ring order
SPAttention = Literal["ring", "sp_ntp"]
SP_ATTENTION: tuple[SPAttention, ...] = ("ring", "sp_ntp")


@dataclasses.dataclass
class Store:
    """One instance's history buffers and, on the host, the position of each row."""

    k: jax.Array  # [layers, cap, kvh, d] on its instance's devices (split by KV head)
    v: jax.Array
    pos: np.ndarray  # [cap] int32
    fill: int = 0  # rows written (padding rows included)
    owner: str | None = None

    def valid_rows(self) -> np.ndarray:
        return np.flatnonzero(self.pos[: self.fill] != NO_POSITION)


@dataclasses.dataclass(frozen=True)
class ChunkRun:
    """A dispatched chunk: its sampled token (fetch when needed) and the store rows it wrote on each device."""

    sampled: processes.Later  # the draw of the device holding the chunk's last token
    written: dict[int, tuple[int, int]]  # instance id -> [lo, hi) rows

    def ready(self) -> bool:
        """The chunk has finished on its devices (token() would not wait)."""
        return self.sampled.ready()

    def token(self) -> int:
        return int(self.sampled.value())


def next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class SPPrefill:
    def __init__(
        self,
        cfg: LlamaConfig,
        params: Any,
        devices: Sequence[jax.Device],
        *,
        capacity: int,
        dtype=jnp.float32,
        key_block: int = 256,
        min_local: int = 16,
        layout: layouts.Layout = "zigzag",
        implementation: Implementation | None = None,
        tp: int = 1,
        sp_attention: SPAttention = "ring",
        sparse_attention: float | None = None,
        kv_cache_dtype: str = "auto",
    ):
        """devices: the pool, consecutive runs of tp devices forming one (tensor-parallel) instance; capacity:
        history rows each instance's store holds (rounded up to key blocks); min_local: the smallest
        per-instance chunk bucket; sp_attention, sparse_attention: the chunk's attention (module docstring;
        CSA lays chunks out contiguously, whatever `layout` says). kv_cache_dtype: CacheConfig's, as the decode
        instances' caches have it."""
        if len(devices) % tp:
            raise ValueError(f"{len(devices)} prefill devices do not form instances of {tp}")
        if sp_attention not in SP_ATTENTION:
            raise ValueError(f"sp_attention must be one of {SP_ATTENTION}, got {sp_attention!r}")
        if sparse_attention is not None and (sp_attention != "sp_ntp" or not 0 <= sparse_attention <= 1):
            raise ValueError(
                "sparse_attention (CSA's drop ratio, in [0, 1]) needs sp_attention='sp_ntp', got "
                f"{sparse_attention!r} with {sp_attention!r}"
            )
        if cfg.sliding_window or cfg.per_layer:
            raise ValueError(
                f"the prefill pool's sequence-parallel attention has no sliding window (the model's is "
                f"{cfg.sliding_window} tokens, or differs by layer): serve this model without prefill "
                "instances"
            )
        self.sp_attention, self.sparse_attention = sp_attention, sparse_attention
        layout = "contiguous" if sparse_attention is not None else layout
        self.cfg, self.dtype, self.key_block, self.layout, self.tp = cfg, dtype, key_block, layout, tp
        self.kv_dtype = cache_dtype(dtype, devices[0].platform, kv_cache_dtype)  # the stores'
        self.min_local, self.implementation = max(min_local, 2), implementation
        self.cap = -(-capacity // key_block) * key_block
        self.room = Stores(self.cap, self.min_local)  # what the planner places chunks by
        self.instances = {devices[i].id: tuple(devices[i : i + tp]) for i in range(0, len(devices), tp)}
        params, self._specs = tensor_parallel.shard_params(params, cfg, tp)
        self.share = cfg.split(tp)
        self._params = {}
        shape = (cfg.num_layers, self.cap, self.share.cache_heads, cfg.head_dim)
        self.stores: dict[int, Store] = {}
        for i, devs in self.instances.items():
            mesh = make_mesh(devs, tp)
            self._params[i] = jax.device_put(params, tensor_parallel.shardings(mesh, self._specs))
            zeros = jax.jit(
                lambda: jnp.zeros(shape, self.kv_dtype), out_shardings=NamedSharding(mesh, P(None, None, TP))
            )
            self.stores[i] = Store(zeros(), zeros(), np.full(self.cap, NO_POSITION, np.int32))
        self._steps: dict[tuple[Group, int], Any] = {}
        self._group_params: dict[Group, Any] = {}
        self._meshes: dict[Group, Mesh] = {}

    # ---- shapes ---------------------------------------------------------------------------------------------
    def local_bucket(self, sp: int, tokens: int) -> int:
        """Per-device rows of a chunk of `tokens` on `sp` devices: a power of two (zigzag: even)."""
        return self.room.local(sp, tokens)

    def buckets(self, sp: int, max_tokens: int) -> list[int]:
        """Every local bucket a chunk of up to max_tokens on sp devices can use (none past a store)."""
        top = min(self.local_bucket(sp, max_tokens), self.cap)
        return [b for b in (self.min_local << i for i in range(top.bit_length())) if b <= top]

    # ---- compiled steps -------------------------------------------------------------------------------------
    def program(self, group: Group, local: int) -> Any:
        """The compiled chunk step for `group` and local bucket (compiled ahead of time on first use)."""
        key = (group, local)
        if key not in self._steps:
            self._steps[key] = self._compile(group, local)
        return self._steps[key]

    @property
    def num_programs(self) -> int:
        return len(self._steps)

    def _mesh(self, group: Group) -> Mesh:
        if group not in self._meshes:
            self._meshes[group] = make_mesh([d for i in group for d in self.instances[i]], self.tp)
        return self._meshes[group]

    def _mesh_params(self, group: Group) -> Any:
        """The weights over the group (each instance's copy, split over its devices), assembled from the
        per-instance arrays (no copy)."""
        if group not in self._group_params:
            self._group_params[group] = jax.tree.map(
                lambda sharding, *xs: jax.make_array_from_single_device_arrays(
                    xs[0].shape, sharding, [s.data for x in xs for s in x.addressable_shards], dtype=xs[0].dtype
                ),
                tensor_parallel.shardings(self._mesh(group), self._specs),
                *(self._params[i] for i in group),
                is_leaf=lambda x: isinstance(x, NamedSharding),
            )
        return self._group_params[group]

    def _compile(self, group: Group, local: int) -> Any:
        mesh = self._mesh(group)
        step = chunk_step(
            self.cfg,
            mesh,
            self._specs,
            key_block=self.key_block,
            dtype=self.dtype,
            implementation=self.implementation,
            backend=self.backend(len(group)),
        )
        if not processes.local_devices(mesh.devices.flat):
            return step  # another host's group: JAX skips its calls here (nothing to compile)
        layers, *rest = self.stores[group[0]].k.shape
        return step.lower(
            self._mesh_params(group), *chunk_args(mesh, local, self.cap, (layers, *rest), self.kv_dtype)
        ).compile()

    def backend(self, sp: int) -> StoreRingBackend | StoreUlyssesBackend | csa.StoreCSABackend:
        """The chunk's attention over a group of sp instances."""
        if self.sparse_attention is not None:
            return csa.StoreCSABackend(
                csa.levels_for(sp, self.sparse_attention), self.key_block, implementation=self.implementation
            )
        kind = StoreUlyssesBackend if self.sp_attention == "sp_ntp" else StoreRingBackend
        return kind(sp, self.key_block, implementation=self.implementation)

    def warmup_moves(self, instance: int) -> None:
        """Compile the row take and put programs of every piece size on `instance` (its store must be free: what
        these write is never read)."""
        s = self.stores[instance]
        for n in (1 << j for j in range(self.cap.bit_length()) if 1 << j <= self.cap):
            s.k, s.v = rows.put(s.k, s.v, *rows.take(s.k, s.v, 0, size=n), 0)
            self.take(instance, 0, n)

    # ---- chunks ---------------------------------------------------------------------------------------------
    def claim(self, request_id: str, group: Group) -> None:
        """Give request_id the stores of `group` it does not hold yet (they must be free)."""
        for i in group:
            s = self.stores[i]
            if s.owner not in (None, request_id):
                raise RuntimeError(
                    f"instance {i} still holds request {s.owner}'s history; {request_id} cannot "
                    "use it (the planner books an instance for one request at a time)"
                )
            s.owner = request_id

    def assume_history(self, request_id: str, group: Group, history: int) -> None:
        """Give request_id `history` tokens of history spread evenly over `group`'s free stores without computing
        it: the rows keep whatever the stores hold. For timing chunks (pool_profile), whose time depends on how
        many rows they attend to, not on what the rows hold."""
        self.claim(request_id, group)
        shares = rebalance.targets(history, len(group))
        for i, lo, share in zip(group, np.cumsum(shares) - shares, shares):
            s = self.stores[i]
            if share > self.cap:
                raise ValueError(f"{history} history tokens do not fit {len(group)} stores of {self.cap} rows")
            s.fill = int(share)
            s.pos[:share] = np.arange(lo, lo + share)

    def release(self, request_id: str) -> None:
        for s in self.stores.values():
            if s.owner == request_id:
                s.owner, s.fill = None, 0
                s.pos[:] = NO_POSITION

    def run_chunk(
        self, request_id: str, group: Group, tokens: Sequence[int], start: int, params: SamplingParams, seed: int
    ) -> ChunkRun:
        """Dispatch the chunk of `tokens` at positions start.. on `group` (whose stores hold all of the request's
        history; rebalance first when the group grew). Returns without waiting for the devices."""
        p, n = len(group), len(tokens)
        local = self.local_bucket(p, n)
        t = p * local
        perm = layouts.permutation(t, p, self.layout)
        idx = np.arange(t)
        valid = idx < n
        ids = np.where(valid, np.pad(np.asarray(tokens, np.int32), (0, t - n)), 0)[perm]
        q_pos = np.where(valid, start + idx, -1).astype(np.int32)[perm]
        k_pos = np.where(valid, start + idx, NO_POSITION).astype(np.int32)[perm]
        flat = int(layouts.inverse(perm)[n - 1])
        owner, row = divmod(flat, local)
        self.claim(request_id, group)
        held = [d for d, s in self.stores.items() if s.owner == request_id and d not in group and s.fill]
        if held:
            raise RuntimeError(f"request {request_id}'s history is also on instances {held}, outside {group}")
        stores = [self.stores[i] for i in group]
        for i, s in zip(group, stores):
            if s.fill + local > self.cap:
                raise RuntimeError(
                    f"instance {i}'s history store cannot take a chunk of {local} rows after the "
                    f"{s.fill} it holds ({self.cap} rows; the planner places chunks within them)"
                )
        sharding = NamedSharding(self._mesh(group), P(SP))
        put = lambda x: jax.device_put(x, sharding)  # noqa: E731
        fill = np.array([s.fill for s in stores], np.int32)
        blocks = -(-fill // self.key_block)
        if isinstance(self.backend(p), StoreUlyssesBackend):
            blocks[:] = blocks.max()  # every device joins each history block's all-to-all
        last = np.where(np.arange(p) == owner, row, 0).astype(np.int32)
        rep = lambda x, dtype: np.full(p, x, dtype)  # noqa: E731
        layers, *rest = stores[0].k.shape
        kv_sharding = NamedSharding(self._mesh(group), P(SP, None, TP))
        kv = [
            jax.make_array_from_single_device_arrays(
                (p * layers, *rest),
                kv_sharding,
                [shard.data for x in xs for shard in x.addressable_shards],
                dtype=self.kv_dtype,
            )
            for xs in ([s.k for s in stores], [s.v for s in stores])
        ]
        processes.meet(self._mesh(group).devices.flat)
        out, k2, v2 = self.program(group, local)(
            self._mesh_params(group),
            put(ids),
            put(q_pos),
            put(k_pos),
            put(np.concatenate([s.pos for s in stores])),
            put(fill),
            put(blocks),
            put(last),
            put(rep(params.temperature, np.float32)),
            put(rep(params.top_k, np.int32)),
            put(rep(params.top_p, np.float32)),
            put(rep(seed, np.uint32)),
            put(rep(0, np.int32)),
            *kv,
        )
        new_k = {s.device: s.data for s in k2.addressable_shards}
        new_v = {s.device: s.data for s in v2.addressable_shards}
        written = {}
        for j, (i, s) in enumerate(zip(group, stores)):
            own = lambda new, old: jax.make_array_from_single_device_arrays(  # noqa: E731
                old.shape,
                old.sharding,
                [new[d] for d in self.instances[i] if d in new],  # this process's
                dtype=old.dtype,
            )
            s.k, s.v = own(new_k, s.k), own(new_v, s.v)
            mine = k_pos[j * local : (j + 1) * local]
            s.pos[s.fill : s.fill + local] = mine
            # each layout gives a device its valid rows first: the padding after them is free for the next write
            valid = int(np.count_nonzero(mine != NO_POSITION))
            kept = valid if (mine[valid:] == NO_POSITION).all() else local
            written[i] = (s.fill, s.fill + kept)
            s.fill += kept
        return ChunkRun(processes.read_later(out, owner), written)

    # ---- moving history -------------------------------------------------------------------------------------
    def rebalance(self, request_id: str, group: Group) -> int:
        """Spread request_id's history evenly over `group` (every instance holding it must be in the group):
        each instance keeps its share and only the excess rows move, into instances below their share. Returns
        the tokens moved."""
        self.claim(request_id, group)
        stores = [self.stores[i] for i in group]
        valid = [s.valid_rows() for s in stores]
        want = rebalance.targets(sum(len(v) for v in valid), len(group))
        excess = [v[w:] for v, w in zip(valid, want)]  # each instance's last rows beyond its share
        sending = iter([(j, r) for j, e in enumerate(excess) for r in e])
        moved = 0
        for dst, (s, v, w) in enumerate(zip(stores, valid, want)):
            need = int(w) - len(v)
            if need <= 0:
                continue
            got = [next(sending) for _ in range(need)]
            for src in sorted({j for j, _ in got}):
                picked = np.array([r for j, r in got if j == src])
                for lo, hi in rows.runs(picked):
                    self._move(stores[src], s, lo, hi)
                moved += len(picked)
        for s, e in zip(stores, excess):  # compact the senders: drop the rows that left (a tail of valid rows)
            if len(e):
                s.pos[e] = NO_POSITION
                s.fill = int(s.valid_rows().max(initial=-1)) + 1
        return moved

    def _move(self, src: Store, dst: Store, lo: int, hi: int) -> None:
        for at, size in rows.pieces(lo, hi):
            k, v = rows.take(src.k, src.v, at, size=size)
            k, v = processes.move(k, dst.k.sharding), processes.move(v, dst.v.sharding)
            dst.k, dst.v = rows.put(dst.k, dst.v, k, v, dst.fill)
            dst.pos[dst.fill : dst.fill + size] = src.pos[at : at + size]
            dst.fill += size

    def rows_of(self, instance: int, lo: int, hi: int) -> list[tuple[jax.Array, jax.Array, np.ndarray]]:
        """The valid rows of [lo, hi) on `instance`, as power-of-two pieces (k, v [layers, n, kvh, d] in the
        model's head layout, positions) taken out of its store (so the store may be reused before they are
        sent)."""
        s = self.stores[instance]
        out = []
        for a, b in rows.runs(lo + np.flatnonzero(s.pos[lo:hi] != NO_POSITION)):
            for at, size in rows.pieces(a, b):
                out.append((*self.take(instance, at, size), s.pos[at : at + size].copy()))
        return out

    def take(self, instance: int, at: int, size: int) -> tuple[jax.Array, jax.Array]:
        """Store rows [at, at + size) of `instance` in the model's head layout (a repeated KV head once)."""
        s = self.stores[instance]
        k, v = rows.take(s.k, s.v, at, size=size)
        repeat = self.share.kv_repeat
        return tensor_parallel.model_heads(k, v, repeat=repeat) if repeat > 1 else (k, v)


def chunk_step(
    cfg: LlamaConfig,
    mesh: Mesh,
    specs: Any,
    *,
    key_block: int,
    dtype,
    implementation: Implementation | None = None,
    backend: Any = None,
) -> Any:
    """The jitted chunk step of the model over `mesh` (sp x tp): `backend`'s attention (default the ring) inside
    `shard_map`, the stores donated. specs: the parameters' PartitionSpecs (tensor_parallel.shard_params)."""
    p, tp = mesh.shape[SP], mesh.shape[TP]
    backend = backend or StoreRingBackend(p, key_block, implementation=implementation)
    model = Llama(cfg, backend, dtype, TP if tp > 1 else None)

    def body(
        params,
        ids,
        q_pos,
        k_pos,
        hist_pos,
        fill,
        blocks,
        last,
        temperature,
        top_k,
        top_p,
        seed,
        counter,
        k_store,
        v_store,
    ):
        metadata = StoreMetadata(hist_pos, k_pos, fill[0], blocks[0])
        logits, caches = model.apply(params, ids[None], q_pos[None], (k_store, v_store), metadata, last[None])
        # one draw a chunk, beside a whole chunk's forward: the top-k / top-p sort always runs (one program)
        return (sample(logits[0], temperature, top_k, top_p, seed, counter, cut=True),) + caches

    seq, kv = P(SP), P(SP, None, TP)  # the stores: one per instance on the layer axis, heads over its devices
    return jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(specs,) + (seq,) * 12 + (kv, kv), out_specs=(seq, kv, kv), check_vma=False
        ),  # a Pallas kernel inside shard_map needs check_vma=False
        donate_argnums=(13, 14),
    )


def chunk_args(mesh: Mesh, local: int, cap: int, store: tuple[int, ...], dtype) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The shapes chunk_step is compiled for (all but the parameters): `local` chunk rows and `cap` history rows
    per instance, each instance's store of shape `store` [layers, cap, kvh, d]."""
    p = mesh.shape[SP]
    seq, kv = P(SP), P(SP, None, TP)
    sharded = lambda shape, dtype, spec=seq: jax.ShapeDtypeStruct(  # noqa: E731
        shape, dtype, sharding=NamedSharding(mesh, spec)
    )
    i32, f32 = jnp.int32, jnp.float32
    group_store = (p * store[0], *store[1:])  # the group's stores side by side on the layer axis, one per instance
    return (
        (sharded((p * local,), i32),) * 3
        + (sharded((p * cap,), i32),)
        + (sharded((p,), i32),) * 3
        + (
            sharded((p,), f32),
            sharded((p,), i32),
            sharded((p,), f32),
            sharded((p,), jnp.uint32),
            sharded((p,), i32),
            sharded(group_store, dtype, kv),
            sharded(group_store, dtype, kv),
        )
    )
