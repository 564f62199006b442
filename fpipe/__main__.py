"""``python -m fpipe``: the command line (see ``fpipe._cli``)."""

import os
import sys

from ._cli import main

if __name__ == "__main__":
    try:
        status = main()
        sys.stdout.flush()
    except BrokenPipeError:  # the reader went away (`python -m fpipe show ... | head`): no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush at exit
        status = 1
    sys.exit(status)
