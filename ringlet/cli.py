"""The ``ringlet`` command: run, bench, plan, tiers, explain, place, calibrate, draw, trace."""
from __future__ import annotations

import os
import sys

USAGE = """usage: ringlet COMMAND [args]     (ringlet --version: which one)

commands:
  run        start ranks of a job (like torchrun):  ringlet run -n 4 script.py [args]
  bench      nccl-tests style benchmark:           ringlet bench -n 4 --op all_reduce --sizes 8:64M
  plan       communication/computation ratio planner (no arguments: a 7B-parameter example)
  tiers      price one transfer on every interconnect tier: ringlet tiers --bytes 256MiB
  explain    predicted time of every algorithm, the winner and crossovers
  place      which host each rank should run on (TP x DP, expert parallel), beside the naive order
  calibrate  measure this host's per-message, per-byte and reduce costs; save the profile
  draw       draw a schedule:  ringlet draw all_reduce -n 8 --algo ring [-o ring.svg]
  trace      a traced job (ringlet run --trace DIR): ringlet trace merge|summary|plot DIR
"""


def main(argv=None) -> int:
    try:
        return _command(sys.argv[1:] if argv is None else argv)
    except BrokenPipeError:
        # The reader went away (`ringlet tiers | head`): stop quietly, as `yes | head`
        # does. Point stdout at /dev/null so the interpreter's final flush cannot fail.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141          # 128 + SIGPIPE, what a shell reports for a tool it stopped


def _command(argv) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    if not argv:                  # (a command is required: usage on stderr, as argparse does)
        print(USAGE, file=sys.stderr)
        return 2
    if argv[0] in ("-V", "--version"):
        from importlib.metadata import PackageNotFoundError, version
        try:
            print(f"ringlet {version('ringlet')}")
        except PackageNotFoundError:          # (run from a source tree not installed)
            print("ringlet (not installed: no version)")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "run":
        from .launch import run_main
        return run_main(rest)
    if cmd == "bench":
        from .bench import main as bench_main
        return bench_main(rest) or 0
    if cmd in ("plan", "tiers", "explain", "place"):
        from . import commands
        return getattr(commands, f"{cmd}_main")(rest) or 0
    if cmd == "calibrate":
        from .calibrate import main as calibrate_main
        return calibrate_main(rest) or 0
    if cmd == "trace":
        from .timeline import main as trace_main
        return trace_main(rest)
    if cmd == "draw":
        from .draw import main as draw_main
        return draw_main(rest)
    print(f"ringlet: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
