"""A prefill/decode-disaggregated cluster in simulation (Tetris 3.2, 4.2, 5.2; TetriInfer 3.3-3.4): a prefill
side, KV transfer to a decode instance, and decode instances running the live one's ReplicaScheduler (its
admission of prefilled requests: greedy with recompute, reserve-static, reserve-dynamic) on a GPU profile.

- Prefill, `prefill="pool"` (Tetris): a pool of TP-1 GPUs planned by an SP planner (CDSP, fixed SP,
  request-level); each arrival is planned once on the pool's booked times; the chunks start as CDSPPolicy's
  plans say, as live (each device's in booked order), each lasting what its planner priced; its first token comes
  with the last chunk, and each chunk's KV is sent when it ends (chunk-wise transfer).
- Prefill, `prefill="tetriinfer"`: prefill instances of `prefill_tp` GPUs, each running
  sched/prefill_batches.py (scheduling batches ordered FCFS / SJF / LJF, non-preemptive, fixed-size padded
  chunks); an arrival goes to the instance with the fewest prompt tokens left to prefill (TetriInfer's global
  scheduler), a prompt is dispatched when the chunk holding its last piece starts, and its whole KV is sent
  once that chunk ends (the paper's request-level transfer). The ClusterPlans are TetriInferPolicy's, as live,
  its instance flips (3.5) included.
  The length predictor's own cost on the prefill instance is not charged.
- Prefill, `prefill="esp"` (LoongServe, as cluster/esp.py serves it): `prefill_instances` elastic instances that
  also decode (decode instance k is instance k; with `spread`, decode instance `prefill_instances` is the
  multi-master group over their pools, sched/spread_kv.py). ESPPolicy's rounds batch the waiting prompts onto
  groups of them, each batch lasting `Costs.batch`; a batch starts once its instances' decode steps end, and they
  (the group: while any batch runs) pause until it ends; each prompt's KV then moves to where its dispatch keeps
  it, in one transfer. The policy sees the pool as live (sched/cluster.py's elastic_pool): KV promised counts.
- Dispatch (sched/decode_dispatch.py): Tetris's freeness rate with virtual usage, or TetriInfer's power of two
  over instances with room for the predicted footprint, balancing heavy decodes. With the pool, at planning time.
- Transfer: KV leaves the prefill side's GPUs in parallel (an SP group's or a TP instance's shares) over the
  inter-node link (fitted to the send/recv profile). A decode instance has a few receive backends (GPU
  buffers): a finished chunk's transfer waits for one, in order (the handshake Tetris overlaps with prefill
  compute), so under load transfers queue instead of starving. Decoding starts when the prompt's KV has landed.
  The dispatch load, the promises and the handshake are the live cluster's (sched/decode_ledger.py).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import time
from typing import Callable, Protocol, Sequence

import numpy as np
from tqdm.auto import tqdm

from jaxserve.sched import decode_ledger
from jaxserve.sched.cluster import CDSPPolicy, ESPPolicy, Planner, TetriInferPolicy, averaged_step, elastic_pool
from jaxserve.sched.decode_dispatch import LengthPredictor, PromptInfo
from jaxserve.sched.decode_ledger import DecodeLedger, Transfer
from jaxserve.sched.flip import Flip, FlipController
from jaxserve.sched.build import packer_config, replica_scheduler
from jaxserve.sched.esp import ESPScheduler
from jaxserve.sched.kv_manager import BlockTables, KVCacheManager
from jaxserve.sched.spread_kv import SpreadKV
from jaxserve.sched.batch_cost import BatchCost
from jaxserve.sched.plan import Dispatch, Outcome, WorkItem
from jaxserve.sched.prefill_batches import PrefillBatchScheduler, chunk_time
from jaxserve.sched.profiles import PROFILES, ProfileBatchCost, kv_capacity, model_shape, network
from jaxserve.sched.request import Request
from jaxserve.config import DECODE_ADMISSION, SLO, SchedulerConfig
from jaxserve.sim.metrics import Results
from jaxserve.sim.simulator import PLACEHOLDER_TOKEN, step_seconds, step_tokens
from jaxserve.sim.workload import Workload


BLOCK_SIZE = 16  # a decode instance's KV block, tokens
MAX_EMPTY_PLANS = 4  # Plans of no work in a row before a step start gives up (the next event plans again)
# DisaggConfig.admission -> the decode instances' ReplicaScheduler admission; the oracle reserves what a perfect
# predictor would give (the true output length)
ADMISSIONS = {"oracle": "reserve_static"} | {a: a for a in DECODE_ADMISSION}


class FlipRule(Protocol):
    """When a unit changes role (sched/flip.py's FlipPolicy, TetriInfer 3.5); the run measures, drains and flips."""

    @property
    def window(self) -> float:
        """Seconds of load a unit's mean is taken over."""
        ...

    @property
    def check_every(self) -> float:
        """Seconds between checks."""
        ...

    def choose(self, prefill: Sequence[float | None], decode: Sequence[float | None]) -> tuple[Flip, int] | None:
        """Each unit's mean load (None until a whole window is seen) -> (a Flip, unit)."""
        ...


@dataclasses.dataclass(frozen=True)
class DisaggConfig:
    prefill: str = "pool"  # or "tetriinfer" (TetriInfer's prefill instances; no planner), or "esp"
    prefill_instances: int = 16  # GPUs in the pool, TetriInfer prefill instances, or ESP's elastic instances
    prefill_tp: int = 1  # GPUs per TetriInfer prefill instance
    prefill_chunk: int = 512  # TetriInfer's ChunkSize: the accelerator's saturation point
    prefill_batch: int = 16  # TetriInfer's PrefillSchedBatch
    prefill_order: str = "sjf"  # fcfs, sjf or ljf within a scheduling batch
    decode_instances: int = 4
    decode_tp: int = 4
    profile: str = "a100_llama3_8b"  # decode instances' GPU profile; KV bytes per token from its model
    recv_backends: int = 4  # transfer buffers per decode instance
    dispatch: str = "freeness"  # or "power_of_two" (TetriInfer; needs a length predictor)
    # decode admission (sched/scheduler.py): greedy, reserve_static or reserve_dynamic on the predictor's
    # lengths, or oracle (reserve_static on the true ones)
    admission: str = "oracle"
    # TetriInfer's instance flip: with the pool, decode_tp prefill GPUs <-> one decode instance; with TetriInfer's
    # prefill, each of the prefill_instances + decode_instances instances prefills or decodes
    flip: FlipRule | None = None
    seed: int = 0  # power of two's sampling
    spread: bool = False  # esp: a prompt's KV may stay spread over instances, decoded by the multi-master group
    slo: SLO = SLO()
    memory_utilization: float = 0.9

    def decode_kv_capacity(self) -> int:
        return kv_capacity(self.profile, self.decode_tp, self.memory_utilization)


@dataclasses.dataclass(frozen=True)
class Costs:
    """What the simulated executor charges: the GPU profile's by default (`profile_costs`); a replay of a live run
    passes what that run measured (tools/bench/cluster.py)."""

    decode: BatchCost  # one decode instance's step
    prefill: BatchCost | None  # one TetriInfer prefill instance's chunk (None: a prefill pool, planned)
    transfer: Callable[[int, int], float]  # seconds to move `tokens` of KV sent by `senders` GPUs at once
    decode_kv_capacity: int  # tokens of KV one decode instance holds
    max_num_seqs: int = 256  # sequences one decode step runs
    batch: Callable[[Sequence[int], int], float] | None = None  # esp: a batch of prompts (lengths) on sp instances


def profile_costs(config: DisaggConfig) -> Costs:
    """The costs of `config`'s GPU profile: measured operators and the inter-node link."""
    link = network(PROFILES[config.profile][0])
    kv_bytes = model_shape(config.profile).kv_bytes_per_token()
    return Costs(
        decode=ProfileBatchCost(config.profile, config.decode_tp),
        prefill=ProfileBatchCost(config.profile, config.prefill_tp),
        transfer=lambda tokens, senders: link.predict("inter_node", tokens * kv_bytes / senders),
        decode_kv_capacity=config.decode_kv_capacity(),
    )


class SimulatedDecoder:
    """A simulated decode instance: the live instance's ReplicaScheduler on the profile's GPUs, and its ledger."""

    def __init__(self, index: int, config: DisaggConfig, costs: Costs, kv: BlockTables | None = None):
        """kv: its pool (default: its own of costs.decode_kv_capacity tokens; ESP's group: a SpreadKV)."""
        self.index, self.cost = index, costs.decode
        kv = kv or KVCacheManager.for_tokens(costs.decode_kv_capacity, BLOCK_SIZE, enable_prefix_caching=False)
        # the live engine's defaults: its iteration budget a full step (every decode at the longest context)
        scheduler = SchedulerConfig(policy="fcfs", max_num_seqs=costs.max_num_seqs)
        self.scheduler = replica_scheduler(
            scheduler,
            costs.decode,
            kv,
            packer_config(scheduler, costs.decode, max_model_len=kv.capacity * kv.block_size),
            group=(index,),
            admission=ADMISSIONS[config.admission],
        )
        self.ledger = DecodeLedger(config.recv_backends)
        self.seconds: dict[tuple[str, int], float] = {}  # each offered transfer's time on the link
        self.arrived: set[tuple[str, int]] = set()  # sent transfers whose KV is in a receive buffer
        self.expected: dict[str, tuple[Request, int | None]] = {}  # dispatched here, not yet holding blocks: the
        # request and the decode length it reserves for (None: its true one, the oracle)
        self.stepping = False  # a decode step is running
        self.finished = self.preemptions = 0
        self.slots: tuple[int, ...] = ()  # its GPUs in the planner's pool (with flips)
        self.last_end = 0.0  # when its latest decode step ends


class DisaggSimulator:
    def __init__(
        self,
        planner: Planner | ESPScheduler | None,
        best_latency: Callable[[int], float],
        config: DisaggConfig = DisaggConfig(),
        predictor: LengthPredictor | None = None,
        costs: Costs | None = None,
    ):
        """planner: the pool's (an ESPScheduler for ESP's instances; None with TetriInfer's prefill instances);
        best_latency(tokens): a prompt's fastest isolated prefill, which its TTFT deadline scales with;
        predictor: decode-length ranges for power-of-two dispatch; costs: what the executor charges (None:
        config's GPU profile; ESP's needs its batch cost)."""
        if config.prefill not in ("pool", "tetriinfer", "esp"):
            raise ValueError(f"prefill must be pool, tetriinfer or esp, got {config.prefill!r}")
        if (config.prefill == "tetriinfer") == (planner is not None):
            raise ValueError(
                "a prefill pool needs a planner (ESP's instances: an ESPScheduler); TetriInfer's prefill "
                "instances take none"
            )
        if config.prefill == "esp" and (costs is None or costs.batch is None or config.flip is not None):
            raise ValueError("ESP's instances need a batch cost (Costs.batch) and take no flips")
        if config.prefill == "tetriinfer" and config.flip is not None and config.decode_tp != config.prefill_tp:
            raise ValueError(
                f"flipping TetriInfer instances prefill and decode on their own GPUs: decode_tp "
                f"({config.decode_tp}) must be prefill_tp ({config.prefill_tp})"
            )
        if config.dispatch not in ("freeness", "power_of_two"):
            raise ValueError(f"dispatch must be freeness or power_of_two, got {config.dispatch!r}")
        if config.admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {', '.join(ADMISSIONS)}, got {config.admission!r}")
        if (
            config.dispatch == "power_of_two" or config.admission in ("reserve_static", "reserve_dynamic")
        ) and predictor is None:
            raise ValueError(
                f"{config.dispatch} dispatch with {config.admission} admission needs a decode-length predictor"
            )
        self.planner, self.best_latency, self.config, self.predictor = planner, best_latency, config, predictor
        self.costs = costs or profile_costs(config)

    @property
    def cost(self) -> BatchCost:
        return self.costs.decode

    @property
    def prefill_cost(self) -> BatchCost | None:
        return self.costs.prefill

    def transfer_seconds(self, tokens: int, senders: int) -> float:
        return self.costs.transfer(tokens, senders)

    def run(self, workload: Workload, progress: bool = True) -> Results:
        return _Run(self, workload, progress).results()


class _Run:
    """One simulation: arrivals, KV landings, decode steps and (with a flip policy) role checks, in time
    order. GPU slots 0..P-1 start as prefill instances; with flips, the planner's pool also holds the decode
    instances' GPUs (decode_tp each, after the prefill ones), unavailable to it while they decode. With
    TetriInfer's prefill, slot i is prefill instance i, and free_at its latest chunk's end; with flips instance i
    is decode instance i too (the first prefill_instances start prefilling), as live."""

    def __init__(self, sim: DisaggSimulator, workload: Workload, progress: bool):
        cfg = self.cfg = sim.config
        self.sim, self.workload = sim, workload
        # the cluster's policy: arrivals, prefill work, decode dispatch, TetriInfer's flips and the GPU slots'
        # bookings (its arrays, updated in place); and the GPU slots each decode instance holds in the pool
        self._tetriinfer, self._esp = cfg.prefill == "tetriinfer", cfg.prefill == "esp"
        n = cfg.prefill_instances
        if self._esp:  # its instances decode: decode instance k is instance k
            context = sim.costs.decode_kv_capacity * (n if cfg.spread else 1)
            self.scheduler = ESPPolicy(
                sim.planner,
                range(n),
                cfg.dispatch,
                sim.predictor,
                cfg.seed,
                spread=cfg.spread,
                instance_context=sim.costs.decode_kv_capacity,
            )
            decoder_slots = [()] * n
        elif self._tetriinfer:  # with flips every instance prefills and decodes, one role at a time
            n = cfg.prefill_instances + (cfg.decode_instances if cfg.flip else 0)
            instances = [
                PrefillBatchScheduler(cfg.prefill_chunk, cfg.prefill_batch, cfg.prefill_order, (i,)) for i in range(n)
            ]
            decoders = n if cfg.flip else cfg.decode_instances
            self.scheduler = TetriInferPolicy(
                instances,
                range(n),
                decoders,
                cfg.dispatch,
                sim.predictor,
                cfg.seed,
                flip=cfg.flip,
                prefilling=cfg.prefill_instances if cfg.flip else None,
            )
            decoder_slots = [()] * decoders
        else:
            slots = cfg.prefill_instances + (cfg.decode_instances * cfg.decode_tp if cfg.flip else 0)
            pool_size = getattr(getattr(sim.planner, "pool", None), "size", None)  # (a planner may name none)
            if pool_size is not None and pool_size != slots:
                raise ValueError(
                    f"the planner's pool has {pool_size} instances; this cluster has {slots} GPU slots "
                    "for it (prefill instances, plus the decode instances' GPUs when flips are on)"
                )
            self.scheduler = CDSPPolicy(sim.planner, range(slots), cfg.dispatch, sim.predictor, cfg.seed)
            firsts = [cfg.prefill_instances + i * cfg.decode_tp for i in range(cfg.decode_instances)]
            decoder_slots = [tuple(range(f, f + cfg.decode_tp)) if cfg.flip else () for f in firsts]
        self.free_at, self.unavailable = self.scheduler.free_at, self.scheduler.unavailable
        self.decoders: list[SimulatedDecoder] = []
        self.retired: list[SimulatedDecoder] = []
        for slots_held in decoder_slots:
            self._new_decoder(slots_held)
        self.group = None  # ESP's multi-master group: its blocks come from the instances' pools
        if self._esp and cfg.spread and n > 1:
            self.group = SimulatedDecoder(n, cfg, sim.costs, SpreadKV([d.scheduler.kv for d in self.decoders]))
            self.decoders.append(self.group)
        self.context = context if self._esp else sim.costs.decode_kv_capacity  # the longest request served
        self.batches: dict[tuple[int, ...], float] = {}  # ESP: each batch in flight's instances and end
        self.decode_seconds = 0.0  # ESP: a decode step's time, as live measures it (a moving average)
        sim.decoders = self.decoders
        # the pool's flips: a prefill unit is decode_tp GPU slots of the pool, a decode unit a decode instance's
        # index (TetriInfer's flips are its policy's)
        self.flipper = FlipController(cfg.flip) if cfg.flip and not self._tetriinfer else None
        self.flips: list[tuple[float, str]] = []
        self.events: list[tuple[float, int, int, str, object]] = []  # (time, order, seq, kind, payload)
        self.seq = itertools.count()
        for i, (t, p, o) in enumerate(
            zip(workload.arrivals.tolist(), workload.prompt_lens.tolist(), workload.output_lens.tolist())
        ):
            self._push(t, 2, "arrive", Request(str(i), t, p, o))
        if cfg.flip and len(workload):
            self._push(float(workload.arrivals[0]), 3, "check", None)
        self.pending = len(workload)
        self.requests: list[Request] = []
        self.rejected: list[Request] = []
        self.prefills: list[tuple[tuple[str, ...], tuple[int, ...], float, float]] = []  # chunks as run
        self.decoders_of: dict[str, int] = {}  # each request's decode instance
        self._by_id: dict[str, Request] = {}  # the prompts not yet prefilled
        self._served: dict[str, Request] = {}  # every request admitted
        self._decoder: dict[str, SimulatedDecoder] = {}  # and the decode instance of each dispatched one
        self.bar = tqdm(total=len(workload), desc="simulate disaggregated", unit="req", disable=not progress)

    def _push(self, t: float, order: int, kind: str, payload: object) -> None:
        heapq.heappush(self.events, (t, order, next(self.seq), kind, payload))

    def _new_decoder(self, slots: tuple[int, ...]) -> SimulatedDecoder:
        dec = SimulatedDecoder(len(self.decoders) + len(self.retired), self.cfg, self.sim.costs)
        dec.slots = slots
        self.unavailable[list(slots)] = True
        self.decoders.append(dec)
        return dec

    def _done(self, n: int) -> None:
        self.pending -= n
        self.bar.update(n)

    def results(self) -> Results:
        started = time.perf_counter()
        while self.events:
            now, _, _, kind, payload = heapq.heappop(self.events)
            if kind == "arrive":
                self._arrive(now, payload)
            elif kind == "offer":
                dec, transfer = payload
                dec.ledger.offer(transfer)
                self._send(dec, now)
            elif kind == "arrived":  # a sent transfer's KV is in one of the instance's receive buffers
                dec, transfer = payload
                dec.arrived.add(transfer.key)
                self._pump(dec, now)
            elif kind == "prefill":
                self._prefill(now)
            elif kind == "prefilled":
                self._prefilled(now, *payload)
            elif kind == "done":
                dec, plan, outcome = payload
                dec.stepping = False
                done = dec.scheduler.apply(plan, outcome)
                for r in done:
                    dec.ledger.forget(r.id)
                    self.scheduler.finish(r.id, r.generated)  # a predictor that learns sees the length, as live
                dec.finished += len(done)
                self._done(len(done))
                self._pump(dec, now)
            elif self.pending:  # a flip check, while work remains
                if self._tetriinfer:
                    self._prefill(now)  # the policy's plan changes roles on its cadence
                else:
                    self._check(now)
                self._push(now + self.cfg.flip.check_every, 3, "check", None)
        self.bar.close()
        reqs = self.requests
        first = reqs[0].arrival if reqs else 0.0
        last = max((r.finished_at for r in reqs if r.finished_at is not None), default=first)
        # TetriInfer 5.1's resource usage time: every instance's wall time from the first arrival to its last
        # work, here per GPU (an instance idle from then on is recycled)
        prefill_tp = self.cfg.prefill_tp if self._tetriinfer else 1
        if self._esp:  # an instance's GPUs prefill and decode
            gpu_seconds = self.cfg.decode_tp * sum(
                max(f - first, d.last_end - first, 0.0) for f, d in zip(self.free_at.tolist(), self.decoders)
            )
        elif self._tetriinfer and self.cfg.flip:  # an instance's GPUs serve both its roles
            gpu_seconds = prefill_tp * sum(
                max(f - first, d.last_end - first, 0.0) for f, d in zip(self.free_at.tolist(), self.decoders)
            )
        else:
            gpu_seconds = prefill_tp * float(np.maximum(self.free_at - first, 0.0).sum()) + sum(
                self.cfg.decode_tp * max(d.last_end - first, 0.0) for d in self.decoders + self.retired
            )
        return Results(
            reqs,
            self.rejected,
            span=max(last - first, 1e-9),
            wall_seconds=time.perf_counter() - started,
            config=dataclasses.asdict(self.cfg)
            | {
                "workload": self.workload.name,
                "requests": len(self.workload),
                "flips": self.flips,
                "gpu_seconds": gpu_seconds,
            },
            prefills=self.prefills,
            decoders=self.decoders_of,
        )

    def _expect(self, dec: SimulatedDecoder, r: Request, chosen: Dispatch) -> None:
        """r was dispatched to dec (the policy promised its KV there): its admission reserves for the predicted
        decode (the true one without a predictor: an oracle)."""
        self.decoders_of[r.id] = dec.index
        self._decoder[r.id] = dec
        dec.expected[r.id] = r, (None if self.cfg.admission == "oracle" else chosen.predicted)

    def _offer(self, dec: SimulatedDecoder, transfer: Transfer, senders: int) -> None:
        """A chunk's KV, sent by `senders` GPUs at once, is offered to dec when its chunk ends."""
        dec.seconds[transfer.key] = self.sim.transfer_seconds(transfer.tokens, senders)
        self._push(transfer.ready, 1, "offer", (dec, transfer))

    def _send(self, dec: SimulatedDecoder, now: float) -> None:
        for t in dec.ledger.send(now):
            self._push(now + dec.seconds.pop(t.key), 1, "arrived", (dec, t))

    def _pump(self, dec: SimulatedDecoder, now: float) -> None:
        """As the live instance does: land the arrived transfers, in order, once their request holds blocks (a
        request the admission policy or the memory holds back keeps its buffer); a request with all its KV in
        decodes; free buffers take the next transfers; a step starts if none runs."""
        reserve = lambda rid: dec.scheduler.reserve(*dec.expected[rid]) is not None  # noqa: E731
        for t in dec.ledger.landing(lambda t: t.key in dec.arrived, reserve):  # not arrived: still on the link
            dec.arrived.discard(t.key)
            dec.ledger.land(t, now)
            if dec.ledger.ready(t.request_id):
                dec.ledger.admit(t.request_id)
                dec.scheduler.add_prefilled(dec.expected.pop(t.request_id)[0])
        self._send(dec, now)
        self._launch(dec, now)

    def _arrive(self, t: float, r: Request) -> None:
        cfg, sim = self.cfg, self.sim
        if self._tetriinfer or self._esp:
            self._queue(t, r)
            return
        active = {d.index: d for d in self._open()}
        fits = lambda chosen: r.prompt_len + r.output_len <= active[chosen.decoder].scheduler.kv_capacity  # noqa: E731
        arrival = self.scheduler.arrive(
            PromptInfo(r.prompt_len),
            t,
            active,
            None if sim.predictor is not None else r.output_len,
            admits=fits,
            request_id=r.id,
        )
        if arrival is None:
            self.scheduler.finish(r.id, 0)
            self.rejected.append(r)
            self._done(1)
            return
        r.ttft_deadline, r.tpot_slo = t + cfg.slo.ttft(sim.best_latency(r.prompt_len)), cfg.slo.tpot_slo
        self.requests.append(r)
        self._by_id[r.id] = r
        self._expect(active[arrival.dispatch.decoder], r, arrival.dispatch)
        self.scheduler.add(r.id, arrival, t)
        self._push(t, 4, "prefill", None)  # the chunks that start now, as live (after every arrival at t)

    # -- TetriInfer's prefill instances (3.3), ESP's elastic ones ---------------------------------------------
    def _queue(self, t: float, r: Request) -> None:
        """r waits for its policy's plans (a request longer than a decode instance serves is refused)."""
        if r.prompt_len + r.output_len > self.context:
            self.rejected.append(r)
            self._done(1)
            return
        r.ttft_deadline, r.tpot_slo = t + self.cfg.slo.ttft(self.sim.best_latency(r.prompt_len)), self.cfg.slo.tpot_slo
        self.requests.append(r)
        self._by_id[r.id] = self._served[r.id] = r
        if self._esp:
            self.scheduler.arrive(r, PromptInfo(r.prompt_len))
        else:
            self.scheduler.arrive(
                r, PromptInfo(r.prompt_len), t, None if self.sim.predictor is not None else r.output_len
            )
        self._push(t, 4, "prefill", None)  # after every arrival at t: simultaneous ones share a scheduling batch

    def _prefill(self, now: float) -> None:
        """The policy's plan now: each chunk starts on its group (a CDSP chunk lasts as its planner priced it, a
        TetriInfer chunk as the prefill cost says), each prompt a TetriInfer chunk ends is dispatched."""
        if self._esp:
            self._prefill_esp(now)
            return
        plan = self.scheduler.plan(now, {d.index: d for d in self.decoders})
        self.flips += [(now, r.flip.value) for r in plan.roles if r.done]
        for rid, chosen in plan.dispatch.items():
            self._expect(self.decoders[chosen.decoder], self._by_id[rid], chosen)
        for group, items in plan.chunks().items():
            if self._tetriinfer:
                end = now + chunk_time(self.sim.prefill_cost, items, self.cfg.prefill_chunk)
                self.free_at[group[0]] = end
            else:
                start, booked_end = self.scheduler.booked(items[0])
                end = now + (booked_end - start)
            self.prefills.append((tuple(i.request_id for i in items), group, now, end))
            tokens = {i.request_id: (PLACEHOLDER_TOKEN,) for i in items if i.request_id in plan.dispatch}
            self._push(end, 0, "prefilled", (group, items, Outcome(end, (), tokens)))

    def _prefill_esp(self, now: float) -> None:
        """ESP's rounds until one starts nothing, as live: each batch on its group once the group's instances (and
        the multi-master group) end their decode steps, each prompt dispatched where its KV stays."""
        decoders = {d.index: d for d in self.decoders}
        n = self.cfg.prefill_instances
        while True:
            pool = elastic_pool(
                self.decoders[:n], self.group, lambda rid: self._served[rid].generated, range(n), self.decode_seconds
            )
            plan = self.scheduler.plan(now, pool, decoders)
            if not plan.items:
                return
            for group, items in plan.chunks().items():
                stepping = [decoders[k] for k in group] + ([self.group] if self.group is not None else [])
                start = max([now] + [d.last_end for d in stepping if d.stepping])
                end = start + self.sim.costs.batch([i.tokens for i in items], len(group))
                for i in items:
                    chosen = plan.dispatch[i.request_id]
                    if decoders[chosen.decoder] is self.group:
                        self.group.scheduler.kv.place(i.request_id, dict(chosen.shards))
                    self._expect(decoders[chosen.decoder], self._by_id[i.request_id], chosen)
                self.batches[group] = end
                self.free_at[list(group)] = end
                self.prefills.append((tuple(i.request_id for i in items), group, start, end))
                tokens = {i.request_id: (PLACEHOLDER_TOKEN,) for i in items}
                self._push(end, 0, "prefilled", (group, items, Outcome(end, (), tokens)))

    def _paused(self, dec: SimulatedDecoder) -> bool:
        """ESP: an instance decodes while no batch holds it; the multi-master group while none runs."""
        if dec is self.group:
            return bool(self.batches)
        return any(dec.index in group for group in self.batches)

    def _prefilled(self, now: float, group: tuple[int, ...], items: tuple[WorkItem, ...], outcome: Outcome) -> None:
        """A chunk ended: under CDSP its KV goes to the decode instance now (chunk-wise), under TetriInfer and ESP
        each prompt it finished sends its whole KV; a prompt's first token comes with its last chunk."""
        done = self.scheduler.apply(group, items, outcome)
        self.batches.pop(group, None)
        for item in items if not (self._tetriinfer or self._esp) else ():
            r, last = self._by_id[item.request_id], item.request_id in done
            if r.output_len > 1:  # else its first token ends it: nothing goes to its decode instance
                self._offer(self._decoder[r.id], Transfer(r.id, item.chunk_index, last, item.tokens, now), len(group))
        for rid in done:
            r, dec = self._by_id.pop(rid), self._decoder.pop(rid)
            if not self._tetriinfer:  # a TetriInfer prompt's token came through its instance's scheduler
                r.add_tokens(1, now)
            if r.finished:  # by its first token
                dec.ledger.forget(r.id)
                dec.expected.pop(r.id)
                if dec is self.group:
                    self.group.scheduler.kv.unplace(r.id)
                self.scheduler.finish(r.id, r.generated)
                self._done(1)
            elif self._tetriinfer or self._esp:  # the whole prompt
                self._offer(
                    dec, Transfer(r.id, 0, True, r.prompt_len, now), len(group) if self._esp else self.cfg.prefill_tp
                )
        self._prefill(now)
        if self._esp:  # the batch's instances decode again
            for dec in self.decoders:
                self._launch(dec, now)

    def _launch(self, dec: SimulatedDecoder, now: float) -> None:
        """dec's next step, unless one runs (or ESP pauses it): its decodes, and the recompute of a preempted
        request."""
        if dec.stepping or self._paused(dec):
            return
        plan = dec.scheduler.schedule(now)
        for _ in range(MAX_EMPTY_PLANS):  # a Plan that only preempted or granted blocks: plan again
            if plan is None or plan.items:
                break
            dec.preemptions += len(plan.preempted)
            plan = dec.scheduler.schedule(now)
        if plan is None or not plan.items:
            return
        dec.preemptions += len(plan.preempted)
        seconds = step_seconds(dec.cost, plan)
        self.decode_seconds = averaged_step(self.decode_seconds, seconds)
        end = now + seconds
        dec.stepping, dec.last_end = True, end
        self._push(end, 0, "done", (dec, plan, Outcome(end, (), step_tokens(dec.scheduler, plan))))

    # -- flips (TetriInfer 3.5) ------------------------------------------------------------------------------
    def _open(self) -> list[SimulatedDecoder]:
        """The decode instances new requests may go to: all but one draining to prefill."""
        leaving = self.flipper.leaving if self.flipper is not None else None
        return [d for d in self.decoders if d.index != leaving]

    def _check(self, now: float) -> None:
        """Finish a drained flip (prefill slots whose booked chunks are done become a decode instance; a decode
        instance with nothing left gives its GPUs to the pool), sample loads, and start the next flip."""
        decoders = {d.index: d for d in self.decoders}

        for kind, unit in self.flipper.finish(
            lambda slots: self.free_at[list(slots)].max() <= now, lambda i: not decoders[i].ledger.heavy
        ):  # nothing dispatched left
            if kind is Flip.TO_DECODE:
                self._new_decoder(unit)
            else:
                dec = decoders[unit]
                self.decoders.remove(dec)
                self.retired.append(dec)
                self.unavailable[list(dec.slots)] = False
                self.free_at[list(dec.slots)] = now
            self.flips.append((now, kind.value))
        tp = self.cfg.decode_tp
        slices = [tuple(range(a, a + tp)) for a in range(0, len(self.free_at), tp)]
        prefill = {
            sl: float(np.mean(self.free_at[list(sl)] > now)) for sl in slices if not self.unavailable[list(sl)].any()
        }
        started = self.flipper.start(now, prefill, {d.index: decode_ledger.busy(d) for d in self._open()})
        if started is not None and started[0] is Flip.TO_DECODE:
            self.unavailable[list(started[1])] = True  # no new chunks; booked ones finish
        # to_prefill: _open leaves it out (no new requests); its running ones finish
