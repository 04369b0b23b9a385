"""`python -m benchmarks.gpu [options]`: the GPU matrix (the same as `python -m benchmarks gpu`)."""

import sys

from .run import main

sys.exit(main())
