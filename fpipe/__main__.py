"""``python -m fpipe``: the command line (see ``fpipe._cli``)."""

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
