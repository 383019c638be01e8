"""The aten ops the dispatcher sees while a function runs (views and detaches included), by name: how the planner's
launch counts are checked against real code (tests/test_plan_model.py, benchmarks/vtrain_breakdown.py --ops)."""

from __future__ import annotations

import collections


def dispatched_ops(fn, *args, **kwargs) -> collections.Counter:
    """Run fn(*args, **kwargs) under a counting TorchDispatchMode; returns the count per op packet name."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    with Count() as count:
        fn(*args, **kwargs)
    return count.ops
