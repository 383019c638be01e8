"""Pipeline stage sizes: how many layers each (virtual) stage holds, and the split the planner chooses.

The runtime (paratrain.parallel.pipeline) cuts the model into S = pp x v stages, balanced by layer count unless
`parallel.pp_layers` gives a count per stage. Stage s runs on rank s % pp (1F1B, GPipe, interleaved: chunks
round-robin), or under a V schedule (zbv) rank r holds stages r and 2pp-1-r. The first stage also runs the
embedding, the last one the final norm, the output head and the loss; with a large vocabulary the head costs
several layers' time, so the rank that holds it sets the pipeline's pace unless it gets fewer layers.

The planner's stage model works per rank, on three numbers (numpy arrays, one entry per layout):
`first` layers on the rank with the embedding, `last` on the rank with the head (the same rank under a V
schedule or pp = 1, then last == first), `inner` on the most loaded other rank (0 when there is none). Each
rank's time per microbatch is its layers x the per-layer time plus its extras; the step runs at the pace of
the slowest rank. No torch (fast import): `balanced_layers`, `stage_ranks` and `check_pp_layers` are the
runtime's own rules (paratrain.config.pipeline), imported, not restated.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from paratrain.config.pipeline import balanced_layers, check_pp_layers, stage_ranks
from paratrain.config.rules import fewest_layers

EPS = 1e-9  # layers: absorbs float rounding when a time is divided back into whole layers
# An uneven split is chosen only if it makes the slowest rank at least this much faster per microbatch: smaller
# gains are well inside the model's error, and the balanced split needs no parallel.pp_layers in the config.
MIN_GAIN = 0.01


def rank_loads(counts, pp: int, v_shape: bool) -> tuple[int, int, int]:
    """(first, last, inner) layers per rank of a per-stage split (see the module docstring)."""
    per_rank = [0] * pp
    for stage, rank in enumerate(stage_ranks(pp, len(counts) // pp, v_shape)):
        per_rank[rank] += counts[stage]
    head_rank = 0 if v_shape or pp == 1 else pp - 1
    others = [n for r, n in enumerate(per_rank) if r not in (0, head_rank)]
    return per_rank[0], per_rank[head_rank], max(others, default=0)


@dataclass
class Loads:
    """Layers per rank of each layout (arrays): see the module docstring. balanced: the runtime's default
    split (pp_layers need not be written)."""

    first: np.ndarray
    last: np.ndarray
    inner: np.ndarray
    balanced: np.ndarray


def balanced_loads(layers: int, pp, v, v_shape) -> Loads:
    """Loads of the runtime's balanced split for each layout (a few distinct (pp, v, V) combinations)."""
    pp, v, v_shape = np.broadcast_arrays(np.asarray(pp, float), np.asarray(v, float), np.asarray(v_shape, bool))
    out = np.zeros((3,) + pp.shape)
    if pp.size == 0:
        return Loads(out[0], out[1], out[2], np.ones(pp.shape, bool))
    # one small integer key per (pp, v, V), distinct keys found with a lookup table (no sort: np.unique(axis=0)
    # on a search grid of 10^5-10^6 layouts took seconds)
    base = int(v.max()) + 1
    keys = (pp.ravel().astype(np.int64) * base + v.ravel().astype(np.int64)) * 2 + v_shape.ravel()
    present = np.zeros(int(keys.max()) + 1, bool)
    present[keys] = True
    uniq = np.nonzero(present)[0]
    lookup = np.zeros(present.size, np.int64)
    lookup[uniq] = np.arange(uniq.size)
    inverse = lookup[keys]
    combos = [(int(k) // 2 // base, int(k) // 2 % base, bool(k % 2)) for k in uniq]
    # stage counts the layers cannot fill (config.rules' stages_le_layers refuses them): a placeholder
    table = np.array([rank_loads(balanced_layers(layers, p * c), p, vs) if fewest_layers(p * c) <= layers
                      else (layers, layers, 0) for p, c, vs in combos], dtype=float)
    out[:] = table[inverse.ravel()].T.reshape((3,) + pp.shape)
    return Loads(out[0], out[1], out[2], np.ones(pp.shape, bool))


def same_rank(pp, v_shape):
    """Embedding and head on one rank: a single stage, or a V schedule (rank 0 holds the first and last)."""
    return (np.asarray(pp) == 1) | np.asarray(v_shape, bool)


def rank_times(loads: Loads, pp, v_shape, per_layer, embed, head):
    """(first, last, inner) rank times: layers x per_layer plus the embedding on the first rank and the head on
    the last (both on one rank under a V schedule or pp = 1)."""
    one = same_rank(pp, v_shape)
    first = loads.first * per_layer + embed + np.where(one, head, 0.0)
    last = np.where(one, first, loads.last * per_layer + head)
    return first, last, loads.inner * per_layer


def _floor(x):
    return np.floor(x + EPS)


def best_loads(layers: int, pp, v, v_shape, per_layer, embed, head, balanced: Loads) -> Loads:
    """The split that minimises the slowest rank's time, exactly (over whole layers per rank).

    Ranks come in three kinds: the first (extra e_f = embedding, + head under a V schedule), `k_i` inner ranks
    (no extra) and the last (extra e_l = head; none under a V schedule). Within time T a rank of extra e holds
    at most floor((T - e) / c) layers (c = per-layer time), and at least its minimum (every inner stage >= 1
    layer; the first and last stage may be empty). The smallest feasible T is the smallest step point
    n c + e of that capacity function at which the capacities add up to the model's layers: it lies in
    [T_c, T_c + c) (T_c = the continuous optimum, total work / pp), so two candidates per rank kind suffice.
    The layers are then placed: the first and last rank keep their balanced count unless that would exceed
    their capacity, the inner ranks share the rest evenly. Layouts where this is not at least MIN_GAIN faster
    than the balanced split keep the balanced split."""
    pp, v = np.asarray(pp, float), np.asarray(v, float)
    vs = np.asarray(v_shape, bool)
    c = np.asarray(per_layer, float)
    e_f = embed + np.where(vs, head, 0.0)
    e_l = np.where(vs, 0.0, head)
    k_i = np.maximum(np.where(vs, pp - 1, pp - 2), 0.0)
    k_l = np.where(vs, 0.0, 1.0)
    lo_f = np.where(vs, 0.0, v - 1)  # the embedding stage may be empty, the rank's other chunks may not
    lo_i = np.where(vs, 2.0, v)
    lo_l = v - 1
    t_lo = np.maximum.reduce([lo_f * c + e_f, np.where(k_i > 0, lo_i * c, 0.0), np.where(k_l > 0, lo_l * c + e_l, 0.0)])

    def capacity(t):
        return _floor((t - e_f) / c) + k_i * _floor(t / c) + k_l * _floor((t - e_l) / c)

    t_c = (layers * c + e_f + k_l * e_l) / pp
    t_sum = np.full(t_c.shape, np.inf)
    for extra in (e_f, 0.0, e_l):
        step = np.ceil((t_c - extra) / c - EPS) * c + extra
        for cand in (step, step + c):
            t_sum = np.where(capacity(cand) >= layers, np.minimum(t_sum, cand), t_sum)
    t_best = np.maximum(t_lo, t_sum)

    cap_f, cap_i, cap_l = _floor((t_best - e_f) / c), _floor(t_best / c), _floor((t_best - e_l) / c)
    first = np.minimum(cap_f, balanced.first)
    last = np.where(k_l > 0, np.minimum(cap_l, balanced.last), 0.0)
    excess = np.maximum(layers - first - last - k_i * cap_i, 0.0)  # what the inner ranks cannot take
    add_f = np.minimum(excess, cap_f - first)
    first = first + add_f
    last = last + np.where(k_l > 0, np.minimum(excess - add_f, cap_l - last), 0.0)
    inner = np.where(k_i > 0, np.ceil((layers - first - last) / np.maximum(k_i, 1.0) - EPS), 0.0)
    chosen = Loads(first, np.where(vs, first, last), inner, np.zeros(first.shape, bool))

    t_bal = np.maximum.reduce(rank_times(balanced, pp, vs, c, embed, head))
    t_new = np.maximum.reduce(rank_times(chosen, pp, vs, c, embed, head))
    better = (pp > 1) & (t_new < t_bal * (1 - MIN_GAIN))
    pick = lambda a, b: np.where(better, a, b)  # noqa: E731
    return Loads(pick(chosen.first, balanced.first), pick(chosen.last, balanced.last),
                 pick(chosen.inner, balanced.inner), ~better)


def stage_split(layers: int, pp: int, v: int, v_shape: bool, first: int, last: int) -> tuple[int, ...]:
    """Per-stage layer counts for rank loads chosen by `best_loads`: the inner ranks share the remaining layers
    evenly; each rank spreads its layers evenly over its chunks, the chunk with the embedding or the head
    getting the smaller share (the others keep >= 1 layer, as the runtime requires)."""
    ranks = stage_ranks(pp, v, v_shape)
    head_rank = 0 if v_shape else pp - 1
    inner = [r for r in range(pp) if r not in (0, head_rank)]
    per_rank = {0: first, head_rank: last}
    rest = layers - first - (0 if head_rank == 0 else last)
    for i, r in enumerate(inner):
        per_rank[r] = rest // len(inner) + (1 if i < rest % len(inner) else 0)
    counts = [0] * len(ranks)
    special = {0, len(ranks) - 1}
    for r in range(pp):
        stages = [s for s, owner in enumerate(ranks) if owner == r]
        order = [s for s in stages if s not in special] + [s for s in stages if s in special]  # special ones last
        base, extra = divmod(per_rank[r], len(stages))
        for i, s in enumerate(order):
            counts[s] = base + (1 if i < extra else 0)
    return tuple(counts)


def describe(counts) -> str:
    """'[9, 10, 10, 7]'; runs of 3 or more equal counts folded: '[9, 10 x 14, 7]'."""
    parts, i = [], 0
    while i < len(counts):
        j = i
        while j < len(counts) and counts[j] == counts[i]:
            j += 1
        parts += [f"{counts[i]} x {j - i}"] if j - i >= 3 else [str(n) for n in counts[i:j]]
        i = j
    return "[" + ", ".join(parts) + "]"


def is_balanced(counts, layers: int) -> bool:
    return list(counts) == balanced_layers(layers, len(counts))


__all__ = ["Loads", "balanced_layers", "balanced_loads", "best_loads", "check_pp_layers", "describe", "is_balanced",
           "rank_loads", "rank_times", "stage_split"]
