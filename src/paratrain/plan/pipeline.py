"""The pipeline schedule per step: its idle time (bubble), the microbatches whose activations a rank holds, the
rank that sets the pace and the rank holding the most parameters (layers per rank: plan/stages.py).
"""

from __future__ import annotations

import numpy as np

from paratrain.model.config import ModelConfig
from paratrain.plan.numeric import select
from paratrain.plan.stages import Loads, rank_times, same_rank


def pipeline_bubble_s(sched, pp, v, m, fwd, bwd_input, bwd_weight):
    """Idle time of the pipeline per step, from per-microbatch stage times (all chunks of the stage).

    GPipe and 1F1B: (p-1) stage-times (Huang et al. 2019; Narayanan et al. 2021). Interleaved 1F1B with v
    chunks per device: (p-1)/v (Narayanan et al. 2021). ZB-V (Qi et al. 2024, two chunks): (p-1) *
    (F + B - 2W) per chunk, zero when the weight-gradient pass W fills the gaps, never negative. DualPipeV
    (DeepSeek-AI 2024, the V-shaped half of DualPipe) is timed as ZB-V: the same V placement and split backward;
    torch's ScheduleDualPipeV runs a paired F and B one after the other (no DualPipe overlap kernels).
    """
    full = fwd + bwd_input + bwd_weight
    zb = np.where(m >= 2 * pp, np.maximum(0.0, (fwd + bwd_input - 2 * bwd_weight) / 2.0), full / 2.0)
    per = select([sched <= 1, sched == 2, sched >= 3], [full, full / v, zb])
    return np.where(pp > 1, (pp - 1) * per, 0.0)


def _slowest_rank(loads: Loads, pp, v_shape, per_layer, embed, head):
    """(layers, embedding there 0/1, head there 0/1) of the rank with the longest time per microbatch.
    Ties go to the head's rank, then the embedding's (a balanced split's last stage, as before)."""
    first, last, inner = rank_times(loads, pp, v_shape, per_layer, embed, head)
    one = same_rank(pp, v_shape)
    is_last = last >= np.maximum(first, inner)
    is_first = ~is_last & (first >= inner)
    layers = select([is_last, is_first], [loads.last, loads.first], loads.inner)
    embed_on = np.where(is_first | (is_last & one), 1.0, 0.0)
    head_on = np.where(is_last | (is_first & one), 1.0, 0.0)
    return layers, embed_on, head_on


def _rank_params(model: ModelConfig, loads: Loads, pp, v_shape):
    """Parameters of the (first, last, inner) ranks: their layers plus the embedding on the first and the head
    (final norm + output projection) on the last; both on one rank under a V schedule or pp = 1."""
    per_layer = model.params_per_layer()
    one = same_rank(pp, v_shape)
    first = loads.first * per_layer + model.embedding_params() + np.where(one, model.head_params(), 0.0)
    last = np.where(one, first, loads.last * per_layer + model.head_params())
    return first, last, loads.inner * per_layer


def _largest_rank(model: ModelConfig, loads: Loads, pp, v_shape):
    """(parameters, layers) of the rank holding the most parameters (its data-parallel traffic and optimizer
    step are the slowest)."""
    first, last, inner = _rank_params(model, loads, pp, v_shape)
    params = np.maximum.reduce([first, last, inner])
    layers = select([params == last, params == first], [loads.last, loads.first], loads.inner)
    return params, layers


def inflight_microbatches(sched, pp, v, m, rank=0):
    """Microbatches whose activations pipeline rank `rank` holds at its peak, in units of its whole stage (all
    its chunks). 1F1B: rank r runs p - r - 1 warm-up forwards before its first backward, so it holds p - r
    (Narayanan et al. 2021); interleaved: Megatron-core's warm-up of 2(p - r - 1) + (v - 1)p chunk forwards plus
    the one in flight, v chunks to a stage, p (1 + (p-1)/(p v)) on the first rank (Korthikanti et al. 2022);
    GPipe: all m; ZB-V: as many as 1F1B's first rank on every rank (its rank 0 holds both ends). Never more
    than the step's m microbatches."""
    r = np.asarray(rank, dtype=float)
    one_f_one_b = np.minimum(pp - r, m)
    interleaved = np.minimum((2 * (pp - r - 1) + (v - 1) * pp + 1) / v, m)
    return select([sched == 0, sched == 2, sched >= 3], [m, interleaved, np.minimum(pp, m)], one_f_one_b)
