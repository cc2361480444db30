"""A prefill/decode-disaggregated cluster in simulation (Tetris 3.2, 4.2, 5.2): a prefill pool planned by an SP
planner (CDSP, fixed SP, request-level), chunk-wise KV transfer to a decode instance of larger TP, and decode
instances running sched/decode.py's DecodeScheduler (admission policies, swaps) on a GPU profile.

- Prefill: each arrival is planned once on the pool's booked times; its first token comes with the last chunk.
- Dispatch at planning time (sched/decode_dispatch.py): Tetris's freeness rate with virtual usage, or
  TetriInfer's power of two over instances with room for the predicted footprint, balancing heavy decodes.
- Transfer: each chunk's KV leaves when the chunk ends, its SP group's instances sending their shares in
  parallel over the inter-node link (fitted to the send/recv profile). A decode instance has a few receive
  backends (GPU buffers): a chunk waits for one (the handshake Tetris overlaps with prefill compute), so under
  load transfers queue instead of starving. Decoding starts when the last chunk has landed.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import random
import time
from typing import Callable

import numpy as np
from tqdm.auto import tqdm

from jaxserve.sched.cdsp import ChunkPlan
from jaxserve.sched.decode_dispatch import HEAVY_DECODE, DecodeLoad, LengthPredictor, by_freeness, power_of_two
from jaxserve.sched.decode import DecodeScheduler
from jaxserve.sched.plan import Outcome
from jaxserve.sched.profiles import GPUS, PROFILES, ProfileBatchCost, model_shape, network
from jaxserve.sched.request import Request
from jaxserve.sched.slo import SLO
from jaxserve.sim.metrics import Results
from jaxserve.sim.prefill_pool import Planner
from jaxserve.sim.simulator import PLACEHOLDER_TOKEN
from jaxserve.sim.workload import Workload


@dataclasses.dataclass(frozen=True)
class DisaggConfig:
    prefill_instances: int = 16
    decode_instances: int = 4
    decode_tp: int = 4
    profile: str = "a100_llama3_8b"  # decode instances' GPU profile; KV bytes per token from its model
    recv_backends: int = 4  # transfer buffers per decode instance
    dispatch: str = "freeness"  # or "power_of_two" (TetriInfer; needs a length predictor)
    admission: str = "oracle"  # decode admission (sched/decode.py); predictions come from the predictor
    host_bandwidth: float = 25e9  # bytes/s per GPU to host memory (PCIe 4 x16), for swaps
    seed: int = 0  # power of two's sampling
    slo: SLO = SLO()
    memory_utilization: float = 0.9

    def decode_kv_capacity(self) -> int:
        shape, gpu = model_shape(self.profile), GPUS[PROFILES[self.profile][0]]
        free = self.decode_tp * gpu.memory * self.memory_utilization - shape.weight_bytes()
        if free <= 0:
            raise ValueError(f"{shape.name} does not fit {self.decode_tp} x {gpu.name}")
        return int(free // shape.kv_bytes_per_token())


class DecodeInstance:
    def __init__(self, index: int, config: DisaggConfig, cost: ProfileBatchCost):
        self.index, self.cost = index, cost
        self.scheduler = DecodeScheduler(config.decode_kv_capacity(), config.admission, group=(index,))
        self.virtual = 0  # KV slots promised to requests whose transfer is in flight
        self.backends = [0.0] * config.recv_backends  # when each receive buffer frees
        self.heavy = self.light = 0  # assigned requests by predicted decode length
        self.is_heavy: dict[str, bool] = {}

    def load(self) -> DecodeLoad:
        s = self.scheduler
        return DecodeLoad(s.kv_capacity - s.committed() - self.virtual, len(s.running) + len(s.waiting),
                          self.heavy, self.light)

    def receive(self, ready_at: float, seconds: float) -> float:
        """Book the earliest free receive buffer for a chunk ready to send at `ready_at`; when it lands."""
        start = max(ready_at, heapq.heappop(self.backends))
        heapq.heappush(self.backends, start + seconds)
        return start + seconds


class DisaggSimulator:
    def __init__(self, planner: Planner, best_latency: Callable[[int], float], config: DisaggConfig = DisaggConfig(),
                 predictor: LengthPredictor | None = None):
        """best_latency(tokens): a prompt's fastest isolated prefill, which its TTFT deadline scales with;
        predictor: decode-length ranges for power-of-two dispatch."""
        if config.dispatch not in ("freeness", "power_of_two"):
            raise ValueError(f"dispatch must be freeness or power_of_two, got {config.dispatch!r}")
        if (config.dispatch == "power_of_two" or config.admission in ("reserve_static", "reserve_dynamic")) \
                and predictor is None:
            raise ValueError(f"{config.dispatch} dispatch with {config.admission} admission needs a decode-length "
                             "predictor")
        self.planner, self.best_latency, self.config, self.predictor = planner, best_latency, config, predictor
        self.cost = ProfileBatchCost(config.profile, config.decode_tp)
        gpu = PROFILES[config.profile][0]
        self.link = network(gpu)
        self.kv_bytes = model_shape(config.profile).kv_bytes_per_token()

    def transfer_seconds(self, tokens: int, senders: int) -> float:
        return self.link.predict("inter_node", tokens * self.kv_bytes / senders)

    def run(self, workload: Workload, progress: bool = True) -> Results:
        cfg = self.config
        decoders = self.decoders = [DecodeInstance(i, cfg, self.cost) for i in range(cfg.decode_instances)]
        free_at = np.zeros(cfg.prefill_instances)
        events: list[tuple[float, int, int, str, object]] = []  # (time, order, seq, kind, payload)
        seq = itertools.count()
        requests, rejected = [], []
        bar = tqdm(total=len(workload), desc="simulate disaggregated", unit="req", disable=not progress)
        started = time.perf_counter()
        on_arrival = getattr(self.planner, "on_arrival", None)
        rng = random.Random(cfg.seed)
        for i, (t, p, o) in enumerate(zip(workload.arrivals.tolist(), workload.prompt_lens.tolist(),
                                          workload.output_lens.tolist())):
            r = Request(str(i), t, p, o)
            need = p + o
            loads = [d.load() for d in decoders]
            hi = self.predictor.predict(p)[1] if self.predictor is not None else o
            heavy = hi > HEAVY_DECODE
            if cfg.dispatch == "freeness":
                dec = decoders[by_freeness(loads)]
            else:
                dec = decoders[power_of_two(loads, p + hi, heavy, rng)]
            if need > dec.scheduler.kv_capacity:
                rejected.append(r)
                bar.update()
                continue
            if on_arrival is not None:
                on_arrival(t)
            queues = np.maximum(free_at - t, 0.0)
            plan: ChunkPlan = self.planner.plan(p, queues)
            free_at = t + plan.commit(queues)
            r.ttft_deadline, r.tpot_slo = t + cfg.slo.ttft(self.best_latency(p)), cfg.slo.tpot
            r.add_tokens(1, t + plan.ttft)  # the first token comes with the last prefill chunk
            requests.append(r)
            if r.finished:
                bar.update()
                continue
            landed = max(dec.receive(t + c.end, self.transfer_seconds(c.tokens, c.sp)) for c in plan.chunks)
            dec.virtual += need
            dec.is_heavy[r.id] = heavy
            dec.heavy, dec.light = dec.heavy + heavy, dec.light + (not heavy)
            heapq.heappush(events, (landed, 1, next(seq), "kv_ready", (dec, r, hi)))

        def launch(dec: DecodeInstance, now: float) -> None:
            plan = dec.scheduler.schedule(now)
            if plan is None:
                return
            swapped = sum(m.tokens for m in plan.moves) * self.kv_bytes / (cfg.host_bandwidth * cfg.decode_tp)
            end = now + self.cost.batch_time([], [i.history for i in plan.items]) + swapped
            tokens = {i.request_id: (PLACEHOLDER_TOKEN,) for i in plan.items}
            heapq.heappush(events, (end, 0, next(seq), "done", (dec, plan, Outcome(end, (), tokens))))

        while events:
            now, _, _, kind, payload = heapq.heappop(events)
            if kind == "kv_ready":
                dec, r, predicted = payload
                dec.virtual -= r.prompt_len + r.output_len
                dec.scheduler.add(r, predicted)
            else:
                dec, plan, outcome = payload
                done = dec.scheduler.apply(plan, outcome)
                for r in done:
                    heavy = dec.is_heavy.pop(r.id)
                    dec.heavy, dec.light = dec.heavy - heavy, dec.light - (not heavy)
                bar.update(len(done))
            launch(dec, now)
        bar.close()
        first = requests[0].arrival if requests else 0.0
        last = max((r.finished_at for r in requests if r.finished_at is not None), default=first)
        return Results(requests, rejected, span=max(last - first, 1e-9), wall_seconds=time.perf_counter() - started,
                       config=dataclasses.asdict(cfg) | {"workload": workload.name, "requests": len(workload)})
