#!/bin/bash
# Environment for torchrun jobs on trn1.32xlarge / trn1n.32xlarge (16 Trainium chips = 32 NeuronCores per node;
# 8 EFA devices on trn1.32xlarge, 16 on trn1n.32xlarge).
#
# IMPORTANT: Trn1 is served by the older XLA-based torch-neuronx path, not by TorchNeuron (AWS's native PyTorch
# backend, Trainium2/3 only), so `paratrain train` does not run on trn1 NeuronCores; for trn1 paratrain plans,
# estimates and simulates (`paratrain plan --hardware trn1.32xlarge ...`). Trn2/Trn3 run with train.device =
# "neuron": see recipes/aws/trn2-neuron.env.sh and recipes/slurm/paratrain-trainium.sbatch. This file records the
# node settings a trn1 Neuron torchrun job uses; it is not a tested configuration.
#
# Sources: AWS Neuron documentation, "How to prepare trn1.32xlarge for multi-node execution" (EFA setup) and the
# Neuron Runtime environment-variable reference (NEURON_RT_*); torch-neuronx multi-node training tutorials
# (torchrun --nproc_per_node=32 per trn1.32xlarge, FI_* and NEURON_RT_ROOT_COMM_ID settings).

# EFA through libfabric, as for GPUs.
export FI_PROVIDER=efa
export FI_EFA_USE_DEVICE_RDMA=1
export FI_EFA_FORK_SAFE=1

# Neuron runtime: the collectives bootstrap goes to the first node (MASTER_ADDR from the scheduler: on Slurm the
# first host of `scontrol show hostnames`); one process per NeuronCore, 32 per trn1.32xlarge.
export NEURON_RT_ROOT_COMM_ID=${MASTER_ADDR:?set MASTER_ADDR to the first node}:46820
export NEURON_RT_NUM_CORES=${NEURON_RT_NUM_CORES:-32}
# Interface for Neuron collectives' bootstrap sockets (EKS pods: eth0).
export CCOM_SOCKET_IFNAME=${CCOM_SOCKET_IFNAME:-eth0}
# Neuron examples cap glibc malloc arenas: 32 processes per node otherwise reserve a lot of virtual memory.
export MALLOC_ARENA_MAX=64
