"""LoongServe's elastic sequence parallelism, live (LoongServe Sections 4-5): every instance of the pool both
prefills and decodes; there are no separate decode instances.

- Arrival: a prompt waits, in arrival order (the cluster scheduler's `wait`).
- Prefill (each step, on the instances no prefill holds): the cluster scheduler's `elastic_batches` (sched/esp.py's
  ESPScheduler) admits waiting prompts, allocates elastic instances and batches them by its DP, over the instance
  sets this cluster has programs for (aligned power-of-two groups). A batch's prompts run one after another on
  its group, each as one chunk with ring attention over the group's devices: a scale-up when the group has more
  than one instance.
- Scale-down: the ESP scheduler's (`scale_down`): each prompt keeps its KV on the fewest instances of its group
  whose free KV holds it and its predicted decode. A prompt kept on one instance whose context fits that
  instance's pool decodes there, on the instance's own engine (its share there is copied on its own device; the
  others' shares move to it, one transfer through its receive buffers). Any other decodes multi-master: on the
  group engine over every instance (cluster/multi_master.py), its KV landed in the shares scale-down chose, in
  the instances' own pools (sched/spread_kv.py). Its first token is drawn with its decode engine's seed.
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
from jaxserve.cluster.engine import WAIT, ChunkRecord, ClusterEngine
from jaxserve.engine.engine import RequestOutput
from jaxserve.engine.sp_prefill import ChunkRun
from jaxserve.sampling_params import SamplingParams
from jaxserve.sched import decode_ledger, esp as elastic
from jaxserve.sched.decode_dispatch import PromptInfo
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

    @property
    def pools(self) -> list[LiveDecoder]:
        return self.decoders[:len(self.pool_ids)]

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
                if r.request_id == request_id and r.run is not None:
                    r.run = None
                    self.mover.drop((request_id, 0))

    def _paused(self, index: int) -> bool:
        if index == len(self.pool_ids):  # the group spans every instance
            return bool(self._batches)
        return any(self.pool_ids[index] in b.group for b in self._batches)

    # ---- prefill batches ------------------------------------------------------------------------------------
    def _instance(self, k: int) -> elastic.ElasticInstance:
        """Decode instance k as the ESP scheduler sees it: KV tokens in use (promised ones included)."""
        d = self.decoders[k]
        decoding = [self._generated.get(rid, 1) for rid in d.ledger.heavy if rid not in d.ledger.incoming]
        placed = self.group.engine.kv.promised(k) if self.group is not None else 0  # a spread prompt's, to land
        used = d.kv_tokens - decode_ledger.load(d).free_slots + placed
        return elastic.ElasticInstance(k, d.kv_tokens, used, tuple(decoding))

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
        """Run the batch's prompts on its group, each decoding afterwards where scale-down keeps its KV."""
        group = tuple(sorted(self.pool_ids[k] for k in batch.instances))
        kept = self.scheduler.elastic.scale_down(batch, [self._instance(k) for k in range(len(self.pool_ids))])
        runs = []
        for r in batch.requests:
            p = self._waiting[r.id]
            decoder = self._decoder(p, kept[r.id])
            info = self.prompt_info(p.ids)
            hi = self.scheduler.predict(info, p.params.max_tokens, r.id)
            seed = decoder.engine.expect(p.ids, p.params, r.id)
            self.scheduler.promise(decoder, info, r.id, hi)
            if decoder is self.group:
                self.group.engine.kv.place(r.id, kept[r.id])
                self.events["multi_master"] += 1
            run = self.prefill.run_chunk(r.id, group, p.ids, 0, p.params, seed)
            del self._waiting[r.id]
            self._owner[r.id] = decoder
            staged = self.mover.stage((r.id, 0), run.written)
            self.prefill.release(r.id)
            runs.append(_Run(r.id, len(p.ids), run, staged))
            self.events["chunks"] += 1
            if len(kept[r.id]) < len(group):  # its KV leaves some instances of the group
                self.events["scale_downs"] += 1
        if len(group) > 1:
            self.events["scale_ups"] += 1
        self._batches.append(_Batch(group, runs, self.clock()))

    def _decoder(self, prompt: _Prompt, kept: dict[int, int]) -> LiveDecoder:
        """Where a prompt decodes, its KV kept on `kept` (instance -> tokens): that instance's engine if it is one
        whose context holds the request's, else the multi-master group (without one, the instance of `kept` with
        the most free KV)."""
        if self.group is None:
            return self.decoders[elastic.keeper([self._instance(k) for k in kept]).id]
        (one, *more) = kept
        context = len(prompt.ids) + min(prompt.params.max_tokens, self.max_model_len - len(prompt.ids))
        if not more and context <= self.decoders[one].engine.max_model_len:
            return self.decoders[one]
        return self.group

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
