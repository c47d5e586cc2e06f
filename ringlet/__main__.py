"""``python -m ringlet ...``: the ``ringlet`` command (cli.py) under this interpreter, as
``ringlet run`` suggests for a job that must run under another Python than the one the
``ringlet`` script was installed with."""
import sys

from .cli import main

sys.exit(main())
