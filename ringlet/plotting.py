"""matplotlib, imported only when a picture is asked for (it is the optional ``plot`` extra)."""
from __future__ import annotations


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend, or a ValueError that says how
    to install it (the commands print it as an error and exit 2)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("drawing a picture needs matplotlib: pip install 'ringlet[plot]' "
                         "(or matplotlib); without -o/--plot the text form needs nothing") from None
    return plt
