"""`python -m modular_decoder.commands ...` runs the `modular-decoder` command line."""

import sys

from modular_decoder.commands import main

sys.exit(main())
