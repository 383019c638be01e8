#!/bin/bash
# Environment for paratrain on trn2.48xlarge / Trn2 UltraServers (and Trn3) with TorchNeuron, AWS's native PyTorch
# backend for Trainium2/3 (torch-neuronx 2.13.x for PyTorch 2.13, Neuron 2.33, public beta): `train.device =
# "neuron"` (or "auto"), process-group backend "neuron", one rank per logical NeuronCore (64 per trn2.48xlarge
# at the default LNC=2; `paratrain launch --nproc-per-node trn2.48xlarge` takes that from the hardware catalog).
# Source it on every node before `paratrain launch` (the sbatch recipe does: PARATRAIN_ENV=this file).
#
# Sources: AWS Neuron documentation, "How to use torch.distributed on Neuron" (torch/guides/torch-distributed,
# 2026-10-15: backend "neuron", EFA on every node for multi-node), "Logical NeuronCore configuration"
# (NEURON_LOGICAL_NC_CONFIG), "Troubleshooting: TorchTitan Neuron" (64 NeuronCores per trn2.48xlarge as
# --nproc_per_node; EFA and the rendezvous endpoint reachable from every node), EFA user guide (FI_* settings).
# Not a tested configuration: no Trainium machine was reachable when it was written (tests check its syntax).

# EFA through libfabric (trn2.48xlarge: 3.2 Tbps EFAv3).
export FI_PROVIDER=efa
export FI_EFA_USE_DEVICE_RDMA=1
export FI_EFA_FORK_SAFE=1

# Two physical NeuronCore-v3 per logical core: 4 logical cores per Trainium2, 64 per trn2.48xlarge (the
# catalog's device unit). Models must be compiled for the same LNC the runtime uses.
export NEURON_LOGICAL_NC_CONFIG=${NEURON_LOGICAL_NC_CONFIG:-2}
# 64 processes per node: cap glibc malloc arenas (Neuron examples do), or each reserves a lot of virtual memory.
export MALLOC_ARENA_MAX=${MALLOC_ARENA_MAX:-64}
