"""Mixed precision: `train.dtype = "bf16"` with `train.reduce_dtype = "fp32" | "bf16"`.

What every layout gets (the semantics torchtitan and Megatron-Core give their users):
- master weights and optimizer state in fp32: the parameters the optimizer steps (FSDP's sharded parameters,
  DDP/TP/PP replicas) stay fp32, and so do the gradients it reads and AdamW's m and v;
- compute in bf16: matmuls and attention run on bf16 copies of the weights, with fp32 accumulation inside the
  kernels; RMSNorm, rotary embedding and the loss upcast to fp32 explicitly (model/llama.py);
- gradient reduction over data parallelism (dp, and cp, whose ranks are data-parallel for the weights) in
  `reduce_dtype`: fp32 by default (torchtitan's `mixed_precision_reduce = "float32"`, Megatron's
  accumulate/all-reduce in fp32), bf16 halves that traffic (Megatron's `--grad-reduce-in-bf16`).

How each path does it:
- FSDP2 / HSDP (any layout whose dp x cp > 1 with dp_kind fsdp/hsdp, also per pipeline stage and over TP):
  `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=...)` on every `fully_shard` unit, as torchtitan. The
  all-gather moves bf16 (the cast happens on the shard, before the gather: half the bytes of the fp32 gather
  that autocast alone leaves), the unsharded bf16 copies are what forward and backward use, gradients are
  reduce-scattered in reduce_dtype and land in the fp32 sharded gradients. Microbatches accumulated without
  sync accumulate in reduce_dtype (FSDP2 keeps an accumulated gradient of that dtype).
- DDP (our bucketed reducer), single device, and TP / PP / CP without FSDP: `torch.autocast(bf16)`, which
  multiplies bf16 copies of the fp32 weights (cast once per forward and cached); gradients arrive in fp32 on
  the fp32 parameters, and the reducer casts each bucket to reduce_dtype for the all-reduce (pre-divided by
  the dp size in fp32 first, so a bf16 sum of n terms cannot overflow) and back. This is torchtitan's choice
  for DDP and single-device runs (autocast); for TP/PP without FSDP torchtitan turns mixed precision off, we
  keep autocast so that bf16 means bf16 compute on every layout. Megatron instead keeps bf16 parameters with
  fp32 "main" copies in the optimizer; autocast gives the same arithmetic for the matmuls without a second
  copy of the model in the optimizer, at the cost of an fp32 residual stream (see below).
- autocast stays on under FSDP too: with bf16 parameters it changes nothing for matmuls, and it keeps the
  op-level policy the same on every path.

Known difference between the paths: under FSDP the embedding's output, and so the residual stream between
blocks (and what pipeline stages send), is bf16, as in torchtitan and Megatron; under autocast alone the
residual stream stays fp32 (the embedding weight is fp32). Both are within the bf16 tolerance of the fp32
reference (tests/test_precision.py states and derives it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Precision:
    compute: torch.dtype = torch.float32
    reduce: torch.dtype = torch.float32

    @classmethod
    def from_train(cls, train) -> Precision:
        """From the [train] section (dtype, reduce_dtype)."""
        return cls(DTYPES[train.dtype], DTYPES[train.reduce_dtype])

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return None if self.compute == torch.float32 else self.compute

    def fsdp_policy(self):
        """The FSDP2 MixedPrecisionPolicy, or None for fp32 (FSDP's default: no casts)."""
        if self.compute == torch.float32 and self.reduce == torch.float32:
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.compute, reduce_dtype=self.reduce)


FP32 = Precision()


BF16_UNIT_ROUNDOFF = 2.0**-8  # 8 significant bits (7 stored + the implicit one)
BF16_ROUNDINGS_PER_BLOCK = 8  # along a block's forward path: q/k/v, output, gate/up, down inputs, attention, SwiGLU


def bf16_rtol(layers: int) -> dict[str, float]:
    """Relative error of one bf16 step against fp32 that rounding alone explains (tests/test_precision.py):
    n_fwd = 8 L + 2 bf16 roundings along the forward path (2 for the head), twice that along the backward;
    with independent errors the relative error grows like sqrt(n) u (Higham & Mary's probabilistic bound).
    loss: sqrt(n_fwd) u, gradients (relative L2 per tensor, or their global norm): sqrt(2 n_fwd) u."""
    n_fwd = BF16_ROUNDINGS_PER_BLOCK * layers + 2
    return {"loss": n_fwd**0.5 * BF16_UNIT_ROUNDOFF, "grad": (2 * n_fwd) ** 0.5 * BF16_UNIT_ROUNDOFF}
