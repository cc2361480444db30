"""TetriInfer's disaggregated cluster, live (TetriInfer 3.3-3.4): the pool's instances prefill on their own, and
decode instances run the Plan-executing engine as under CDSP (ClusterEngine: receive buffers, decode steps).

- Arrival: a prompt joins the prefill instance with the fewest prompt tokens left (the cluster scheduler's
  `queue`, the simulator's too).
- Prefill: each instance's chunks come from the cluster scheduler (`next_chunk`: sched/prefill_batches.py's
  PrefillBatchScheduler per instance), one chunk of `chunk` tokens at a time: the scheduling batch's prompts
  (ordered SJF / LJF / FCFS) sliced and merged in order. A chunk's pieces run one after another on the instance
  (each its own program call); every piece but the chunk's last ends its prompt, so the instance's history store
  holds one prompt at a time.
- Dispatch: a prompt's decode instance is chosen when its last piece is planned (power of two over the instances
  with room for the prompt plus its predicted decode), so the first token is drawn with the decode side's seed.
- Transfer: once the prompt is done, its whole KV goes to the decode instance in one transfer (TetriInfer's
  request-level transfer; CDSP streams chunk by chunk).
- Flip (TetriInfer 3.5, with a FlipPolicy): every instance has a prefill store and a decode engine on its
  devices, and one role at a time. Every check_every seconds each instance's load is sampled (prefill: a chunk
  running or prompts queued; decode: the fuller of its KV and its batch); when the policy picks an instance, it
  stops taking work in its role (no new prompts, or no new dispatches), drains, then takes the other role.
Where the simulator (sim/disagg.py, prefill="tetriinfer") differs: it chooses the decode instance when the chunk
ends (here: when the last piece starts, a chunk earlier) by its configured dispatch rule (here: power of two);
it simulates flips only with the CDSP pool.
"""

from __future__ import annotations

import dataclasses

from jaxserve.cluster.engine import WAIT, ChunkRecord, ClusterEngine
from jaxserve.engine.engine import RequestOutput
from jaxserve.engine.sp_prefill import ChunkRun
from jaxserve.sampling_params import SamplingParams
from jaxserve.sched.decode_ledger import Transfer
from jaxserve.sched.flip import Flip, FlipController, FlipPolicy
from jaxserve.sched.plan import Outcome, Plan
from jaxserve.sched.request import Request


@dataclasses.dataclass
class _Prompt:
    ids: list[int]
    params: SamplingParams
    instance: int  # index of its prefill instance
    seed: int = 0  # the decode instance's, once chosen (earlier pieces' draws are not used)
    rows: tuple[int, int] | None = None  # history store rows written so far
    staged: int | None = None  # rows of its KV staged for its decode instance, once done
    pieces: int = 0  # pieces run


@dataclasses.dataclass
class _Chunk:
    """One instance's chunk in flight: its Plan and each piece's run."""

    plan: Plan
    runs: list[ChunkRun | None]  # None: its prompt was dropped
    start: float


class TetriInferCluster(ClusterEngine):
    def __init__(self, prefill, scheduler, decoders, mover, flip: FlipPolicy | None = None,
                 prefilling: int | None = None, **kwargs):
        """scheduler: its `instances` are one PrefillBatchScheduler per pool instance, in pool order (its group:
        the instance id). flip: flip instances between roles; then decoders[k] is on pool instance k, and the first
        `prefilling` instances start as prefill instances, the others as decode instances."""
        super().__init__(prefill, scheduler, decoders, mover, **kwargs)
        if [i.group for i in scheduler.instances] != [(d,) for d in self.pool_ids]:
            raise ValueError("one prefill scheduler per pool instance, in pool order")
        n = len(scheduler.instances)
        self._prompts: dict[str, _Prompt] = {}
        self._chunks: dict[int, _Chunk] = {}  # instance index -> its chunk in flight
        if flip is None:
            self.prefilling, self.decoding = set(range(n)), set(range(len(self.decoders)))
        else:
            self._check_decoders_on_pool("Flipping")
            self.prefilling, self.decoding = set(range(prefilling)), set(range(prefilling, n))
        self._flips = FlipController(flip) if flip is not None else None  # units: instance indices
        self._next_check = self.clock()

    def chunk_shapes(self, max_tokens: int) -> list[tuple[tuple[int, ...], int]]:
        """Each instance alone, pieces up to a chunk."""
        most = min(self.scheduler.instances[0].chunk, max_tokens)
        return [((d,), b) for d in self.pool_ids for b in self.prefill.buckets(1, most)]

    def enqueue(self, ids: list[int], params: SamplingParams, request_id: str | None = None,
                ttft_slo: float | None = None, after: str | None = None) -> str:
        """Queue the prompt on the least loaded prefill instance (ttft_slo and after: accepted for the
        interface)."""
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._owner:
            raise ValueError(f"request id {rid} is already in use")
        k = self.scheduler.queue(Request(rid, self._arrived(rid, len(ids)), len(ids), params.max_tokens),
                                 self.prefilling)
        self._prompts[rid] = _Prompt(ids, params, k)
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
            c.runs = [None if item.request_id == request_id else run for item, run in zip(c.plan.items, c.runs)]

    def _dispatch(self, rid: str, p: _Prompt) -> None:
        open_ = sorted(self.decoding)
        chosen = self.scheduler.dispatch(self.prompt_info(p.ids), [self.decoders[i].load() for i in open_],
                                         p.params.max_tokens, rid)
        decoder = self.decoders[open_[chosen.decoder]]
        p.seed = decoder.engine.expect(p.ids, p.params, rid)
        decoder.ledger.expect(rid, len(p.ids), chosen.predicted, chosen.heavy)
        self._owner[rid] = decoder

    def _start(self, k: int, plan: Plan) -> None:
        """Run a chunk's pieces in order on instance k; a prompt's last piece stages its whole KV and frees the
        store for the next prompt."""
        instance, runs = self.pool_ids[k], []
        for item in plan.items:
            p = self._prompts.get(item.request_id)
            if p is None:  # aborted after its chunk was planned
                runs.append(None)
                continue
            last = self.scheduler.yields_token(k, item)
            if last:
                self._dispatch(item.request_id, p)
            run = self.prefill.run_chunk(item.request_id, (instance,), p.ids[item.start:item.end], item.start,
                                         p.params, p.seed)
            lo, hi = run.written[instance]
            p.rows = (p.rows[0] if p.rows else lo, hi)
            if last:
                p.staged = self.mover.stage((item.request_id, 0), {instance: p.rows})
                self.prefill.release(item.request_id)
            runs.append(run)
            self.events["chunks"] += 1
        self._chunks[k] = _Chunk(plan, runs, self.clock())

    def _run_chunks(self) -> list[RequestOutput]:
        if self._flips is not None and self.clock() >= self._next_check:
            self._check_flip()
        for k in range(len(self.pool_ids)):
            if k not in self._chunks and (plan := self.scheduler.next_chunk(k, self.clock())) is not None:
                try:
                    self._start(k, plan)
                except BaseException:
                    self.scheduler.cancel_chunk(k, plan)  # the instance stays usable; the caller ends the requests
                    raise
        idle = self._chunks and not any(d.engine.has_work for d in self.decoders)

        def done() -> list[int]:  # instances whose chunk has finished
            return [k for k, c in self._chunks.items() if all(r is None or r.ready() for r in c.runs)]

        outputs = []
        for k in self._poll(done, WAIT if idle else 0.0):
            outputs += self._take(k, self._chunks.pop(k))
        self._count(outputs)
        return outputs

    def _take(self, k: int, chunk: _Chunk) -> list[RequestOutput]:
        """A finished chunk: its Outcome to the instance's scheduler; each prompt it finished sends its first
        token and its whole KV to its decode instance."""
        end, instance = self.clock(), self.pool_ids[k]
        ran = [(item, run) for item, run in zip(chunk.plan.items, chunk.runs) if run is not None]
        tokens = {}
        for item, run in ran:
            p = self._prompts[item.request_id]
            self.records.append(ChunkRecord(item.request_id, p.pieces, (instance,), item.tokens, item.history,
                                            chunk.start, end, None, None))
            p.pieces += 1
            if self.scheduler.yields_token(k, item):
                tokens[item.request_id] = (run.token(),)
        outputs = []
        for r in self.scheduler.chunk_done(k, Plan(tuple(item for item, _ in ran)), Outcome(end, (), tokens)):
            p, decoder = self._prompts.pop(r.id), self._owner[r.id]
            decoder.ledger.offer(Transfer(r.id, 0, True, p.staged, end))
            outputs.append(decoder.engine.first_token(r.id, tokens[r.id][0]))
        return outputs

    # ---- instance flip (TetriInfer 3.5) ---------------------------------------------------------------------
    def _prefill_load(self, k: int) -> float:
        return float(k in self._chunks or self.scheduler.queued_tokens(k) > 0)

    def _decode_load(self, k: int) -> float:
        d = self.decoders[k]
        s = d.engine.scheduler
        return d.ledger.busy(s.committed(), s.kv_capacity, len(s.running), s.max_num_seqs)

    def _check_flip(self) -> None:
        """Finish a drained flip, sample every instance's load, and start the flip the policy chooses (one at a
        time): a prefill instance drains its queue, a decode instance what was dispatched to it."""
        now = self.clock()
        self._next_check = now + self._flips.policy.check_every
        for kind, k in self._flips.finish(lambda k: not self._prefill_load(k),
                                          lambda k: not self.decoders[k].ledger.heavy):
            (self.decoding if kind is Flip.TO_DECODE else self.prefilling).add(k)
            self.events[f"flips_{kind.value}"] += 1
        started = self._flips.start(now, {k: self._prefill_load(k) for k in sorted(self.prefilling)},
                                    {k: self._decode_load(k) for k in sorted(self.decoding)})
        if started is not None:  # no new prompts (its queue drains), or no new dispatches (its requests finish)
            kind, k = started
            (self.prefilling if kind is Flip.TO_DECODE else self.decoding).discard(k)
