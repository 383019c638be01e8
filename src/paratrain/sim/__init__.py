"""Cluster-scale simulation of a training run: failures, checkpoints, restarts, spares and stragglers.

Entry points: `SimConfig` (inputs), `simulate(cfg)` (Monte-Carlo run), `summarize(run)` (report with CIs),
`paratrain.sim.analytic` (Young, Daly), `paratrain.sim.sweeps` (interval and cluster-size sweeps).
"""

from paratrain.sim.config import SimConfig, StragglerConfig
from paratrain.sim.engine import simulate
from paratrain.sim.results import summarize

__all__ = ["SimConfig", "StragglerConfig", "simulate", "summarize"]
