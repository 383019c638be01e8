"""A worker of tests/torchrun_fork.py: `paratrain ARGS` in a process torchrun forked (--run-path)."""

import sys

from paratrain.cli import main

code = main(sys.argv[1:])
if code:  # a forked worker that raises SystemExit(0) returns no result to torchrun's agent: return normally
    sys.exit(code)
