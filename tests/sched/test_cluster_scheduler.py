"""The cluster's policies (sched/cluster.py), each one object for the live cluster and the simulators (CDSP's
chunk plans, TetriInfer's prefill instances, LoongServe's elastic batches); the chunk order a live executor
follows; bookings moved by chunks' measured ends; decode dispatch, which they share."""

from __future__ import annotations

import heapq
import itertools
from types import SimpleNamespace

import numpy as np
import pytest

from jaxserve.sched import cost_models as cm
from jaxserve.sched.batch_cost import EngineStepCost
from jaxserve.sched.cdsp import CDSPPlanner, Chunk, ChunkPlan, Pool
from jaxserve.sched.cluster import CDSPPolicy, ClusterPolicy, ESPPolicy, Growth, GrowthKind, TetriInferPolicy
from jaxserve.sched.cost_models import LoongServePrefill
from jaxserve.sched.decode_dispatch import DecodeLoad, ObservedLengths, PromptInfo
from jaxserve.sched.decode_ledger import DecodeLedger
from jaxserve.sched.flip import Flip, FlipPolicy
from jaxserve.sched.esp import ElasticInstance, ElasticPool, ESPScheduler, aligned_groups
from jaxserve.sched.plan import MoveKind, Outcome, Phase
from jaxserve.sched.prefill_batches import PrefillBatchScheduler, chunk_time
from jaxserve.sched.profiles import tetris_table1_samples
from jaxserve.sched.request import Request
from jaxserve.sched.step_shapes import StepShapes
from jaxserve.sim.disagg import Costs, DisaggConfig, DisaggSimulator
from jaxserve.sim.prefill_pool import run_pool
from jaxserve.sim.workload import Workload, long_context

MODEL = cm.TetrisPrefill.fit(tetris_table1_samples())
POOL = Pool(nodes=2, per_node=4)
DEVICE_IDS = [10 + 2 * i for i in range(POOL.size)]  # the live pool's device ids, not the planner's slots


def fake_executor(scheduler: CDSPPolicy, arrivals, prompt_lens, late: float = 0.0) -> dict[str, ChunkPlan]:
    """A live executor without devices: arrivals and chunk ends in time order; each chunk starts when the
    scheduler's Plan names it and ends `late` seconds after its booked end. Returns every request's plan."""
    events = [(float(t), 1, str(k), n) for k, (t, n) in enumerate(zip(arrivals, prompt_lens))]
    heapq.heapify(events)
    plans, seq = {}, 0
    while events:
        now, kind, rid, payload = heapq.heappop(events)
        if kind == 1:
            arrival = scheduler.arrive(PromptInfo(payload), now)
            scheduler.add(rid, arrival, now)
            plans[rid] = arrival.plan
        else:
            scheduler.apply(payload.group, (payload,), Outcome(now, (), {}))
        for item in scheduler.plan(now).items:
            _, end = scheduler.booked(item)
            seq += 1
            heapq.heappush(events, (max(end + late, now), 0, f"{item.request_id}/{seq}", item))
    return plans


def test_the_live_executor_and_the_simulator_get_the_same_plans():
    """The same arrivals through the simulator (run_pool) and through a fake live executor whose chunks end as
    booked: the same chunk plans, request by request, and the same bookings at the end."""
    w = long_context("medium", 60, 2.0, seed=3)
    sim = run_pool(CDSPPlanner(MODEL, POOL, 0.2), w, POOL.size, MODEL.fastest)
    live = CDSPPolicy(CDSPPlanner(MODEL, POOL, 0.2), DEVICE_IDS)
    plans = fake_executor(live, w.arrivals, w.prompt_lens)
    assert [plans[str(k)] for k in range(len(w))] == sim.plans
    assert max(len(p.chunks) for p in sim.plans) > 1  # chunked prompts are among them
    ends = w.arrivals[:, None] + np.array([p.commit(np.zeros(POOL.size)) for p in sim.plans])
    assert np.allclose(live.free_at, ends.max(axis=0))


def test_chunks_start_in_booked_order_on_free_disjoint_groups_with_their_rebalance():
    """Two prompts at once, devices booked so that the long one's chunks grow from 2 to 4 to 8 devices: every
    Plan's groups are disjoint and free of running chunks; every chunk after a prompt's first comes with its
    history's move (spread evenly over the chunk's group); items name device ids."""
    s = CDSPPolicy(CDSPPlanner(MODEL, POOL, 0.05, min_chunk=1024), DEVICE_IDS)
    s.free_at[:] = [0, 0, 2, 2, 3, 3, 3, 3]
    for rid, n in (("a", 120_000), ("b", 30_000)):
        s.add(rid, s.arrive(PromptInfo(n), 0.0), 0.0)
    running, held, started = set(), {}, []
    for _ in range(100):
        plan = s.plan(0.0)
        groups = [set(i.group) for i in plan.items]
        assert all(not (g & h) for k, g in enumerate(groups) for h in groups[k + 1 :])
        for item in plan.items:
            assert not set(item.group) & {d for r in running for d in r.group}
            assert set(item.group) <= set(DEVICE_IDS) and item.phase is Phase.PREFILL
            moved = [m for m in plan.moves if m.request_id == item.request_id]
            prev = held.get(item.request_id)
            assert (
                moved == []
                if prev is None
                else [(m.src, m.dst, m.tokens) for m in moved] == [(prev, item.group, item.history)]
            )
            held[item.request_id] = item.group
        running |= set(plan.items)
        started += plan.items
        if not running:
            break
        first = min(running, key=lambda i: s.booked(i)[1])  # the chunk due first ends
        running.remove(first)
        s.apply(first.group, (first,), Outcome(s.booked(first)[1], (), {}))
    assert not running and {i.request_id for i in started} == {"a", "b"}
    for rid, n in (("a", 120_000), ("b", 30_000)):
        mine = [i for i in started if i.request_id == rid]
        assert [i.chunk_index for i in mine] == list(range(len(mine)))
        assert sum(i.tokens for i in mine) == n and mine[0].history == 0
    assert [len(i.group) for i in started if i.request_id == "a"] == [2, 4, 8]


class FixedPlans:
    """A planner that hands out the given chunk plans in turn."""

    def __init__(self, *plans: ChunkPlan):
        self.plans = list(plans)

    def on_arrival(self, t: float) -> None:
        del t

    def plan(self, tokens: int, queues) -> ChunkPlan:
        del tokens, queues
        return self.plans.pop(0)


def test_each_device_runs_its_chunks_in_booked_order():
    """A's second chunk is booked on devices 2-3 at 5 s, once its first (devices 0-1) is done; B's only chunk is
    booked there after it. At 0 s devices 2-3 are idle, but B does not start ahead of A's chunk (which it would
    delay, and the bookings `apply` moves assume each device's order): it starts when A's ends."""
    a = ChunkPlan((Chunk(1000, 0, (0, 1), 0.0, 5.0), Chunk(500, 1000, (2, 3), 5.0, 8.0)))
    b = ChunkPlan((Chunk(800, 0, (2, 3), 8.0, 14.0),))
    s = CDSPPolicy(FixedPlans(a, b), range(4))
    for rid in ("a", "b"):
        s.add(rid, s.arrive(PromptInfo(1), 0.0), 0.0)
    (first,) = s.plan(0.0).items
    assert (first.request_id, first.group) == ("a", (0, 1))
    assert s.apply(first.group, (first,), Outcome(5.0, (), {})) == []
    (second,) = s.plan(5.0).items
    assert (second.request_id, second.group) == ("a", (2, 3))
    assert not s.plan(5.0).items
    assert s.apply(second.group, (second,), Outcome(8.0, (), {})) == ["a"]
    assert [i.request_id for i in s.plan(8.0).items] == ["b"]


def test_a_late_chunk_moves_its_devices_bookings_and_the_next_arrival_sees_it():
    s = CDSPPolicy(CDSPPlanner(MODEL, POOL, 0.2), DEVICE_IDS)
    s.add("a", s.arrive(PromptInfo(4096), 0.0), 0.0)
    (item,) = s.plan(0.0).items
    _, end = s.booked(item)
    slots = [DEVICE_IDS.index(d) for d in item.group]
    assert np.allclose(s.free_at[slots], end)
    assert s.apply(item.group, (item,), Outcome(end + 0.5, (), {})) == ["a"]  # its only chunk, half a second late
    assert np.allclose(s.free_at[slots], end + 0.5)
    later = s.arrive(PromptInfo(4096), end).plan
    assert not set(later.chunks[0].group) & set(slots) or later.chunks[0].start >= 0.5 - 1e-9


def test_a_lateness_moves_a_devices_bookings_once():
    """A's chunk on devices 0-1 ends 2 s late, so B's chunk booked after it there starts 2 s late and, taking
    its booked time, ends 2 s late too: that is the same lateness, not another. Once both are done the devices
    are free at B's end, not 2 s after it (the next arrivals would see phantom queues)."""
    a = ChunkPlan((Chunk(1000, 0, (0, 1), 0.0, 5.0),))
    b = ChunkPlan((Chunk(800, 0, (0, 1), 5.0, 8.0),))
    s = CDSPPolicy(FixedPlans(a, b), range(2))
    for rid in ("a", "b"):
        s.add(rid, s.arrive(PromptInfo(1), 0.0), 0.0)
    (first,) = s.plan(0.0).items
    s.apply(first.group, (first,), Outcome(7.0, (), {}))
    assert np.allclose(s.free_at, 10.0)  # B's booking moved by A's 2 s
    (second,) = s.plan(7.0).items
    s.apply(second.group, (second,), Outcome(10.0, (), {}))
    assert np.allclose(s.free_at, 10.0)


def sides(*loads: tuple[int, int]) -> dict[int, SimpleNamespace]:
    """Decode instances as a policy reads them (a ledger and a scheduler's KV and batch), each with
    (free KV slots, running requests)."""
    return {
        i: SimpleNamespace(
            ledger=DecodeLedger(4),
            scheduler=SimpleNamespace(
                kv=SimpleNamespace(num_free=free, block_size=1),
                running=[None] * running,
                committed=lambda: 0,
                kv_capacity=max(free, 1),
                max_num_seqs=max(running, 8),
            ),
        )
        for i, (free, running) in enumerate(loads)
    }


LOADS = ((1000, 4), (4000, 2), (100, 0))


def test_dispatch_by_freeness_and_power_of_two_from_the_predicted_length():
    s = ClusterPolicy((), predictor=ObservedLengths(prior=600, granularity=64))
    prompt = PromptInfo(100)
    decoders = sides(*LOADS)
    chosen = s.dispatch(prompt, decoders, "x")
    assert chosen.decoder == 1 and chosen.predicted == 640 and chosen.heavy  # 2,000 free slots a running request
    assert decoders[1].ledger.load(4000, 2) == DecodeLoad(4000 - 740, 3, heavy=1)  # promised there
    short = s.dispatch(prompt, sides(*LOADS), "y", limit=16)
    assert short.predicted == 16 and not short.heavy
    s.finish("z", 10)  # a request the policy never dispatched teaches nothing
    assert s.dispatch(prompt, sides(*LOADS), "w").predicted == 640
    s.finish("x", 10)  # the predictor learns from what was served
    assert s.dispatch(prompt, sides(*LOADS), "v").predicted == 64
    two = ClusterPolicy((), "power_of_two", seed=1)
    assert two.dispatch(prompt, sides(*LOADS), "a", limit=3000).decoder == 1  # only one has room for 3,100 tokens
    assert two.dispatch(prompt, {7: sides(*LOADS)[2]}, "b", limit=1).decoder == 7  # named by the cluster's index
    with pytest.raises(ValueError, match="decode length"):
        two.dispatch(prompt, sides(*LOADS), "c")  # no predictor and no limit
    with pytest.raises(ValueError, match="dispatch must be"):
        ClusterPolicy((), "random")


def test_an_admission_check_refuses_before_anything_is_booked_or_promised():
    s = CDSPPolicy(CDSPPlanner(MODEL, POOL, 0.2), DEVICE_IDS, predictor=ObservedLengths())
    decoders = sides((10, 0))
    assert s.arrive(PromptInfo(4096), 0.0, decoders, admits=lambda d: False, request_id="a") is None
    assert not s.free_at.any() and not decoders[0].ledger.heavy
    assert (
        s.arrive(PromptInfo(4096), 0.0, decoders, admits=lambda d: d.decoder == 0, request_id="b").dispatch.decoder == 0
    )
    assert s.free_at.any() and list(decoders[0].ledger.heavy) == ["b"]


def tetriinfer_executor(scheduler: TetriInferPolicy, workload: Workload, seconds, decoders) -> list[tuple]:
    """TetriInfer's prefill instances, live without devices: an arrival joins the queue the policy picks; at each
    arrival and chunk end the policy's plan starts chunks on idle instances, each taking seconds(items).
    Returns every chunk as (request ids, (instance,), start, end), the simulator's Results.prefills."""
    events, seq, chunks = [], itertools.count(), []
    for k, (t, n) in enumerate(zip(workload.arrivals.tolist(), workload.prompt_lens.tolist())):
        heapq.heappush(events, (t, 1, next(seq), "arrive", Request(str(k), t, n, 2)))
    while events:
        now, _, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            scheduler.arrive(payload, PromptInfo(payload.prompt_len), now, 2)
            heapq.heappush(events, (now, 2, next(seq), "plan", None))
            continue
        if kind == "end":
            group, items, ending = payload
            scheduler.apply(group, items, Outcome(now, (), {rid: (0,) for rid in ending}))
        plan = scheduler.plan(now, decoders)
        for group, items in plan.chunks().items():
            end = now + seconds(items)
            chunks.append((tuple(i.request_id for i in items), group, now, end))
            heapq.heappush(events, (end, 0, next(seq), "end", (group, items, plan.dispatch.keys())))
    return chunks


def test_tetriinfer_instances_get_the_same_chunks_live_and_simulated():
    """The same arrivals through the disaggregated simulator and through a fake live executor of TetriInfer's
    prefill instances, both executing one TetriInferPolicy's plans: the same chunks, on the same instances, at
    the same times; prompts merged into chunks and spread over the instances among them."""
    rng = np.random.default_rng(5)
    n = 40
    w = Workload(np.cumsum(rng.exponential(0.02, n)), rng.integers(50, 3000, n), np.full(n, 2), "mixed")
    cfg = DisaggConfig(
        prefill="tetriinfer",
        prefill_instances=3,
        decode_instances=2,
        decode_tp=1,
        prefill_chunk=512,
        prefill_batch=4,
        prefill_order="sjf",
    )
    sim = DisaggSimulator(None, MODEL.fastest, cfg)
    simulated = sim.run(w, progress=False).prefills

    def instances() -> list[PrefillBatchScheduler]:
        return [PrefillBatchScheduler(512, 4, "sjf", (i,)) for i in range(3)]

    live = tetriinfer_executor(
        TetriInferPolicy(instances(), range(3), 2),
        w,
        lambda items: chunk_time(sim.prefill_cost, items, 512),
        sides((10**6, 0), (10**6, 0)),
    )
    assert live == simulated
    assert {c[1] for c in live} == {(0,), (1,), (2,)} and max(len(c[0]) for c in live) > 1
    s = TetriInferPolicy(instances(), range(3), 1)
    s.arrive(Request("a", 0.0, 900, 2), PromptInfo(900), 0.0)
    s.prefilling = {0, 2}  # instance 1 drains towards decoding
    assert s.arrive(Request("b", 0.0, 100, 2), PromptInfo(100), 0.0) == 2  # the prefilling one with less queued
    s.finish("a", 0)  # aborted: out of its queue
    assert s.instances[0].queued_tokens() == 0 and s.instances[2].queued_tokens() == 100


def test_a_tetriinfer_chunk_the_executor_could_not_start_is_planned_again():
    """An executor that fails to start a plan's chunks cancels them: their instances are free again and the next
    plan holds the same pieces."""
    s = TetriInferPolicy([PrefillBatchScheduler(512, 4, "sjf", (i,)) for i in range(2)], range(2), 1)
    for rid, n in (("a", 700), ("b", 300)):
        s.arrive(Request(rid, 0.0, n, 2), PromptInfo(n), 0.0, 2)
    first = s.plan(0.0, sides((10**6, 0)))
    assert first.dispatch.keys() == {"b"}
    assert s.plan(0.0, sides((10**6, 0))).items == ()  # both instances busy
    for group, items in first.chunks().items():
        s.cancel(group, items)
    assert s.plan(0.0, sides((10**6, 0))).items == first.items


def test_tetriinfer_flips_an_idle_prefill_instance_once_the_decode_side_is_busy():
    """Flips in the policy's plans: a started flip takes the instance out of its role at once (no new prompts),
    and the flip is done, the instance decoding, once its queue has drained; one flip at a time."""
    flip = FlipPolicy(window=1.0, check_every=0.5)
    s = TetriInferPolicy(
        [PrefillBatchScheduler(512, 4, "sjf", (i,)) for i in range(3)],
        range(3),
        3,
        predictor=ObservedLengths(),
        flip=flip,
        prefilling=2,
    )
    decoders = sides((10**6, 0), (10**6, 0), (10, 8))  # the one decode instance is full
    decoders[2].scheduler.committed = lambda: 10
    s.arrive(Request("a", 0.0, 600, 2), PromptInfo(600), 0.0, 2)  # instance 0 busy, instance 1 idle
    roles = []
    for now in np.arange(0.0, 3.0, 0.5):
        plan = s.plan(float(now), decoders)
        roles += [(r.flip, r.unit, r.done) for r in plan.roles]
        for group, items in plan.chunks().items():
            s.apply(
                group,
                items,
                Outcome(float(now), (), {i.request_id: (0,) for i in items if i.request_id in plan.dispatch}),
            )
    assert roles == [(Flip.TO_DECODE, 1, False), (Flip.TO_DECODE, 1, True)]
    assert s.prefilling == {0} and s.decoding == {1, 2}


def elastic_executor(scheduler: ESPPolicy, workload: Workload, kv_tokens: int, seconds) -> list[tuple]:
    """LoongServe's elastic instances, live without devices, for one-token requests (no decode): arrivals wait;
    at every event the policy's plans batch the waiting prompts onto the instances no batch holds, each batch
    taking seconds(prompt lengths, instances), its KV freed when it ends. Returns every batch as the simulator's
    Results.prefills."""
    instances = [ElasticInstance(i, kv_tokens) for i in range(len(scheduler.pool_ids))]
    arrivals = [
        Request(str(k), t, n, 1)
        for k, (t, n) in enumerate(zip(workload.arrivals.tolist(), workload.prompt_lens.tolist()))
    ]
    running, batches = [], []
    while arrivals or running:
        now = min([r[0] for r in running] + [r.arrival for r in arrivals[:1]])
        while arrivals and arrivals[0].arrival <= now:
            r = arrivals.pop(0)
            scheduler.arrive(r, PromptInfo(r.prompt_len))
        for end, group, items, kept in [r for r in running if r[0] <= now]:
            running.remove((end, group, items, kept))
            assert scheduler.apply(group, items, Outcome(end, (), {})) == [i.request_id for i in items]
            for k, tokens in (t for i in items for t in kept[i.request_id].items()):
                instances[k].kv_used -= tokens
        while True:
            pool = ElasticPool(instances=instances, available=range(len(instances)), generated=(), step_time=0.0)
            plan = scheduler.plan(now, pool)
            if not plan.items:
                break
            for group, items in plan.chunks().items():
                end = now + seconds([i.tokens for i in items], len(group))
                running.append((end, group, items, {i: plan.dispatch[i].shards for i in plan.dispatch}))
                batches.append((tuple(i.request_id for i in items), group, now, end))
    return batches


def test_elastic_instances_get_the_same_batches_live_and_simulated():
    """The same arrivals through the simulator's elastic instances (sim/disagg.py, as the live cluster runs them:
    each prompt's KV gathered on one instance) and through a fake live executor, both asking an ESPPolicy: the same
    prefill batches on the same instance groups at the same times; some of them scaled up."""
    model = LoongServePrefill({(sp, 1): np.array([0.01 * sp, 2e-4 / sp, 1e-9 / sp]) for sp in (1, 2, 4)})
    step = EngineStepCost(
        StepShapes((16, 512), (4,), 32, 4, (1, 2, 4)),
        256,
        [[0.05], [0.4]],
        [0.02, 0.025, 0.03],
        tile_fixed=1e-3,
        tile_block=5e-3,
        decode_fixed=1e-4,
        decode_block=2e-3,
        decode_pad_block=1e-3,
    )
    rng = np.random.default_rng(2)
    n = 30
    w = Workload(np.cumsum(rng.exponential(0.3, n)), rng.integers(100, 8000, n), np.ones(n, int), "mixed")
    seconds = lambda lengths, sp: model.predict(sp, 1, lengths)  # noqa: E731
    elastic = lambda: ESPScheduler(
        model,
        1,
        model.predict(1, 1, [8192]),
        None,
        0.0,  # noqa: E731
        groups=aligned_groups(4),
    )
    costs = Costs(
        decode=step, prefill=None, transfer=lambda tokens, senders: 0.0, decode_kv_capacity=100_000, batch=seconds
    )
    sim = DisaggSimulator(
        elastic(),
        lambda tokens: seconds([tokens], 1),
        DisaggConfig(prefill="esp", prefill_instances=4, decode_tp=1, admission="greedy"),
        costs=costs,
    )
    simulated = sim.run(w, progress=False).prefills
    live = elastic_executor(ESPPolicy(elastic(), range(4)), w, 100_000, seconds)
    assert live == simulated
    assert max(len(b[1]) for b in live) > 1  # scale-ups among them
    with pytest.raises(ValueError, match="needs its prefill instances"):
        TetriInferPolicy([], range(4), 1)


def test_esp_policy_moves_decode_kv_off_a_prefills_instances_and_grows_full_decodes():
    """Before a prefill takes instance 0: a's share there goes to the free instance with the most room; b's
    share finds none (the other free instance holds b already, or is too small), so b pauses. A decode whose last
    instance is full grows onto the emptiest other instance, or without scale-up migrates whole where its KV and
    predicted rest fit, or is preempted."""
    model = LoongServePrefill({(sp, 1): np.array([0.01 * sp, 2e-4 / sp, 1e-9 / sp]) for sp in (1, 2, 4)})
    policy = lambda scale_up: ESPPolicy(
        ESPScheduler(model, 1, 1.0, None, 0.0, output_estimate=16),  # noqa: E731
        range(3),
        scale_up=scale_up,
    )
    free = [ElasticInstance(1, 1000, 900), ElasticInstance(2, 1000, 100)]
    moves, paused = policy(True).evacuate({0}, free, {"a": {0: 300}, "b": {2: 5, 0: 800}, "c": {1: 50}})
    assert [(m.request_id, m.src, m.dst, m.tokens, m.kind) for m in moves] == [("a", (0,), (2,), 300, MoveKind.MIGRATE)]
    assert paused == {"b"}

    instances = [ElasticInstance(0, 100, 100), ElasticInstance(1, 200, 40), ElasticInstance(2, 200, 150)]
    assert policy(True).grow({1: 40}, 3, instances) == Growth(kind=GrowthKind.TAIL, instance=1)
    assert policy(True).grow({0: 100}, 3, instances) == Growth(kind=GrowthKind.SCALE_UP, instance=1)
    # without scale-up: 100 tokens and 16 - 3 more fit instance 1 (160 free), not instance 2 (50)
    assert policy(False).grow({0: 100}, 3, instances) == Growth(kind=GrowthKind.MIGRATE, instance=1)
    full = [ElasticInstance(k, 100, 100) for k in range(3)]
    assert policy(True).grow({0: 100}, 3, full) == Growth(kind=GrowthKind.PREEMPT, instance=None)
