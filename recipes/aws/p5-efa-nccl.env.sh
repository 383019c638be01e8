#!/bin/bash
# Environment for paratrain (NCCL over EFA) on p5.48xlarge: 8 x H100 per node, 32 EFA interfaces (3,200 Gbps).
# Source it before `paratrain launch` (the Slurm recipe does with PARATRAIN_ENV=recipes/aws/p5-efa-nccl.env.sh;
# on EKS put the same pairs in the container's env). Needs the EFA installer's libfabric and the aws-ofi-nccl
# plugin on the nodes (the AWS Deep Learning AMI and the ParallelCluster/EKS GPU AMIs ship both).
#
# Sources: AWS EFA user guide (libfabric provider "efa", GPUDirect RDMA on p4d/p5); the aws-ofi-nccl plugin's
# environment-variable reference; torchtitan's multinode_trainer.slurm "optimized for AWS with EFA"
# (NCCL_BUFFSIZE, FI_EFA_SET_CUDA_SYNC_MEMOPS). Values are starting points: check NCCL's log line
# "NET/OFI Selected Provider is efa" with NCCL_DEBUG=INFO on the first run.

# libfabric: use the EFA provider, with GPUDirect RDMA (GPU memory straight to the NIC; p4d, p5 and later).
export FI_PROVIDER=efa
export FI_EFA_USE_DEVICE_RDMA=1
export FI_EFA_SET_CUDA_SYNC_MEMOPS=0
# Only for old kernels / libfabric < 1.13 that need fork safety; harmless otherwise.
export FI_EFA_FORK_SAFE=1

# NCCL: bootstrap sockets off the docker/loopback interfaces; data goes over EFA through aws-ofi-nccl.
export NCCL_SOCKET_IFNAME=^docker,lo,veth
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export NCCL_BUFFSIZE=2097152
# aws-ofi-nccl before 1.7 could deliver out of order and needed NCCL_PROTO=simple; with current plugins on p5
# leave the protocol to NCCL. Uncomment only if NCCL_DEBUG shows the old plugin:
# export NCCL_PROTO=simple

# gloo (paratrain's CPU-side groups, e.g. checkpoint coordination) binds to the interface the hostname resolves
# to; if that is not the VPC interface, pass `paratrain launch --ifname <name>` (sets GLOO_SOCKET_IFNAME).
export PYTHONFAULTHANDLER=1
