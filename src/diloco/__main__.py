"""`python -m diloco`."""

import sys

from diloco.cli import main

sys.exit(main())
