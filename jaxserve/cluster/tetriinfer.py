"""TetriInfer's disaggregated cluster, live (TetriInfer 3.3-3.5): the pool's instances prefill on their own, and
decode instances run the Plan-executing engine as under CDSP (ClusterEngine: receive buffers, decode steps).

Every decision is the cluster policy's (sched/cluster.py's TetriInferPolicy, which the simulator's
sim/disagg.py executes too): this executor runs its ClusterPlans.
- Arrival: a prompt joins the prefill instance with the fewest prompt tokens left (`arrive`).
- Prefill: each step's plan gives every free instance its next chunk of `chunk` tokens (sched/prefill_batches.py:
  the scheduling batch's prompts, ordered SJF / LJF / FCFS, sliced and merged in order). A chunk's pieces run one
  after another on the instance (each its own program call); every piece but the chunk's last ends its prompt,
  so the instance's history store holds one prompt at a time.
- Dispatch: the plan that holds a prompt's last piece names its decode instance (power of two over the instances
  with room for the prompt plus its predicted decode), so the first token is drawn with the decode side's seed.
- Transfer: once the prompt is done, its whole KV goes to the decode instance in one transfer (TetriInfer's
  request-level transfer; CDSP streams chunk by chunk).
- Flip (with a FlipPolicy): every instance has a prefill store and a decode engine on its devices, and one role
  at a time; the plan's role changes say when one starts draining and when it has its new role.
"""

from __future__ import annotations

import dataclasses

from jaxserve.cluster.engine import WAIT, ChunkRecord, ClusterEngine
from jaxserve.engine.engine import RequestOutput
from jaxserve.engine.sp_prefill import ChunkRun
from jaxserve.sampling_params import SamplingParams
from jaxserve.sched.decode_ledger import Transfer
from jaxserve.sched.plan import ClusterPlan, Outcome, WorkItem
from jaxserve.sched.request import Request


@dataclasses.dataclass
class _Prompt:
    ids: list[int]
    params: SamplingParams
    seed: int = 0  # the decode instance's, once chosen (earlier pieces' draws are not used)
    rows: tuple[int, int] | None = None  # history store rows written so far
    staged: int | None = None  # rows of its KV staged for its decode instance, once done
    pieces: int = 0  # pieces run


@dataclasses.dataclass
class _Chunk:
    """One instance's chunk in flight: its pieces and each piece's run."""

    items: tuple[WorkItem, ...]
    runs: list[ChunkRun | None]  # None: its prompt was dropped
    start: float
    ending: frozenset[str]  # the prompts whose last piece it holds


class TetriInferCluster(ClusterEngine):
    def __init__(self, prefill, scheduler, decoders, mover, **kwargs):
        """scheduler: its `instances` are one PrefillBatchScheduler per pool instance, in pool order (its group:
        the instance id). With flips, decoders[k] is on pool instance k."""
        super().__init__(prefill, scheduler, decoders, mover, **kwargs)
        if [i.group for i in scheduler.instances] != [(d,) for d in self.pool_ids]:
            raise ValueError("one prefill scheduler per pool instance, in pool order")
        if scheduler.flips is not None:
            self._check_decoders_on_pool("Flipping")
        self._prompts: dict[str, _Prompt] = {}
        self._chunks: dict[tuple[int, ...], _Chunk] = {}  # instance (as a group) -> its chunk in flight

    def chunk_shapes(self, max_tokens: int) -> list[tuple[tuple[int, ...], int]]:
        """Each instance alone, pieces up to a chunk."""
        most = min(self.scheduler.instances[0].chunk, max_tokens)
        return [((d,), b) for d in self.pool_ids for b in self.prefill.buckets(1, most)]

    def enqueue(
        self,
        ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        ttft_slo: float | None = None,
        after: str | None = None,
    ) -> str:
        """Queue the prompt on the least loaded prefill instance (ttft_slo and after: accepted for the
        interface)."""
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._owner:
            raise ValueError(f"request id {rid} is already in use")
        now = self._arrived(rid, len(ids))
        self.scheduler.arrive(
            Request(rid, now, len(ids), params.max_tokens), self.prompt_info(ids), now, params.max_tokens
        )
        self._prompts[rid] = _Prompt(ids, params)
        self._owner[rid] = None  # its decode instance is chosen with its last piece
        return rid

    @property
    def num_running(self) -> int:
        return sum(d.engine.num_running for d in self.decoders) + len(self._prompts)

    def _drop_prefill(self, request_id: str) -> None:
        """Forget a prompt (the scheduler takes it out of its queue): its piece in a running chunk ignored (the id
        may come back), its staged KV dropped."""
        p = self._prompts.pop(request_id, None)
        if p is None:
            return
        self.prefill.release(request_id)
        if p.staged is not None:
            self.mover.drop((request_id, 0))
        for c in self._chunks.values():
            c.runs = [None if item.request_id == request_id else run for item, run in zip(c.items, c.runs)]

    def _start(self, group: tuple[int, ...], items: tuple[WorkItem, ...], plan: ClusterPlan) -> None:
        """Run a chunk's pieces in order on its instance; a prompt's last piece stages its whole KV and frees the
        store for the next prompt."""
        (instance,), runs = group, []
        ending = frozenset(item.request_id for item in items) & plan.dispatch.keys()
        for item in items:
            rid = item.request_id
            p = self._prompts[rid]
            run = self.prefill.run_chunk(rid, group, p.ids[item.start : item.end], item.start, p.params, p.seed)
            lo, hi = run.written[instance]
            p.rows = (p.rows[0] if p.rows else lo, hi)
            if rid in ending:
                p.staged = self.mover.stage((rid, 0), {instance: p.rows})
                self.prefill.release(rid)
            runs.append(run)
            self.events["chunks"] += 1
        self._chunks[group] = _Chunk(items, runs, self.clock(), ending)

    def _run_chunks(self) -> list[RequestOutput]:
        plan = self.scheduler.plan(self.clock(), dict(enumerate(self.decoders)))
        for change in plan.roles:
            self.events[f"flips_{change.flip.value}"] += change.done
        for rid, chosen in plan.dispatch.items():  # its seed draws the first token
            p, decoder = self._prompts[rid], self.decoders[chosen.decoder]
            p.seed = decoder.engine.expect(p.ids, p.params, rid)
            self._owner[rid] = decoder
        chunks = list(plan.chunks().items())
        for i, (group, items) in enumerate(chunks):
            try:
                self._start(group, items, plan)
            except BaseException:  # the instances not started stay usable; the caller ends the requests
                for unstarted, pieces in chunks[i:]:
                    self.scheduler.cancel(unstarted, pieces)
                raise
        idle = self._chunks and not any(d.engine.has_work for d in self.decoders)

        def done() -> list[tuple[int, ...]]:  # instances whose chunk has finished
            return [g for g, c in self._chunks.items() if all(r is None or r.ready() for r in c.runs)]

        outputs = []
        for group in self._poll(done, WAIT if idle else 0.0):
            outputs += self._take(group, self._chunks.pop(group))
        self._count(outputs)
        return outputs

    def _take(self, group: tuple[int, ...], chunk: _Chunk) -> list[RequestOutput]:
        """A finished chunk: its Outcome to the policy; each prompt it finished sends its first token and its
        whole KV to its decode instance."""
        end = self.clock()
        ran = [(item, run) for item, run in zip(chunk.items, chunk.runs) if run is not None]
        tokens = {}
        for item, run in ran:
            p = self._prompts[item.request_id]
            self.records.append(
                ChunkRecord(item.request_id, p.pieces, group, item.tokens, item.history, chunk.start, end, None, None)
            )
            p.pieces += 1
            if item.request_id in chunk.ending:
                tokens[item.request_id] = (run.token(),)
        outputs = []
        for rid in self.scheduler.apply(group, [item for item, _ in ran], Outcome(end, (), tokens)):
            p, decoder = self._prompts.pop(rid), self._owner[rid]
            decoder.ledger.offer(Transfer(rid, 0, True, p.staged, end))
            outputs.append(decoder.engine.first_token(rid, tokens[rid][0]))
        return outputs
