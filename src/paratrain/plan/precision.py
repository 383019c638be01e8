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
# Apex DistributedFusedAdam's state per parameter, by what NeMo's distributed_fused_adam asks it to keep (the csv
# column optimizer_dtype, Software.optimizer_state, Options.optimizer_state_bytes). Apex
# apex/contrib/optimizers/distributed_fused_adam.py StateBucket: exp_avg_shard and exp_avg_sq_shard in the optimizer
# dtype, params_shard (a master copy) in that dtype when store_params, an int16 param_remainders_shard when
# store_param_remainders (the low 16 bits of the fp32 value whose high 16 bits are the bf16 weight). NeMo v2.0.0
# (nemo:24.09) MegatronBaseModel.setup_optimization picks them where the config does not: fp8_params -> store_params;
# optimizer dtype = model dtype -> no master; fp32 optimizer over bf16 weights -> store_param_remainders.
OPTIMIZER_STATE_BYTES = {
    "fp32": OPTIMIZER_BYTES,  # fp32 master, m, v (store_params; fp8_params with the default fp32 dtype)
    "fp32_remainders": 2 + 8,  # int16 remainders, fp32 m, v (bf16 weights, dtype fp32: NeMo's default)
    "bf16_master": 2 + 4,  # bf16 master, bf16 m, v (fp8_params with optim.dtype bf16)
    "bf16": BF16_OPTIMIZER_BYTES,  # bf16 m, v, no master (optim.dtype bf16 = the bf16 model's dtype)
}
BF16_ADAM_STEP_BYTES = 14
