"""Bytes per element of what the planner counts: bf16 activations and weights (2), low-precision matmul operands
(FP8 1, FP4 1/2, plus the MX formats' block scale) and their casts, Adam's state (fp32 master + m + v: 12; pure BF16
with stochastic rounding: 4) and the optimizer step's traffic. Gradients: Options.grad_bytes (4: fp32, Megatron's
main grads). No imports: every plan module may use these.
"""

BF16_BYTES = 2
FP8_BYTES = 1
FP8_CAST_BYTES = 5  # per element scaled to FP8: amax read (2), cast read (2) + write (1)
FP8_CAST_KERNELS = 8  # amax + cast for the input and the weight of each of the 4 layer matmuls
FP4_BYTES = 0.5
MX_BLOCK = 32  # elements sharing one 1-byte (E8M0) scale in the OCP MX formats (MXFP8, MXFP4)
WEIGHT_BYTES = 2
OPTIMIZER_BYTES = 12  # fp32 master weights + Adam m + v
ADAM_STEP_BYTES = 32  # per parameter per step: read p, g, m, v (fp32), write p, m, v, bf16 copy
# Pure BF16 training with stochastic rounding (Neuron's "Autocast:BF16+SR": XLA_USE_BF16=1 makes every fp32 tensor
# bf16, so the weights are their own master copy and Adam's m and v are bf16; Neuron docs: stochastic rounding
# "enables running at half precision speeds (BF16) while maintaining accuracy ... it also helps ... reduce memory
# footprint"): m + v, and per step read p, g, m, v and write p, m, v, all 2 bytes (Options.master_weights False)
BF16_OPTIMIZER_BYTES = 4
BF16_ADAM_STEP_BYTES = 14
