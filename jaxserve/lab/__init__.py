"""The paper lab: planners and cluster models only the simulator and the experiments run (no jax).

It may import sched/ and sim/; nothing below it imports it.
"""
