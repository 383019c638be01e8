"""Time of collectives and point-to-point sends over a system's interconnect tiers: hierarchical rings level by
level, the share of a 2D torus's links a ring drives, ring or tree latency steps, ranks time-sharing a core, and
the latency of an all-reduce of a few bytes (NCCL's tree / LL model).
Used by the training step, the MoE all-to-all, the serving model and the calibrator's link fit.
"""

from __future__ import annotations

import math

import numpy as np

from paratrain.hardware.catalog import System
from paratrain.plan.numeric import select

# NCCL's LL128 protocol carries 120 data bytes in each 128-byte line: its ring bandwidth is 0.92 of Simple's
# (src/graph/tuning.cc: `busBw * (0.92 /*120.0/128.0*/)`)
LL128_BW_RATIO = 0.92
# NCCL's latency model of a tree all-reduce with the LL protocol, what its tuner picks for a message of a few hundred
# bytes (src/graph/tuning.cc, v2.22.3: baseLat[Tree][LL] = 6.8 us; hwLat[NVLINK][Tree][LL] = 0.6 us and
# hwLat[NET][Tree][LL] = 5.0 us per hop; latency = baseLat + 2 x ((nRanks/nNodes - 1) x intraLat + log2i(nNodes) x
# interLat))
NCCL_TREE_LL_BASE_US = 6.8
NCCL_TREE_LL_NVLINK_US = 0.6
NCCL_TREE_LL_NET_US = 5.0
# NCCL's NVLS (NVLink SHARP) all-reduce inside one NVLink domain (src/graph/tuning.cc @5067397: latency =
# hwLat[NVLINK][NVLS][Simple] = 25 us, baseLat 0; one NVLS channel per GPU of the domain up to
# NCCL_MAX_NVLS_ARITY = 32, src/include/device.h, search.cc ncclTopoCompute)
NCCL_NVLS_LATENCY_US = 25.0
NCCL_MAX_NVLS_ARITY = 32


def collective_time_s(system: System, kind: str, nbytes, degree, stride, inner=None, outer_stride=None, nvls=False):
    """Time of a hierarchical ring collective over a group of `degree` ranks spaced `stride` apart.

    A group with stride s has D // s members inside a domain of D devices (ranks numbered in
    parallel.rank_order, paratrain.config.ranks: the stride is the product of the degrees inside the group's
    dimension). A group of two dimensions the order keeps apart (dp x cp in tp-cp-pp-dp) is `inner` members
    `stride` apart, repeated every `outer_stride` (config.ranks.group_geometry): clip(D // stride, 1, inner) x
    clip(D // outer_stride, 1, degree / inner) members inside the domain; inner None: one run. Level by level from the innermost tier: reduce-scatter inside the domain, the
    next level works on 1/n of the data, then all-gather back (the all-reduce = RS + AG of Thakur et al. 2005
    ring costs: 2(n-1)/n * bytes / bw; RS or AG alone (n-1)/n * bytes / bw). nbytes is the full buffer
    (all-reduce input, all-gather output, reduce-scatter input). Latency: min(n-1, 2 log2 n) steps per level
    (ring for small groups, tree-like for large ones, as NCCL/Neuron pick), plus the link's fixed
    collective_overhead_us per level (launch and synchronisation of one collective call). Where ranks
    time-share cores (a CPU host running more ranks than cores), each step also waits for the next rank to be
    scheduled: + (ranks per core - 1) x timeshare_step_us per step, and each rank gets 1/(ranks per core)
    of a core to copy and reduce with (bandwidth divided alike). NCCL's all-gather / reduce-scatter ring is timed
    with each protocol it may pick and the faster one kept, as its tuner picks (src/graph/tuning.cc): Simple (the
    links' latency_us) or, where every link the group crosses runs it (Interconnect.ll128_latency_us > 0), LL128,
    whose steps are shorter and whose bandwidth is LL128_BW_RATIO of Simple's. All-reduce keeps one latency (its
    tree / ring step count already takes the cheaper algorithm; the LL protocols of small all-reduces are not
    modelled). nvls: the stack leaves NCCL's NVLS on, so an all-reduce inside one NVLink domain whose switch
    reduces (Interconnect.nvls_bw_eff) takes the faster of the ring and NVLS (nvls_allreduce_s), as NCCL's tuner
    picks.
    """
    if nvls and kind == "allreduce":
        ring = collective_time_s(system, kind, nbytes, degree, stride, inner, outer_stride)
        return np.minimum(ring, nvls_allreduce_s(system, nbytes, degree, stride))
    factor = {"allreduce": 2.0, "allgather": 1.0, "reducescatter": 1.0}[kind]
    if np.ndim(nbytes) == np.ndim(degree) == np.ndim(stride) == np.ndim(inner) == np.ndim(outer_stride) == 0:
        try:
            return np.float64(_collective_scalar_s(system, kind, factor, float(nbytes), float(degree), float(stride),
                                                   None if inner is None else float(inner),
                                                   None if outer_stride is None else float(outer_stride)))
        except ZeroDivisionError:  # a zero bandwidth: numpy's inf below
            pass
    nbytes = np.asarray(nbytes, dtype=float)
    degree = np.asarray(degree, dtype=float)
    stride = np.asarray(stride, dtype=float)
    if inner is not None:  # a sub-group (HSDP's shards) of a run is one run: inner no more than the degree
        inner = np.minimum(np.asarray(inner, dtype=float), degree)
    total = np.zeros(np.broadcast(nbytes, degree, stride).shape)
    inside_prev = np.ones_like(total)
    share = timesharing_ranks(system)
    ring_only_gathers = system.chip.vendor == "nvidia"
    ll128 = ring_only_gathers and kind != "allreduce"  # NCCL's LL128 alternative for its flat rings (below)
    total_ll128, ll128_ok = np.zeros_like(total), np.ones(total.shape, dtype=bool)
    moved = np.zeros_like(total)  # the node's levels' bandwidth terms, against the chip's reduction rate (below)
    in_node = np.ones_like(total)  # the group's members inside one node
    for tier in system.tiers:
        if tier.domain_devices and inner is not None:
            inside = (np.clip(np.floor(tier.domain_devices / stride), 1.0, inner)
                      * np.clip(np.floor(tier.domain_devices / outer_stride), 1.0, degree / inner))
        elif tier.domain_devices:
            inside = np.clip(np.floor(tier.domain_devices / stride), 1.0, degree)
        else:
            inside = degree * np.ones_like(total)
        n = inside / inside_prev
        data = nbytes / inside_prev
        bw = tier.per_device_bw_bytes_per_s(system) * torus_link_fraction(system, tier, inside, stride)
        # all-reduce: NCCL and Neuron pick ring (n-1 steps per phase) or tree / recursive halving-doubling
        # (log2 n) whichever is cheaper; all-gather and reduce-scatter: NCCL runs them as rings only (no tree:
        # src/graph/tuning.cc counts nsteps = nRanks - 1), Neuron also has recursive doubling-halving for them
        # (Neuron docs, "Inter-node Collectives": ring, mesh and RDH); NCCL's ring is flat (flat_ring_steps)
        steps = ring_steps(n) if kind == "allreduce" or not ring_only_gathers \
            else flat_ring_steps(n, degree / np.maximum(inside, inside_prev))
        link = tier.interconnect
        step_s = (link.latency_us + (share - 1) * link.timeshare_step_us) * 1e-6
        level = factor * ((n - 1) / n * data * share / bw + steps * step_s) + link.collective_overhead_us * 1e-6
        total = total + np.where(n > 1, level, 0.0)
        if tier.domain_devices:  # inside a node: where Neuron's intra-node algorithms reduce (reduction_bound_s)
            moved = moved + np.where(n > 1, factor * (n - 1) / n * data * share / bw, 0.0)
            in_node = np.maximum(inside, inside_prev)
        if ll128:
            level = factor * ((n - 1) / n * data / (bw * LL128_BW_RATIO) + steps * link.ll128_latency_us * 1e-6) \
                + link.collective_overhead_us * 1e-6
            total_ll128 = total_ll128 + np.where(n > 1, level, 0.0)
            ll128_ok = ll128_ok & ((n <= 1) | (link.ll128_latency_us > 0))
        inside_prev = np.maximum(inside, inside_prev)
    total = total + np.maximum(reduction_bound_s(system, kind, nbytes, in_node, stride) - moved * reduced_share(kind),
                               0.0)
    return np.where(ll128_ok, np.minimum(total, total_ll128), total) if ll128 else total


def _collective_scalar_s(system: System, kind: str, factor: float, nbytes: float, degree: float, stride: float,
                         inner: float | None = None, outer_stride: float | None = None):
    """collective_time_s for one group: the same operations in the same order on Python floats (bitwise the same
    result), without numpy's overhead on 0-d arrays (~60 us a call; a calibration fit or a layout search makes
    ~10^5 calls)."""
    total, inside_prev = 0.0, 1.0
    inner = None if inner is None else min(inner, degree)
    share = timesharing_ranks(system)
    ring_only_gathers = system.chip.vendor == "nvidia"
    ll128 = ring_only_gathers and kind != "allreduce"
    total_ll128, ll128_ok = 0.0, True
    moved, in_node = 0.0, 1.0
    for tier in system.tiers:
        inside = min(max(float(math.floor(tier.domain_devices / stride)), 1.0), degree) if tier.domain_devices \
            else degree
        if tier.domain_devices and inner is not None:
            inside = (min(max(float(math.floor(tier.domain_devices / stride)), 1.0), inner)
                      * min(max(float(math.floor(tier.domain_devices / outer_stride)), 1.0), degree / inner))
        n = inside / inside_prev
        data = nbytes / inside_prev
        bw = tier.per_device_bw_bytes_per_s(system) * float(torus_link_fraction(system, tier, inside, stride))
        if kind == "allreduce" or not ring_only_gathers:
            steps = min(n - 1.0, 2.0 * math.ceil(math.log2(max(n, 1.0))))  # ring_steps
        else:
            steps = flat_ring_steps(n, degree / max(inside, inside_prev))
        link = tier.interconnect
        step_s = (link.latency_us + (share - 1) * link.timeshare_step_us) * 1e-6
        if n > 1:
            total = total + (factor * ((n - 1) / n * data * share / bw + steps * step_s)
                             + link.collective_overhead_us * 1e-6)
            if tier.domain_devices:  # inside a node (reduction_bound_s)
                moved = moved + factor * (n - 1) / n * data * share / bw
                in_node = max(inside, inside_prev)
            if ll128:
                total_ll128 = total_ll128 + (factor * ((n - 1) / n * data / (bw * LL128_BW_RATIO)
                                                       + steps * link.ll128_latency_us * 1e-6)
                                             + link.collective_overhead_us * 1e-6)
                ll128_ok = ll128_ok and link.ll128_latency_us > 0
        inside_prev = max(inside, inside_prev)
    total = total + max(float(reduction_bound_s(system, kind, nbytes, in_node, stride)) - moved * reduced_share(kind),
                        0.0)
    return min(total, total_ll128) if ll128 and ll128_ok else total


def reduced_share(kind: str) -> float:
    """Share of a collective's link time that carries the data it reduces: an all-reduce's reduce-scatter half, a
    reduce-scatter all of it (its all-gather half reduces nothing)."""
    return 0.5 if kind == "allreduce" else 1.0


def reduction_bound_s(system: System, kind: str, nbytes, degree, stride=1.0):
    """Least time the reducing part of an all-reduce or reduce-scatter, over the `degree` ranks `stride` apart that it
    has inside a node (its intra-node levels reduce the whole buffer; the levels across nodes work on a share), takes where
    the chip reduces collectives at a rate of its own (chip.reduce_gbytes_per_s, per device: NeuronCores before v4
    reduce through their DMA engines' collective compute at half the copy rate, nki/guides/architecture/
    trainium3_arch.rst): the bytes each rank reduces at that rate. A group holding every core of the chips it spans
    runs Neuron's KangaRing, whose primary core reduces each chunk once per chip, its own, its secondary's and the
    partial sum it receives together, the two cores taking turns over the torus's two cycles (neuron-runtime/
    explore/intranode-collective-comm.rst): each core reduces nbytes / cores of the chip; a group of one rank per
    chip runs a flat ring, each rank reducing (n - 1)/n of the buffer. The links' model holds where it is slower;
    an all-gather reduces nothing (0)."""
    rate = system.chip.reduce_gbytes_per_s
    if not rate or kind == "allgather":
        return np.zeros(np.broadcast(np.asarray(nbytes), np.asarray(degree)).shape) if np.ndim(nbytes) or \
            np.ndim(degree) else 0.0
    degree, per_chip = np.asarray(degree, dtype=float), float(system.devices_per_chip)
    whole_chips = (np.asarray(stride, dtype=float) == 1.0) & (degree >= per_chip)
    share = np.where(whole_chips, 1.0 / per_chip, (degree - 1) / np.maximum(degree, 1.0))
    return np.where(degree > 1, share * np.asarray(nbytes, dtype=float) / (rate * 1e9), 0.0)


# CTAs (one per channel, each holding an SM) an NCCL ring collective of bulk size runs on (enqueue.cc: a collective
# gets comm->nChannels, trimmed only for small messages): the ring graph's search channels doubled (search.cc
# ncclTopoCompute dupChannels = min(2 x nChannels, maxChannels)), as NCCL's INFO logs print them: 24 on one DGX-class
# H100 node (NVIDIA developer forum "Compute-Communication Overlap Causes Severe GEMM Performance Degradation because
# of Tail Effect", 2025: FSDP's ncclAllGather launches 24 blocks on a 132-SM H100), 16 once the ring leaves the node
# over 8 NIC rails (NVIDIA/nccl#1453: "16 coll channels" on H100 nodes at 24 ranks; one search channel per NIC, doubled)
NCCL_RING_CTAS_NVLINK = 24
NCCL_RING_CTAS_NET = 16


def comm_sm_fraction(system: System, degree, stride):
    """Fraction of a chip's SMs an NCCL collective over `degree` ranks `stride` apart holds while it runs (its
    CTAs over the chip's SMs, cores_per_chip): the compute it overlaps runs on the rest (overlapped_exposed_s).
    Only NVIDIA chips: Neuron's collectives run on their own DMA / collective engines, none of the compute's (0)."""
    if system.chip.vendor != "nvidia":
        return np.zeros(np.broadcast(np.asarray(degree), np.asarray(stride)).shape)
    span = np.asarray(degree, dtype=float) * np.asarray(stride, dtype=float)
    ctas = np.where(span <= system.devices_per_node, NCCL_RING_CTAS_NVLINK, NCCL_RING_CTAS_NET)
    return np.where(np.asarray(degree) > 1, ctas / system.chip.cores_per_chip, 0.0)


def overlapped_exposed_s(comm, window, sm_fraction):
    """Time `comm` of communication adds to `window` of compute it overlaps, where its kernels hold `sm_fraction`
    f of the SMs: the compute runs at 1 - f while the communication runs, so the pair takes max(C, X + f C) and
    adds max(C - X, f C); with no window the communication is exposed whole. The one rule of the data-parallel
    overlap (plan.data_parallel) and of the MoE all-to-all (plan.moe.exposed_alltoall)."""
    comm, window = np.asarray(comm, dtype=float), np.asarray(window, dtype=float)
    return np.maximum(comm - window, np.where(window > 0, sm_fraction * comm, comm))


def nvls_allreduce_s(system: System, nbytes, degree, stride):
    """NCCL's NVLS all-reduce of a group inside the first tier's NVLink domain (inf where the group leaves it or
    its switch has no NVLS): the switch reduces the loads and multicasts the stores, so each GPU moves
    (n - 1)/n of the buffer each way once at nvls_bw_eff x (c - 1)/c of its link, c = min(32, n) channels, plus
    NCCL's 25 us (tuning.cc: busBw = c x bwIntra x nvlsEfficiency x (c - 1)/c x 2, over 2(n - 1)/n)."""
    tier = system.tiers[0]
    link = tier.interconnect
    n = np.asarray(degree, dtype=float)
    inside = (n * np.asarray(stride, dtype=float) <= tier.domain_devices) | (tier.domain_devices == 0)
    if link.nvls_bw_eff <= 0 or system.chip.vendor != "nvidia":
        return np.full(np.broadcast(np.asarray(nbytes), n).shape, np.inf)
    channels = np.minimum(float(NCCL_MAX_NVLS_ARITY), np.maximum(n, 2.0))
    bw = tier.per_device_bw_bytes_per_s(system) * link.nvls_bw_eff * (channels - 1) / channels
    t = (n - 1) / np.maximum(n, 1.0) * np.asarray(nbytes, dtype=float) / bw \
        + (NCCL_NVLS_LATENCY_US + link.collective_overhead_us) * 1e-6
    return np.where(inside & (n > 1), t, np.inf)


def torus_link_fraction(system: System, tier, members, stride):
    """Share of a 2D-torus tier's links (Interconnect.torus_links_per_chip, 0: a switched fabric, all of them)
    that a ring collective over `members` ranks `stride` apart can drive. Neuron runs "multiple cycles with
    mutually exclusive wires in parallel for full wire bandwidth", and "when using all 16 Neuron Devices, there
    are 2 non-overlapping Hamiltonian cycles on 2D Torus" (Neuron docs, neuron-runtime/explore/
    intranode-collective-comm.rst): a group covering every chip of the torus uses all 4 links of a chip; a group
    on fewer chips (a row or a 2 x k block of the 4 x 4 torus, with at most 3 neighbours in the group) has one
    such cycle, 2 links; two chips share one link."""
    links = tier.interconnect.torus_links_per_chip
    if not links:
        return 1.0
    per_chip = system.devices_per_chip
    chips = np.minimum(members, np.maximum(1.0, members * np.asarray(stride, dtype=float) / per_chip))
    used = select([chips >= tier.domain_devices / per_chip, chips >= 3], [links, 2.0], 1.0)
    return np.minimum(used, links) / links


def flat_ring_steps(n, domains):
    """Latency-bound steps of an NCCL ring all-gather / reduce-scatter at one tier: NCCL runs them as one flat ring
    over all the group's ranks, nRanks - 1 steps, nNodes - 1 of them over the network and the rest over NVLink
    (src/graph/tuning.cc: latency = baseLat + (nsteps - nInterSteps) x intraLat + nInterSteps x interLat, nsteps =
    nRanks - 1, nInterSteps = nNodes - 1). Per tier: its n - 1 hops inside each of the `domains` domains of that tier
    the group spans (the ring passes through every one of them), not once as a hierarchical ring would."""
    return domains * (n - 1.0)


def ring_steps(n):
    """Latency-bound steps of one collective phase over n ranks: a ring's n - 1 for small groups, a tree's
    2 log2 n for large ones (NCCL and Neuron pick the cheaper)."""
    n = np.asarray(n, dtype=float)
    return np.minimum(n - 1.0, 2.0 * np.ceil(np.log2(np.maximum(n, 1.0))))


def tiny_allreduce_s(system: System, ranks):
    """Time of an all-reduce of a few hundred bytes over `ranks` consecutive ranks (every device of a node in the
    group once it spans nodes): latency only. NVIDIA: NCCL's own model of the tree / LL all-reduce its tuner picks
    for such a message (NCCL_TREE_LL_*); elsewhere the ring/tree model of collective_time_s on 1 KiB."""
    ranks = np.asarray(ranks, dtype=float)
    if system.chip.vendor != "nvidia":
        return collective_time_s(system, "allreduce", 1024.0, ranks, 1.0)
    per_node = np.minimum(ranks, float(system.devices_per_node))
    nodes = ranks / per_node
    hops = (per_node - 1.0) * NCCL_TREE_LL_NVLINK_US + np.floor(np.log2(np.maximum(nodes, 1.0))) * NCCL_TREE_LL_NET_US
    return np.where(ranks > 1, (NCCL_TREE_LL_BASE_US + 2.0 * hops) * 1e-6, 0.0)


def timesharing_ranks(system: System) -> float:
    """Ranks that take turns on one core: more than 1 only where devices outnumber the chip's cores (a CPU host
    described by `paratrain probe`, sized for more ranks than cores); accelerator devices never time-share."""
    return max(1.0, system.devices_per_chip / system.chip.cores_per_chip)


def p2p_time_s(system: System, nbytes, stride, ranks=2):
    """Point-to-point send between ranks `stride` apart (pipeline neighbours, a CP ring's hops) in a chain or ring of
    `ranks` members: over the innermost tier whose domain holds the whole group (stride x ranks devices), at the
    per-device bandwidth of that tier (all boundary ranks send at once). Where the group spans domains, some of its
    hops cross them (pipeline stages 16 apart on 32-device nodes: every other stage boundary leaves the node), and
    a pipeline or a ring runs at the pace of its slowest hop."""
    nbytes = np.asarray(nbytes, dtype=float)
    span = np.asarray(stride, dtype=float) * np.maximum(np.asarray(ranks, dtype=float), 2.0)
    time = None
    for tier in reversed(system.tiers):
        bw = tier.per_device_bw_bytes_per_s(system)
        link = tier.interconnect
        share = timesharing_ranks(system)
        t = (nbytes * share / bw
             + (link.latency_us + (share - 1) * link.timeshare_step_us + link.collective_overhead_us) * 1e-6)
        time = t if time is None else np.where(span <= tier.domain_devices, t, time)
    return time
