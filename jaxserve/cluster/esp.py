"""LoongServe's elastic sequence parallelism, live (LoongServe Sections 4-5): every instance of the pool both
prefills and decodes; there are no separate decode instances.

Every decision is the cluster policy's (sched/cluster.py's ESPPolicy, which sim/disagg.py executes too):
this executor runs its ClusterPlans.
- Arrival: a prompt waits, in arrival order (`arrive`).
- Prefill (each step, rounds until one starts nothing): the plan's batches, admitted, allocated elastic instances
  and batched by the ESP scheduler (sched/esp.py) over the instance sets this cluster has programs for (aligned
  power-of-two groups). A batch's prompts run one after another on its group, each as one chunk with ring
  attention over the group's devices: a scale-up when the group has more than one instance.
- Scale-down: each prompt's dispatch says where its KV stays. Kept on one instance whose engine's context holds
  the request's, it decodes there, on the instance's own engine (its share there is copied on its own device;
  the others' shares move to it, one transfer through its receive buffers). Any other decodes multi-master: on
  the group engine over every instance (cluster/multi_master.py), its KV landed in the kept shares, in the
  instances' own pools (sched/spread_kv.py). Its first token is drawn with its decode engine's seed.
- Decode: every instance runs the Plan-executing engine over the requests it holds; the group engine runs the
  spread ones, the query moving to the KV. A spread request whose last instance fills grows onto the emptiest
  other instance (ESP's scale-up for decode; no KV moves). An instance in a prefill pauses its decodes until the
  batch ends (the group's, while any batch runs): the wait admission and allocation weigh (no KV is evacuated).
  A full instance preempts (recompute) as the single-instance engine does.
Events: scale_ups (a prefill on several instances), scale_downs (a prompt's KV kept on fewer instances than
prefilled it), multi_master (requests decoding over the group) and decode_scale_ups (a spread decode grown onto
another instance).
"""

from __future__ import annotations

import dataclasses

from jaxserve.cluster.decode import LiveDecoder
from jaxserve.cluster.engine import WAIT, ChunkRecord, ClusterEngine, refuse_resumed
from jaxserve.engine.engine import RequestOutput
from jaxserve.engine.sp_prefill import ChunkRun
from jaxserve.sampling_params import SamplingParams
from jaxserve.sched import esp as elastic
from jaxserve.sched.cluster import elastic_pool
from jaxserve.sched.decode_ledger import Transfer
from jaxserve.sched.plan import ClusterPlan, Outcome, WorkItem
from jaxserve.sched.request import Request


@dataclasses.dataclass(frozen=True)
class _Prompt:
    ids: list[int]
    params: SamplingParams


@dataclasses.dataclass
class _Run:
    """One prompt of a running batch."""

    item: WorkItem
    run: ChunkRun | None  # None: aborted
    staged: int  # rows of its KV staged for its decode instance


@dataclasses.dataclass
class _Batch:
    group: tuple[int, ...]  # instance ids, ring order
    runs: list[_Run]
    start: float

    def ready(self) -> bool:
        return all(r.run is None or r.run.ready() for r in self.runs)


class ESPCluster(ClusterEngine):
    def __init__(self, prefill, scheduler, decoders, mover, **kwargs):
        """decoders: one per pool instance, on its devices, in pool order, then (optionally) the multi-master
        group's over their blocks. scheduler: its `elastic` planner's `groups` are instance indices (what
        chunk_shapes compiles)."""
        super().__init__(prefill, scheduler, decoders, mover, **kwargs)
        self.group = self.decoders[len(self.pool_ids)] if len(self.decoders) > len(self.pool_ids) else None
        self._check_decoders_on_pool("ESP")
        self._waiting: dict[str, _Prompt] = {}  # the prompts the scheduler holds waiting
        self._batches: list[_Batch] = []

    def chunk_shapes(self, max_tokens: int) -> list[tuple[tuple[int, ...], int]]:
        groups = [tuple(self.pool_ids[k] for k in g) for g in elastic.aligned_groups(len(self.pool_ids))]
        return [(g, b) for g in groups for b in self.prefill.buckets(len(g), max_tokens)]

    def enqueue(
        self,
        ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        ttft_slo: float | None = None,
        generated: int = 0,
        after: str | None = None,
    ) -> str:
        """Queue the prompt (ttft_slo and after: accepted for the interface, generated: refused; ESP admits in
        arrival order)."""
        refuse_resumed(generated)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._owner:
            raise ValueError(f"request id {rid} is already in use")
        limit = min(params.max_tokens, self.max_model_len - len(ids))  # what it may generate
        self.scheduler.arrive(Request(rid, self._arrived(rid, len(ids)), len(ids), limit), self.prompt_info(ids))
        self._waiting[rid] = _Prompt(ids, params)
        self._owner[rid] = None  # its decode instance is chosen when its batch starts
        return rid

    @property
    def num_running(self) -> int:
        return sum(d.engine.num_running for d in self.decoders) + sum(
            r.run is not None for b in self._batches for r in b.runs
        )

    @property
    def pools(self) -> list[LiveDecoder]:
        return self.decoders[: len(self.pool_ids)]

    def recover(self) -> None:
        """The group first: it sees a lost instance cache (its requests' KV) before that instance rebuilds it."""
        for d in self.decoders[::-1]:
            d.engine.recover()

    def step(self) -> list[RequestOutput]:
        outputs = super().step()
        if self.group is not None:
            self.events["decode_scale_ups"] = self.group.engine.kv.scale_ups
        return outputs

    def _drop_prefill(self, request_id: str) -> None:
        """Forget a prompt (the scheduler takes it out of its queue): its run in a batch ignored, its staged KV
        dropped and its place in the group's blocks given up."""
        self._waiting.pop(request_id, None)
        if self.group is not None:
            self.group.engine.kv.unplace(request_id)
        for b in self._batches:
            for r in b.runs:
                if r.item.request_id == request_id and r.run is not None:
                    r.run = None
                    self.mover.drop((request_id, 0))

    def _paused(self, index: int) -> bool:
        if index == len(self.pool_ids):  # the group spans every instance
            return bool(self._batches)
        return any(self.pool_ids[index] in b.group for b in self._batches)

    # ---- prefill batches ------------------------------------------------------------------------------------
    def _pool(self) -> elastic.ElasticPool:
        """Every instance (a step's decodes have ended: all can prefill) and every decoding request."""
        return elastic_pool(
            self.pools,
            self.group,
            lambda rid: self._generated.get(rid, 1),
            range(len(self.pool_ids)),
            self.decode_seconds,
        )

    def _start(self, group: tuple[int, ...], items: tuple[WorkItem, ...], plan: ClusterPlan) -> None:
        """Run a batch's prompts one after another on its group, each decoding afterwards where its dispatch
        keeps its KV."""
        runs = []
        for item in items:
            rid, chosen = item.request_id, plan.dispatch[item.request_id]
            p, decoder = self._waiting[rid], self.decoders[chosen.decoder]
            seed = decoder.engine.expect(p.ids, p.params, rid)
            if decoder is self.group:
                self.group.engine.kv.place(rid, dict(chosen.shards))
                self.events["multi_master"] += 1
            run = self.prefill.run_chunk(rid, group, p.ids, 0, p.params, seed)
            del self._waiting[rid]
            self._owner[rid] = decoder
            staged = self.mover.stage((rid, 0), run.written)
            self.prefill.release(rid)
            runs.append(_Run(item, run, staged))
            self.events["chunks"] += 1
            if len(chosen.shards) < len(group):  # its KV leaves some instances of the group
                self.events["scale_downs"] += 1
        if len(group) > 1:
            self.events["scale_ups"] += 1
        self._batches.append(_Batch(group, runs, self.clock()))

    def _run_chunks(self) -> list[RequestOutput]:
        while self._waiting:  # rounds until one starts nothing (the knee bounds each)
            plan = self.scheduler.plan(self.clock(), self._pool(), dict(enumerate(self.decoders)))
            if not plan.items:
                break
            chunks = list(plan.chunks().items())
            for i, (group, items) in enumerate(chunks):
                try:
                    self._start(group, items, plan)
                except BaseException:  # the batches not started wait again, in order; the caller ends the requests
                    for unstarted, prompts in chunks[i:]:
                        self.scheduler.cancel(unstarted, prompts, dict(enumerate(self.decoders)))
                    raise
        idle = self._batches and not any(d.engine.has_work and not self._paused(k) for k, d in enumerate(self.decoders))
        outputs = []
        for b in self._poll(lambda: [b for b in self._batches if b.ready()], WAIT if idle else 0.0):
            self._batches.remove(b)
            outputs += self._take(b)
        self._count(outputs)
        return outputs

    def _take(self, batch: _Batch) -> list[RequestOutput]:
        """A finished batch: its Outcome to the policy; each prompt's first token, and its KV sent to its decode
        instance."""
        end = self.clock()
        ran = {r.item.request_id: r for r in batch.runs if r.run is not None}
        tokens = {rid: (r.run.token(),) for rid, r in ran.items()}
        outputs = []
        for rid, r in ran.items():
            self.records.append(ChunkRecord(rid, 0, batch.group, r.item.tokens, 0, batch.start, end, None, None))
        for rid in self.scheduler.apply(batch.group, [r.item for r in ran.values()], Outcome(end, (), tokens)):
            decoder = self._owner[rid]
            decoder.ledger.offer(Transfer(rid, 0, True, ran[rid].staged, end))
            outputs.append(decoder.engine.first_token(rid, tokens[rid][0]))
        return outputs
