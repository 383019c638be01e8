"""Time of one kernel on one device: a matmul (a soft roofline of its compute and its operand traffic, the
systolic engine's whole tiles, FP8/FP4 peaks and operand bytes, the casts to them) and a memory-bound kernel.
"""

from __future__ import annotations

import numpy as np

from paratrain.hardware.catalog import System
from paratrain.plan.options import Options
from paratrain.plan.precision import (
    BF16_BYTES,
    FP4_BYTES,
    FP8_BYTES,
    FP8_CAST_BYTES,
    FP8_CAST_KERNELS,
    MX_BLOCK,
)

ROOFLINE_SHARPNESS = 2.0


def soft_roofline(compute_s, memory_s):
    """max(compute, memory) smoothed: (c^k + m^k)^(1/k), k = 2. A kernel near the ridge point cannot overlap
    its loads and its math perfectly; far from it the result is the plain roofline."""
    k = ROOFLINE_SHARPNESS
    return (compute_s**k + memory_s**k) ** (1.0 / k)


def matmul_time_s(system: System, m, n, k, fp8: bool = False, opts: Options | None = None, extra_bytes=0.0):
    """One matmul: a soft roofline of compute (matmul_eff_max of peak) and operand traffic (memory_bw_eff of
    HBM bandwidth), plus the fixed per-kernel cost (launch, pipeline fill, tail wave; measured to fit better
    added than as a floor, see docs/planner.md) that makes small matmuls inefficient. fp8: the operands are
    low-precision (1-byte FP8, or 1/2-byte FP4 plus one scale byte per 32 with opts.fp4) and the tensor cores
    run at that format's peak (the output stays BF16). extra_bytes: HBM traffic beyond that (an output read back
    to accumulate into, plan.moe.wgrad_accumulate_s)."""
    eff = system.chip.efficiency
    flops = 2.0 * m * n * k
    in_bytes = low_precision_bytes(system, opts or Options(fp8=fp8)) if fp8 else BF16_BYTES
    traffic = in_bytes * (m * k + k * n) + BF16_BYTES * m * n + extra_bytes
    peak = low_precision_flops(system, opts or Options(fp8=True)) if fp8 else system.device_peak_flops
    mm_eff = opts.matmul_eff if opts is not None and opts.matmul_eff is not None else eff.matmul_eff_max
    if fp8 and mxfp8(system, opts or Options(fp8=True)):
        mm_eff = mm_eff * eff.block_scaled_matmul_eff  # the block scales the tensor cores load (catalog source)
    compute = flops * matmul_tile_factor(system, m, n, k) / (peak * mm_eff)
    memory = traffic / (system.device_hbm_bw_bytes_per_s * eff.memory_bw_eff)
    return soft_roofline(compute, memory) + eff.kernel_overhead_s


def matmul_tile_factor(system: System, m, n, k):
    """Work a systolic matrix engine does for an m x k by k x n GEMM over what the GEMM needs: its dimensions run in
    whole tiles (chip.matmul_tile; 1 where the chip sets none). Trainium's TensorEngine contracts at most 128 partitions
    per instruction against a stationary tile of at most 128 columns while at most 512 moving columns stream through
    (NKI architecture guide, trainium_inferentia2_arch.rst; nki.isa.nc_matmul), so k rounds up to 128 and the two
    output dimensions to 128 and 512, whichever way round wastes less (the compiler picks the stationary operand).
    Backward's GEMMs are counted at the forward's factor (their contraction is one of these dimensions)."""
    tile, moving = system.chip.matmul_tile, system.chip.matmul_moving_tile
    if not tile:
        return 1.0

    def up(x, t):
        x = np.maximum(np.asarray(x, dtype=float), 1.0)
        return np.ceil(x / t) * t / x
    return up(k, tile) * np.minimum(up(n, tile) * up(m, moving), up(m, tile) * up(n, moving))


def flash_causal_fraction(seq, key_tile):
    """Fraction of the seq x seq score square a causal flash-attention kernel works through when it blocks the keys
    key_tile at a time and skips a block only where all of it lies above the diagonal (its first key after the query
    tile's first query; query tiles divide key tiles): of the seq / key_tile key blocks, query tile i runs the
    floor(i / r) + 1 up to and including the diagonal one whole, (n + 1) / 2n of the square for n = ceil(seq /
    key_tile), 1/2 + key_tile / (2 seq). key_tile 0: a kernel whose blocks are small against the sequence, 1/2."""
    if not key_tile:
        return 0.5
    blocks = np.ceil(np.asarray(seq, dtype=float) / key_tile)
    return (blocks + 1.0) / (2.0 * blocks)


def device_fp8_flops(system: System) -> float:
    """FP8 peak of one device (the BF16 peak where the chip lists no faster FP8 rate)."""
    fp8 = system.chip.fp8_tflops
    return max(system.device_peak_flops, (fp8 or 0.0) * 1e12 / system.devices_per_chip)


def low_precision_flops(system: System, opts: Options) -> float:
    """Peak of one device for the layer matmuls' format: FP4 (falling back to FP8, then BF16, where the chip
    lists no faster rate) or FP8; the BF16 rate for per-tensor FP8 on a chip whose fast rates are MX-only."""
    if system.chip.fp8_block_scaled and not block_scaled(system, opts):
        return system.device_peak_flops  # Trainium3: only the MX formats get the faster rate (NC-v4)
    if opts.fp4 and system.chip.fp4_tflops:
        return max(device_fp8_flops(system), system.chip.fp4_tflops * 1e12 / system.devices_per_chip)
    return device_fp8_flops(system)


def block_scaled(system: System, opts: Options) -> bool:
    """Whether the low-precision formats carry a scale per MX_BLOCK elements (FP4 always does)."""
    if opts.fp4:
        return True
    return system.chip.fp8_block_scaled if opts.block_scaling is None else opts.block_scaling


def mxfp8(system: System, opts: Options) -> bool:
    """Whether the layer matmuls run in a block-scaled 8-bit format (MXFP8): the format
    chip.efficiency.block_scaled_matmul_eff describes (FP4's own peak already is a block-scaled rate)."""
    return bool(opts.fp8 and not opts.fp4 and block_scaled(system, opts))


def fp8_copies(system: System, opts: Options) -> int:
    """Low-precision copies Transformer Engine makes of an operand used both ways round (an input X: the forward
    GEMM and the weight gradient's; a weight: the forward and dgrad; an output gradient: dgrad and wgrad). A
    block-scaled tensor has its scales along the contraction dimension, so the transposed GEMM needs a copy scaled
    the other way, quantized from the BF16 source in the same pass (TE common/cast mxfp8_quantize:
    use_rowwise_scaling = output->has_data(), use_colwise_scaling = output->has_columnwise_data(); one kernel
    reads the tile once and writes both); a per-tensor-scaled one needs a transposed copy only where FP8 GEMMs
    run TN-only (Hopper; chip.fp8_any_layout)."""
    if block_scaled(system, opts):
        return 2
    return 1 if system.chip.fp8_any_layout else 2


def low_precision_bytes(system: System, opts: Options) -> float:
    """Bytes per element of a low-precision matmul operand, its block scale included."""
    element = FP4_BYTES if opts.fp4 else FP8_BYTES
    return element + (1.0 / MX_BLOCK if block_scaled(system, opts) else 0.0)


def cast_cost(system: System, opts: Options) -> tuple[float, int]:
    """(HBM bytes per element, kernels per layer) of scaling and casting the layer matmuls' activation operands.
    Per-tensor current scaling reads the tensor once for its amax and once to cast (2 + 2 + 1 bytes, two kernels
    per operand); block scaling finds each block's scale while casting, one kernel per operand that reads the BF16
    tensor once and writes both its copies (fp8_copies), each element with its share of the scales: 2 + 2 x
    (1 + 1/32) bytes for MXFP8 (Transformer Engine quantizes a Linear's input with
    set_usage(rowwise=True, columnwise=backward_needs_input) and its output gradient for dgrad and wgrad)."""
    if block_scaled(system, opts):
        return BF16_BYTES + fp8_copies(system, opts) * low_precision_bytes(system, opts), FP8_CAST_KERNELS // 2
    return float(FP8_CAST_BYTES), FP8_CAST_KERNELS


def weight_cast_bytes(system: System, opts: Options) -> float:
    """HBM bytes per parameter of casting a cached weight once a step: the activations' cast (cast_cost), plus,
    for a per-tensor-scaled weight on a TN-only chip, the transposed copy it writes (Hopper: TE's cast-transpose)."""
    extra = 0.0 if block_scaled(system, opts) else (fp8_copies(system, opts) - 1) * low_precision_bytes(system, opts)
    return cast_cost(system, opts)[0] + extra


def memory_time_s(system: System, nbytes, kernels):
    eff = system.chip.efficiency
    return nbytes / (system.device_hbm_bw_bytes_per_s * eff.memory_bw_eff) + kernels * eff.kernel_overhead_s
