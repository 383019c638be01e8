"""`python -m paratrain` (what torchrun runs: `torchrun ... -m paratrain train ...`)."""

import sys

from paratrain.cli import main

sys.exit(main())
