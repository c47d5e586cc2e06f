"""matplotlib, imported only when a picture is asked for (it is the optional ``plot`` extra)."""
from __future__ import annotations


def output_path(path: str) -> str:
    """An argparse ``type`` for a file a command will write (a picture, a profile, a
    trace): refused at once, not after the work, when its directory is missing or not
    writable."""
    import argparse
    import os
    where = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(where):
        raise argparse.ArgumentTypeError(f"cannot write {path!r}: there is no directory {where}")
    if not os.access(where, os.W_OK) or os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"cannot write {path!r}: "
                                         + ("it is a directory" if os.path.isdir(path)
                                            else f"{where} is not writable"))
    return path


#: what matplotlib's savefig writes, by extension
PICTURES = ("png", "svg", "pdf", "jpg", "jpeg", "eps", "ps", "tif", "tiff", "webp", "svgz")


def picture_path(path: str) -> str:
    """``output_path`` for a picture: one without an extension becomes a .png (the name
    said is the file written; it had said "noext" and written noext.png), and one of a
    format matplotlib cannot write is refused at once (``--plot out.txt`` had failed
    with a traceback after the whole benchmark)."""
    import argparse
    import os
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    if os.path.isdir(path) or path.endswith(os.sep):
        return output_path(path)      # (refused: it is a directory)
    if not ext:
        path += ".png"
    elif ext not in PICTURES:
        raise argparse.ArgumentTypeError(f"cannot draw {path!r}: .{ext} is not a picture "
                                         f"format; use one of .{', .'.join(PICTURES)}")
    return output_path(path)


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


def size_axis(ax, which: str = "x") -> None:
    """A log axis of byte sizes ticked at powers of two and labelled 1K, 64M, 4G (not 10^6)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter, NullLocator

    axis = ax.xaxis if which == "x" else ax.yaxis
    (ax.set_xscale if which == "x" else ax.set_yscale)("log", base=2)
    lo, hi = (ax.get_xlim() if which == "x" else ax.get_ylim())
    span = max(hi / max(lo, 1e-9), 2.0)
    step = max(1, int(round(__import__("math").log2(span) / 8)))   # at most ~9 ticks
    axis.set_major_locator(LogLocator(base=2 ** step))
    axis.set_minor_locator(NullLocator())     # (LogLocator(subs=()) still labelled "2^13"
    axis.set_minor_formatter(NullFormatter())  # between the major ticks on some ranges)
    axis.set_major_formatter(FuncFormatter(lambda v, _: format_bytes(v)))


def format_bytes(v: float) -> str:
    """1024 -> '1K', 3 << 20 -> '3M', 8 -> '8' (the sizes `ringlet bench --sizes` takes)."""
    for unit, s in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if v >= s:
            q = v / s
            return f"{q:.0f}{unit}" if abs(q - round(q)) < 1e-6 else f"{q:.3g}{unit}"
    return f"{v:.0f}"


def value_axis(ax, which: str = "y") -> None:
    """A log axis of values labelled as plain numbers (0.01, 6, 200; not 10^-2 or 6x10^0),
    at the ticks matplotlib's own log axis labels (between the decades too, when the axis
    spans too little for them to be enough)."""
    from matplotlib.ticker import LogFormatterSciNotation

    class Plain(LogFormatterSciNotation):
        def __call__(self, x, pos=None):
            return f"{x:g}" if super().__call__(x, pos) else ""

    axis = ax.xaxis if which == "x" else ax.yaxis
    (ax.set_xscale if which == "x" else ax.set_yscale)("log")
    axis.set_major_formatter(Plain())
    axis.set_minor_formatter(Plain(labelOnlyBase=False))
