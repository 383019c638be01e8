"""Analytic planner: estimate one layout, search all of them. No torch (fast import).

    from paratrain.plan import estimate, search, Layout, Options
    est = estimate("llama2-7b", "trn1.32xlarge", nodes=128, seq=4096, global_batch=1024,
                   layout=Layout(tp=8, sp=True, recompute="selective", microbatch=1))
"""

from paratrain.plan.api import Estimate, Layout, SearchResult, estimate, search
from paratrain.plan.options import Options

__all__ = ["Estimate", "Layout", "Options", "SearchResult", "estimate", "search"]
