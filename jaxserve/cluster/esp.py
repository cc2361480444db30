"""LoongServe's elastic sequence parallelism, live (LoongServe Sections 4-5): every instance of the pool both
prefills and decodes; there are no separate decode instances.

- Arrival: a prompt waits, in arrival order (the cluster scheduler's `wait`).
- Prefill (each step, on the instances no prefill holds): the cluster scheduler's `elastic_batches` (sched/esp.py's
  ESPScheduler) admits waiting prompts, allocates elastic instances and batches them by its DP, over the instance
  sets this cluster has programs for (aligned power-of-two groups). A batch's prompts run one after another on
  its group, each as one chunk with ring attention over the group's devices: a scale-up when the group has more
  than one instance.
- Scale-down: each prompt decodes on one instance of its group, the one with the most free KV (sched/esp.py's
  first choice). Its KV share on that instance is copied on its own device; the other instances' shares move
  to it (one transfer, through the decode instance's receive buffers). Its first token is drawn with that
  instance's seed.
- Decode: every instance runs the Plan-executing engine over the requests it holds. An instance in a prefill
  pauses its decodes until the batch ends: the wait admission and allocation weigh (no KV is evacuated).
Where LoongServe goes further: a request's decode may stay spread over several instances (multi-master decode,
the query moving to the KV) and grow onto another when its instance fills; here it runs on one instance, and a
full instance preempts (recompute) as the single-instance engine does.
"""

from __future__ import annotations

import dataclasses

from jaxserve.cluster.engine import WAIT, ChunkRecord, ClusterEngine
from jaxserve.engine.engine import RequestOutput
from jaxserve.engine.sp_prefill import ChunkRun
from jaxserve.sampling_params import SamplingParams
from jaxserve.sched import esp as elastic
from jaxserve.sched.decode_dispatch import HEAVY_DECODE, PromptInfo
from jaxserve.sched.decode_ledger import Transfer
from jaxserve.sched.request import Request


@dataclasses.dataclass(frozen=True)
class _Prompt:
    ids: list[int]
    params: SamplingParams


@dataclasses.dataclass
class _Run:
    """One prompt of a running batch."""

    request_id: str
    tokens: int
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
        """decoders: one per pool instance, on its devices, in pool order. scheduler: its `elastic` planner's
        `groups` are instance indices (what chunk_shapes compiles)."""
        super().__init__(prefill, scheduler, decoders, mover, **kwargs)
        self._check_decoders_on_pool("ESP")
        self._waiting: dict[str, _Prompt] = {}  # the prompts the scheduler holds waiting
        self._batches: list[_Batch] = []

    def chunk_shapes(self, max_tokens: int) -> list[tuple[tuple[int, ...], int]]:
        groups = [tuple(self.pool_ids[k] for k in g) for g in elastic.aligned_groups(len(self.pool_ids))]
        return [(g, b) for g in groups for b in self.prefill.buckets(len(g), max_tokens)]

    def enqueue(self, ids: list[int], params: SamplingParams, request_id: str | None = None,
                ttft_slo: float | None = None, after: str | None = None) -> str:
        """Queue the prompt (ttft_slo and after: accepted for the interface; ESP admits in arrival order)."""
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._owner:
            raise ValueError(f"request id {rid} is already in use")
        self.scheduler.wait(Request(rid, self._arrived(rid, len(ids)), len(ids), params.max_tokens))
        self._waiting[rid] = _Prompt(ids, params)
        self._owner[rid] = None  # its decode instance is chosen when its batch starts
        return rid

    @property
    def num_running(self) -> int:
        return (sum(d.engine.num_running for d in self.decoders)
                + sum(r.run is not None for b in self._batches for r in b.runs))

    def _drop_prefill(self, request_id: str) -> None:
        """Forget a prompt (the scheduler takes it out of its queue): its run in a batch ignored and its staged KV
        dropped."""
        self._waiting.pop(request_id, None)
        for b in self._batches:
            for r in b.runs:
                if r.request_id == request_id and r.run is not None:
                    r.run = None
                    self.mover.drop((request_id, 0))

    def _paused(self, index: int) -> bool:
        return any(self.pool_ids[index] in b.group for b in self._batches)

    # ---- prefill batches ------------------------------------------------------------------------------------
    def _instance(self, k: int) -> elastic.ElasticInstance:
        """Decode instance k as the ESP scheduler sees it: KV tokens in use (promised ones included)."""
        d = self.decoders[k]
        decoding = [self._generated.get(rid, 1) for rid in d.ledger.heavy if rid not in d.ledger.incoming]
        return elastic.ElasticInstance(k, d.kv_tokens, d.kv_tokens - d.load().free_slots, tuple(decoding))

    def _plan(self) -> list[elastic.ESPBatch]:
        busy = {i for b in self._batches for i in b.group}
        instances = [self._instance(k) for k, i in enumerate(self.pool_ids) if i not in busy]
        if not self._waiting or not instances:
            return []
        estimate = self.scheduler.predict(PromptInfo(0))  # the running mean: one estimate for every decode
        generated = tuple(g for e in instances for g in e.generated)
        decodes = elastic.RunningDecodes(elastic.isolated_room(instances), generated, estimate, self.decode_seconds)
        return self.scheduler.elastic_batches(instances, elastic.predicted_growth(estimate, generated), decodes)

    def _start(self, batch: elastic.ESPBatch) -> None:
        """Run the batch's prompts on its group, each decoding afterwards on the group's instance with the most
        free KV (its share there stays on the device; the others' move)."""
        group = tuple(sorted(self.pool_ids[k] for k in batch.instances))
        runs = []
        for r in batch.requests:
            p = self._waiting[r.id]
            k = elastic.keeper([self._instance(k) for k in batch.instances]).id
            decoder = self.decoders[k]
            hi = self.scheduler.predict(self.prompt_info(p.ids), p.params.max_tokens, r.id)
            seed = decoder.engine.expect(p.ids, p.params, r.id)
            decoder.ledger.expect(r.id, len(p.ids), hi, hi > HEAVY_DECODE)
            run = self.prefill.run_chunk(r.id, group, p.ids, 0, p.params, seed)
            del self._waiting[r.id]
            self._owner[r.id] = decoder
            staged = self.mover.stage((r.id, 0), run.written)
            self.prefill.release(r.id)
            runs.append(_Run(r.id, len(p.ids), run, staged))
            self.events["chunks"] += 1
            if len(group) > 1:  # its KV leaves the other instances of the group
                self.events["scale_downs"] += 1
        if len(group) > 1:
            self.events["scale_ups"] += 1
        self._batches.append(_Batch(group, runs, self.clock()))

    def _run_chunks(self) -> list[RequestOutput]:
        batches = self._plan()
        for i, batch in enumerate(batches):
            try:
                self._start(batch)
            except BaseException:  # the prompts not started wait again, in order; the caller ends the requests
                for r in reversed([r for b in batches[i:] for r in b.requests if r.id in self._waiting]):
                    self.scheduler.wait(r, first=True)
                raise
        idle = self._batches and not any(d.engine.has_work and not self._paused(k)
                                         for k, d in enumerate(self.decoders))
        outputs = []
        for b in self._poll(lambda: [b for b in self._batches if b.ready()], WAIT if idle else 0.0):
            self._batches.remove(b)
            outputs += self._take(b)
        self._count(outputs)
        return outputs

    def _take(self, batch: _Batch) -> list[RequestOutput]:
        """A finished batch: each prompt's first token, and its KV sent to its decode instance."""
        end, outputs = self.clock(), []
        for r in batch.runs:
            if r.run is None:
                continue
            self.records.append(ChunkRecord(r.request_id, 0, batch.group, r.tokens, 0, batch.start, end, None, None))
            decoder = self._owner[r.request_id]
            decoder.ledger.offer(Transfer(r.request_id, 0, True, r.staged, end))
            outputs.append(decoder.engine.first_token(r.request_id, r.run.token()))
        return outputs
