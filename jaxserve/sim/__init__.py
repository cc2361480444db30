"""The cluster simulator: executes the scheduler's Plans with a cost model (pure Python + numpy, no jax).

From a notebook:

    from jaxserve import sim
    res = sim.simulate(sim.make_workload("azure_conv", rate=8.0), sim.config_for("lars"))
    res.summary(); res.table()  # a dict of percentiles; one row per request (pandas.DataFrame(res.table()))
"""

from jaxserve.sim.run import config_for, make_workload, max_sustainable_rate, simulate

__all__ = ["config_for", "make_workload", "max_sustainable_rate", "simulate"]
