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


def overlapped_p2p_path_s(pp, v, m, send, hidden_s, capped=True):
    """Time the pipeline's sends add to an interleaved 1F1B step under Megatron-Core's overlap_p2p_comm
    (forward_backward_pipelining_with_interleaving; overlap_p2p_comm_warmup_flush False, the default, which no
    recipe changes), `send` one transfer, `hidden_s` what a steady iteration's exchange hides behind.

    What the code waits for (core_r0.13-0.17): in the warm-up every chunk forward ends in a blocking
    send_forward_recv_forward, and in the cool-down every chunk backward in a blocking send_backward_recv_backward;
    in the steady state the sends and receives are posted async after each pass (send_forward_recv_forward after the
    forward, send_backward_recv_backward after the backward) and waited for only before the pass that needs the
    tensor (pre_forward / pre_backward) or one iteration later (the previous send). Replaying that program for every
    rank with rendezvous transfers (benchmarks/megatron_p2p_replay.py) gives, over the step without sends: the first
    microbatch's activation crossing all p v - 1 stage boundaries in the warm-up and the last gradient crossing them
    back in the cool-down, 2 (p v - 1) sends, whatever m; and in the steady state nothing while a send is at most
    what it hides behind (there: a chunk's forward), beyond it (send - hidden_s) per steady iteration,
    m v - (v - 1) p of them on the last rank. Where the warm-up holds every microbatch
    (m v <= (v - 1) p + 2 (p - 1)) the sends are all blocking: at most the m x 2 v of the schedule without overlap.

    capped False where a steady iteration waits for its send whatever the schedule around it (hidden_s 0 for core
    >= 0.18's forward-send wait, Megatron-LM PR #4047; one layer's attention wgrad for the combined 1F1B of EP A2A
    overlap): the all-warm-up ranks' blocking sends and the last rank's waited ones add up past m x 2 v on deep
    pipelines; within 0.6% of the replayed step for the forward-send wait."""
    fill = 2 * (pp * v - 1) * send
    steady = np.maximum(0.0, m * v - (v - 1) * pp) * np.maximum(0.0, send - hidden_s)
    return np.where(pp > 1, np.where(capped, np.minimum(fill + steady, 2 * v * m * send), fill + steady), 0.0)


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
    return first + np.where(one, mtp_rank_params(model, one), 0.0), last + mtp_rank_params(model, one), \
        loads.inner * per_layer


def mtp_rank_params(model: ModelConfig, one):
    """Parameters the multi-token-prediction depths (ModelConfig.mtp_layers) put on the head's rank, as the dense
    view counts them (its average layer per depth: the routed experts come with plan.moe's terms), plus their
    norms and eh_proj, and a copy of the embedding where that rank is not the first (Megatron-Core's MTP stage)."""
    if not model.mtp_layers:
        return 0.0
    own = model.mtp_layers * (model.params_per_layer() + model.mtp_glue_params())
    return own + np.where(one, 0.0, model.vocab * model.hidden)


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
