"""Multi-node launching: `paratrain launch` builds and runs the torchrun invocation for one node."""
