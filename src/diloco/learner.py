"""`python -m diloco.learner ...` (e.g. under torchrun) is `diloco learner ...`."""

import sys

from diloco.cli import main

if __name__ == "__main__":
    sys.exit(main(["learner", *sys.argv[1:]]))
