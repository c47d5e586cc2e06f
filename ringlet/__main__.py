"""``python -m ringlet ...``: the ``ringlet`` command (cli.py) under this interpreter, as
``ringlet run`` suggests for a job that must run under another Python than the one the
``ringlet`` script was installed with."""
import sys

from .cli import main

if __name__ == "__main__":    # (imported, as tools that walk the package do: nothing runs)
    sys.exit(main())
