"""The floors of ``bigdense/`` and the check that imports only point down them, with no cycle.

    .venv/bin/python -m bigdense.testing.floors        # the floor of every module; upward imports and cycles

Every ``import`` and ``from ... import`` of the package's source is read (also those inside
functions), without importing anything. A module may import modules of its own floor or below; no
two modules may reach each other. The package's ``__init__`` modules re-export (the top one all of
``bd.*``) and stand on the floor of their package.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Optional

# (floor, module prefix, what stands there). A module's floor is its longest matching prefix's.
FLOORS = (
    (0, "bigdense.errors", "how a bad value is reported (ConfigError, the shared checks)"),
    (0, "bigdense.host_checks", "the switch for checks that read device data on the host"),
    (0, "bigdense.durable", "writing files that survive a crash (temp file, fsync, rename)"),
    (1, "bigdense.kernels", "GPU kernels (Triton) beside their torch references"),
    (1, "bigdense.parallel", "the mesh, raw collectives, autograd communication regions, layout-free random numbers"),
    (2, "bigdense.layers", "the tensor-parallel layers, the classifier head"),
    (2, "bigdense.data", "the corpus, its tokenizer and batches"),
    (3, "bigdense.models", "reference models made of bigdense layers"),
    (3, "bigdense.parallelize", "converting an existing nn.Module, Hugging Face plans"),
    (3, "bigdense.compression", "making a trained dense layer smaller: low rank, pruning, sparse, int8"),
    (4, "bigdense.checkpoint", "layout-free checkpoints, dense export"),
    (4, "bigdense.muon", "Muon for sharded dense layers: whole matrices, each orthogonalised on one rank"),
    (4, "bigdense.plan", "the memory planner's estimates, from a model's shapes (bd.plan.estimate)"),
    (5, "bigdense.train", "engines, clipping, precision, recompute, schedules, metrics, faults"),
    (6, "bigdense.config", "the jobs' configuration: schemas, key checks, validation"),
    (6, "bigdense.jobs", "config -> objects: the run, the model, the one parallelize function"),
    (6, "bigdense", "the package itself (only the top __init__): re-exports the public names"),
    (7, "bigdense.data.__main__", "the rows a job would see (python -m bigdense.data show)"),
    (7, "bigdense.plan.__main__", "the planner's command line (python -m bigdense.plan)"),
    (7, "bigdense.plan.config", "the planner's reading of a job's config"),
    (7, "bigdense.plan.measure", "the planner's measurement of a real step"),
    (7, "bigdense.compress", "compression of a checkpoint: low rank, pruning, int8 weights"),
    (7, "bigdense.export_hf", "a checkpoint back to a Hugging Face directory"),
    (7, "bigdense.sample", "text from a trained run's reference GPT (python -m bigdense.sample)"),
    (7, "bigdense.bench", "benchmarks"),
    (7, "bigdense.testing", "the CPU cluster harness, counters, this check"),
)

ROOT = Path(__file__).resolve().parents[1]


def module_names(root: Path = ROOT) -> dict[str, Path]:
    """``{dotted module name: file}`` of every module of the package."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def floor_of(module: str) -> int:
    """The floor of ``module``: its longest prefix's in `FLOORS` (``bigdense`` itself matches only the
    top ``__init__``, so a module missing from the table is an error, not the top floor)."""
    matches = [(len(prefix), floor) for floor, prefix, _ in FLOORS
               if module == prefix or (prefix != "bigdense" and module.startswith(prefix + "."))]
    if not matches:
        raise ValueError(f"{module} stands on no floor: add its package to bigdense.testing.floors.FLOORS")
    return max(matches)[1]


def _target(name: str, modules) -> Optional[str]:
    """The module of the package an imported name resolves to (a submodule, else its package)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """``{module: modules of the package it imports}``."""
    edges = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                candidates = [f"{base}.{alias.name}" for alias in node.names] or [base]
            elif isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            else:
                continue
            for candidate in candidates:
                target = _target(candidate, modules)
                # A module reaching its own package's __init__ is how Python imports it, not a dependency.
                if target and target != name:
                    found.add(target)
        edges[name] = found
    return edges


def upward(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports of a higher floor's module."""
    return sorted((a, b) for a, targets in edges.items() for b in targets if floor_of(b) > floor_of(a))


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle found by a depth-first walk (each as the modules along it, first repeated last)."""
    found, state = [], {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node)
    return found


def main() -> int:
    modules = module_names()
    edges = imports(modules)
    for floor, prefix, what in FLOORS:
        print(f"floor {floor}: {prefix:<22} {what}")
    bad_up, bad_cycles = upward(edges), cycles(edges)
    for a, b in bad_up:
        print(f"upward: {a} (floor {floor_of(a)}) imports {b} (floor {floor_of(b)})")
    for cycle in bad_cycles:
        print("cycle: " + " -> ".join(cycle))
    count = sum(len(t) for t in edges.values())
    print(f"{len(modules)} modules, {count} imports inside the package: "
          f"{len(bad_up)} upward, {len(bad_cycles)} cycles")
    return 1 if bad_up or bad_cycles else 0


if __name__ == "__main__":
    sys.exit(main())
