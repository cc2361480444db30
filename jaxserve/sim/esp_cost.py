"""What a pool of elastic SP instances (each a full model copy on `tp` GPUs) costs on a GPU profile: a prompt
batch's prefill with ring attention over a group (the ring's sends a step's compute does not hide), a decode step
with KV spread over instances, KV moves between instances over the network profile. sim/cluster.py prices a
CDSP pool's ring prefill and ESP as served with it; lab/esp_cluster.py LoongServe's whole design.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

import numpy as np

from jaxserve.sched.cost_models import LoongServePrefill
from jaxserve.sched.profiles import GPUS, PROFILES, ProfileBatchCost, model_shape, network

GPUS_PER_NODE = 8  # the network profile's DGX nodes; instance i holds GPUs i*tp .. (i+1)*tp - 1


class ESPCost:
    """What the executor charges, from the GPU profile, for instances of `tp` GPUs."""

    def __init__(self, profile: str, tp: int):
        self.batch = ProfileBatchCost(profile, tp)
        self.layers, self.tp = self.batch.layers, tp
        gpu = PROFILES[profile][0]
        self.link = network(gpu)
        self.kv_bytes = model_shape(profile).kv_bytes_per_token()
        self.shard_bytes = self.kv_bytes / tp  # one GPU's share of a token's KV (all layers): what its link carries
        self.copy_rate = GPUS[gpu].hbm_bandwidth * GPUS[gpu].mbu  # bytes/s of a copy within one GPU's memory
        self.query_bytes = 2.0 * model_shape(profile).hidden  # bf16 query (and partial output) per layer

    def link_of(self, instances: Iterable[int]) -> str:
        """The slowest link between the instances: NVLink when they share a node."""
        return "intra_node" if len({i * self.tp // GPUS_PER_NODE for i in instances}) <= 1 else "inter_node"

    def prefill(self, lengths: list[int], sp: int, link: str = "intra_node") -> float:
        per_instance = math.ceil(sum(lengths) / sp)
        attention = sum(self.batch.prefill_attention(l, 0) for l in lengths) / sp
        return self.batch.linear_ops(per_instance) + attention + self.ring(per_instance, attention, sp, link)

    def ring(self, tokens: int, attention: float, sp: int, link: str) -> float:
        """Ring attention's exposed K/V passing: per layer, sp steps each compute 1/sp of the instance's
        attention while the block of `tokens` (this GPU's heads) goes to the next instance; each of the sp - 1
        sends is hidden only up to one step's compute."""
        if sp == 1:
            return 0.0
        send = self.link.predict(link, tokens * self.shard_bytes / self.layers)
        return self.layers * (sp - 1) * max(send - attention / self.layers / sp, 0.0)

    def fastest_prefill(self, tokens: int, max_sp: int) -> float:
        return min(self.prefill([tokens], sp) for sp in range(1, max_sp + 1))

    @property
    def migration_bandwidth(self) -> float:
        """Bytes/s of one link, what admission prices a KV evacuation with."""
        return self.link.bandwidth("intra_node")

    def decode_step(self, mastered: int, held: list[int], spread: int) -> float:
        """One instance's part of a decode step: linear ops for the `mastered` requests it runs the query of,
        attention over the KV it holds of each request (`held`, tokens), and the query exchange for the `spread`
        requests whose KV spans several instances."""
        return (
            (self.batch.linear_ops(mastered) if mastered else 0.0)
            + sum(self.batch.decode_attention(t) for t in held)
            + (self.exchange(spread) if spread else 0.0)
        )

    def fit(self, max_sp: int, tp: int) -> LoongServePrefill:
        """LoongServe's model a + b sum(l) + c sum(l^2), fitted per SP size to this profile's prefill times."""
        rng = np.random.default_rng(0)
        samples = []
        for sp in range(1, max_sp + 1):
            for _ in range(60):
                lengths = np.exp(rng.uniform(np.log(256), np.log(1 << 19), rng.integers(1, 5))).astype(int).tolist()
                samples.append(((sp, tp), (sum(lengths), sum(l * l for l in lengths)), self.prefill(lengths, sp)))
        return LoongServePrefill.fit(samples)

    def exchange(self, requests: int) -> float:
        """Per step: each layer sends the queries of `requests` spread requests and gets their partials back."""
        return self.layers * 2 * self.link.predict("intra_node", requests * self.query_bytes)

    def migrate(self, tokens: float, link: str = "intra_node") -> float:
        """One instance sending (or receiving) `tokens` of KV: its GPUs move their shards in parallel."""
        return self.link.predict(link, tokens * self.shard_bytes)

    def moves(self, sent: Mapping[int, float], received: Mapping[int, float]) -> float:
        """KV moved between instances at once, given the tokens each sends and receives: links carry both ways at
        once, so the busiest instance's inbound or outbound tokens set the time."""
        busiest = max([*sent.values(), *received.values()], default=0)
        return self.migrate(busiest, self.link_of({*sent, *received})) if busiest else 0.0

    def copy(self, tokens: float) -> float:
        """Storing `tokens` of KV that passed by into an instance's own memory."""
        return tokens * self.shard_bytes / self.copy_rate
