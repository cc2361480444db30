"""The live disaggregated cluster (DESIGN.md: cluster/): a CDSP prefill pool and decode instances on groups of
`jax.devices()`, planned by sched/ (CDSPPlanner, decode dispatch), with chunk-wise KV transfer between them."""
