"""A cluster layout simulated from the flags that serve it: `python -m jaxserve simulate --prefill_instances=...`
reads the same ParallelConfig as `serve` (config.py) and runs its policy's scheduler on a GPU profile.

- cdsp: sim/disagg.py's CDSP pool of `prefill_instances` instances of `tp` GPUs, planned by Eq. (1) fitted to
  the profile's ring prefill (sim/esp_cost.ESPCost), cache balancing from its links, the improvement rate
  fixed or from `--improvement_rates`; decode instances of `decode_tp` GPUs.
- tetriinfer: sim/disagg.py's TetriInfer prefill instances (their chunk, batch and order), power-of-two
  dispatch, flips with `--flip_window`.
- csps: sim/disagg.py's pool planned by CSPS's planner (sched/csps.py: whole prompts on the fewest instances
  whose `partition_tokens` partitions hold them), priced by its SP-NTP model on the profile (dense: CSA is the
  lab's experiment, `python -m jaxserve.lab csps`); decode instances as under cdsp.
- esp: sim/disagg.py's elastic instances, as cluster/esp.py serves them: batches on aligned groups priced by the
  profile's ring prefill (the ESP scheduler planning on LoongServe's model fitted to it), each prompt's KV kept
  on its fewest instances, decoded there on the live scheduler or, spread, by the multi-master group (its step
  priced as one instance's). LoongServe's whole design (KV evacuation, moving shares) is the lab's:
  `python -m jaxserve.lab esp`.
Everywhere: decode lengths predicted by the running mean of finished requests, as live (`--length_predictor=
mean`); decode admission by `--decode_admission`. A trace carries no prompt text, so `--length_predictor=prompt`
and the layouts the simulator does not model (`--decode_kvp` > 1, `--sp_attention=sp_ntp` under cdsp, CSA's
`--sparse_attention`) are refused.
"""

from __future__ import annotations

import pathlib

from jaxserve.config import ParallelConfig
from jaxserve.sched.cdsp import Balancing, CDSPPlanner, Pool
from jaxserve.sched.cost_models import TetrisPrefill
from jaxserve.sched.csps import CSPSPlanner, CSPSPrefill
from jaxserve.sched.decode_dispatch import ObservedLengths
from jaxserve.sched.flip import FlipPolicy
from jaxserve.sched.improvement_rate import AdaptiveCDSP, read_rate_table
from jaxserve.sched.esp import ESPScheduler, aligned_groups
from jaxserve.sched.profiles import PROFILES, TETRIS_TABLE1_K, ProfileBatchCost, kv_capacity, model_shape, network
from jaxserve.sim.disagg import Costs, DisaggConfig, DisaggSimulator
from jaxserve.sim.esp_cost import ESPCost
from jaxserve.sim.metrics import Results
from jaxserve.sim.workload import Workload


def pool_eq1(profile: str, tp: int, pool: Pool) -> TetrisPrefill:
    """Eq. (1) fitted to the profile's prefill of one prompt on SP groups of TP-`tp` instances (the ring model,
    inter-node once a group outgrows a node), at Tetris's Table 1 lengths."""
    cost = ESPCost(profile, tp)
    sizes = [s for s in (1 << i for i in range(pool.size.bit_length())) if s <= pool.size]
    return TetrisPrefill.fit(
        [
            (sp, (k * 1024, 0), cost.prefill([k * 1024], sp, "intra_node" if sp <= pool.per_node else "inter_node"))
            for sp in sizes
            for k in TETRIS_TABLE1_K
        ]
    )


def check(layout: ParallelConfig) -> None:
    """ValueError naming what a simulated cluster does not model."""
    if not layout.prefill_instances:
        raise ValueError("a simulated cluster needs --prefill_instances")
    unmodelled = [
        f"--{name}={getattr(layout, name)}"
        for name, default in (("decode_kvp", 1), ("sp_attention", "ring"), ("length_predictor", "mean"))
        if getattr(layout, name) != default
    ]
    if layout.sparse_attention is not None:
        unmodelled.append(f"--sparse_attention={layout.sparse_attention}")
    if unmodelled:
        raise ValueError(
            f"{', '.join(unmodelled)}: not simulated (a trace has no prompt text, and the simulator "
            f"models neither KV-parallel decode instances, nor SP-NTP in a CDSP pool, nor CSA's drop "
            f"ratio; --cluster_policy=csps simulates dense SP-NTP); leave "
            f"{'it' if len(unmodelled) == 1 else 'them'} out"
        )


def simulate_cluster(workload: Workload, layout: ParallelConfig, profile: str, progress: bool = True) -> Results:
    """`layout`'s cluster (its policy, instances and settings, as `serve` reads them) on `profile`'s GPUs."""
    check(layout)
    if layout.cluster_policy == "esp":
        return _elastic(workload, layout, profile, progress)
    decode = dict(
        decode_instances=layout.decode_instances,
        decode_tp=layout.decoder_tp,
        profile=profile,
        recv_backends=layout.receive_buffers,
        admission=layout.decode_admission,
    )
    if layout.cluster_policy == "tetriinfer":
        flip = (
            FlipPolicy(window=layout.flip_window, check_every=layout.flip_window / 12) if layout.flip_window else None
        )
        cfg = DisaggConfig(
            prefill="tetriinfer",
            prefill_instances=layout.prefill_instances,
            prefill_tp=layout.tp,
            prefill_chunk=layout.prefill_chunk,
            prefill_batch=layout.prefill_batch,
            prefill_order=layout.prefill_order,
            dispatch="power_of_two",
            flip=flip,
            **decode,
        )
        cost = ProfileBatchCost(profile, layout.tp)
        return DisaggSimulator(None, lambda n: cost.batch_time([(n, 0)]), cfg, ObservedLengths()).run(
            workload, progress
        )
    pool = Pool(layout.prefill_instances // layout.node_size, layout.node_size)
    cfg = DisaggConfig(prefill_instances=pool.size, **decode)
    if layout.cluster_policy == "csps":
        csps = CSPSPlanner(CSPSPrefill(profile, pool.per_node, cut=0.0), pool, layout.partition_tokens)
        return DisaggSimulator(csps, csps.fastest, cfg, ObservedLengths()).run(workload, progress)
    eq1 = pool_eq1(profile, layout.tp, pool)
    planner = CDSPPlanner(
        eq1,
        pool,
        layout.improvement_rate,
        min_chunk=layout.min_chunk,
        balancing=Balancing.from_profile(profile, pool.per_node, layout.tp),
    )
    if layout.improvement_rates is not None:
        planner = AdaptiveCDSP(planner, read_rate_table(pathlib.Path(layout.improvement_rates)))
    return DisaggSimulator(planner, eq1.fastest, cfg, ObservedLengths()).run(workload, progress)


KNEE_TOKENS = 16384  # ESP admits a batch while an iteration takes at most this long a prompt's time on one instance


def _elastic(workload: Workload, layout: ParallelConfig, profile: str, progress: bool) -> Results:
    """ESP as served, on the profile: the pool's instances prefill in batches and decode."""
    n, tp = layout.prefill_instances, layout.tp
    cost = ESPCost(profile, tp)
    elastic = ESPScheduler(cost.fit(n, tp), tp, cost.prefill([KNEE_TOKENS], 1), None, 0.0, groups=aligned_groups(n))
    link, kv_bytes = network(PROFILES[profile][0]), model_shape(profile).kv_bytes_per_token()
    costs = Costs(
        decode=ProfileBatchCost(profile, tp),
        prefill=None,
        decode_kv_capacity=kv_capacity(profile, tp),
        transfer=lambda tokens, senders: link.predict("intra_node", tokens * kv_bytes / senders),
        batch=lambda lengths, sp: cost.prefill(list(lengths), sp, cost.link_of(range(sp))),
    )
    cfg = DisaggConfig(
        prefill="esp",
        prefill_instances=n,
        decode_tp=tp,
        profile=profile,
        recv_backends=layout.receive_buffers,
        admission=layout.decode_admission,
        spread=n > 1,
    )
    return DisaggSimulator(elastic, lambda tokens: cost.fastest_prefill(tokens, n), cfg, ObservedLengths(), costs).run(
        workload, progress
    )
