"""Print ringlet's import graph: one line per module, the ringlet modules it imports
(in-function imports included), then, for each import-linter layer contract of
pyproject.toml, every import that goes up its layers (module by module). Uses grimp, which import-linter installs
(``pip install -e .[test]``).

    python scripts/import_graph.py              # modules
    python scripts/import_graph.py --packages   # ringlet.cost.* as ringlet.cost, etc.

Compare two checkouts: run it with each on PYTHONPATH and diff the outputs.
"""
from __future__ import annotations

import argparse
import os
import sys

import grimp

try:
    import tomllib
except ModuleNotFoundError:   # Python < 3.11
    tomllib = None


def _contracts() -> list[tuple[str, list[list[str]]]]:
    """pyproject.toml's import-linter layer contracts: (name, layers top first, each a
    list of module names)."""
    path = os.path.join(os.path.dirname(__file__), "..", "pyproject.toml")
    if tomllib is None or not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        contracts = tomllib.load(f)["tool"]["importlinter"]["contracts"]
    return [(c["name"], [[f"{c['containers'][0]}.{m.strip(' ()')}" for m in layer.split(":")]
                         for layer in c["layers"]])
            for c in contracts if c["type"] == "layers"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--packages", action="store_true",
                    help="fold subpackages' modules into the package (ringlet.cost, ...)")
    a = ap.parse_args(argv)
    graph = grimp.build_graph("ringlet")
    import ringlet
    print(f"# import graph of {os.path.dirname(ringlet.__file__)}")

    def unit(m: str) -> str:
        parts = m.split(".")
        if a.packages and len(parts) > 2:
            return ".".join(parts[:2])
        return m

    edges: dict[str, set] = {}
    for m in sorted(graph.modules):
        for dep in graph.find_modules_directly_imported_by(m):
            if dep.startswith("ringlet") and unit(dep) != unit(m) and dep != "ringlet":
                edges.setdefault(unit(m), set()).add(unit(dep))
    for m in sorted({unit(m) for m in graph.modules}):
        print(f"{m} -> {', '.join(sorted(edges.get(m, ()))) or '(nothing of ringlet)'}")
    print(f"# {sum(map(len, edges.values()))} arrows")

    for name, layers in _contracts():
        def level(m: str):
            for i, layer in enumerate(layers):
                if any(m == x or m.startswith(x + ".") for x in layer):
                    return i
            return None

        up = sorted((m, d) for m in graph.modules
                    for d in graph.find_modules_directly_imported_by(m)
                    if level(m) is not None and level(d) is not None and level(d) < level(m))
        print(f"# {name}: {len(up)} imports up the layers")
        for m, d in up:
            print(f"  {m} -> {d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
