"""One process of the two-process cluster test (tests/test_multihost.py starts both, 4 CPU devices each).

Process 0 (the leader) builds a cluster whose prefill pool is two of its devices and two of process 1's, and
whose two decode instances are process 1's other devices; every device-layer call goes to process 1 through the
lockstep. It serves a long prompt (its later chunks on the group spanning both processes) and a short one (on one
process), and writes the tokens, the single-device engine's tokens for the same prompts, and each chunk's group.
Process 1 only follows.

usage: cluster_worker.py PROCESS_ID COORDINATOR_PORT OUT_JSON MODEL_FOLDER
"""

from __future__ import annotations

import json
import pathlib
import sys

import jax
import numpy as np

process_id, port, out, model = int(sys.argv[1]), int(sys.argv[2]), pathlib.Path(sys.argv[3]), sys.argv[4]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)

import jaxserve  # noqa: E402 (after jax.distributed starts)
from jaxserve import api  # noqa: E402
from jaxserve.cluster.build import build, warmup  # noqa: E402
from jaxserve.config import ModelConfig, ParallelConfig  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402
from jaxserve.sched.cost_models import TetrisPrefill  # noqa: E402

MAX_MODEL_LEN = 1024

if process_id != 0:
    api.follow(ModelConfig(model=model))
    jax.distributed.shutdown()
    sys.exit(0)

llm = jaxserve.LLM(
    model,
    max_model_len=MAX_MODEL_LEN,
    kv_cache_tokens=2 * MAX_MODEL_LEN,
    max_num_seqs=4,
    max_num_batched_tokens=256,
    progress=False,
)  # its own engine: process 0's first device
d = jax.devices()  # process 0's four, then process 1's
# a stand-in Eq. (1) in which the 4-device group is faster per token: what is tested is where chunks run
eq1 = TetrisPrefill({s: np.array([0.01, 4e-4 / s, 2e-7 / s, 1e-7 / s]) for s in (2, 4)})
layout = ParallelConfig(prefill_instances=4, decode_instances=2, node_size=2, min_chunk=256)
cluster = build(
    llm.config,
    llm.builder.params,
    layout,
    lambda devices, tp: llm.builder.engine(devices, progress=False, tp=tp),
    eq1,
    capacity=MAX_MODEL_LEN,
    min_local=128,
    devices=[d[2], d[3], d[4], d[5], d[6], d[7]],
    new=llm.builder.new,
)
warmup(cluster, MAX_MODEL_LEN, progress=False)

rng = np.random.default_rng(0)
prompts = [rng.integers(100, 5000, n).tolist() for n in (700, 40)]
params = SamplingParams(max_tokens=8)
want = [c.token_ids for c in llm.generate(prompts, params)]
rids = [cluster.add_request(p, params) for p in prompts]
got = {r: [] for r in rids}
while cluster.has_unfinished():
    for o in cluster.step():
        assert o.error is None, o.error
        got[o.request_id] += o.new_token_ids
out.write_text(
    json.dumps(
        dict(
            want=want,
            got=[got[r] for r in rids],
            chunks=[
                dict(
                    request=rids.index(r.request_id),
                    processes=sorted({d.process_index for d in jax.devices() if d.id in r.group}),
                )
                for r in cluster.records
            ],
            decode_processes=[sorted({x.process_index for x in dec.engine.runner.devices}) for dec in cluster.decoders],
        )
    )
)
llm.close()
jax.distributed.shutdown()
