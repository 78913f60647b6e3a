"""What the package loads: no import cycle, and no gRPC for the commands that do not talk to a syncer
(`diloco --help` of every command, `diloco sim`), so that they start quickly and work without it."""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TINY, child_env
from diloco.cli import build_parser

SOURCE = Path(__file__).parent.parent / "src"
ENTRY_POINTS = {"diloco.__main__", "diloco.learner", "diloco.prestarted"}
"""`python -m diloco`, `python -m diloco.learner` and a pre-started spare (`python -m diloco.prestarted`,
which becomes a `diloco learner` or `diloco syncer`): the only modules that may import the command line."""

LOADED_GRPC = """
import json, sys
from diloco.cli import main
for argv in json.loads(sys.argv[1]):
    try:
        main(argv)
    except SystemExit:
        pass
print(json.dumps(sorted(m for m in sys.modules if m == "grpc" or m.startswith("grpc."))))
"""


def grpc_modules_loaded_by(*argvs: list[str]) -> list[str]:
    """The gRPC modules loaded by a fresh interpreter that runs `diloco ARGV...` for each argv."""
    done = subprocess.run([sys.executable, "-c", LOADED_GRPC, json.dumps(argvs)], capture_output=True, text=True,
                          timeout=300, env=child_env())
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def module_imports(type_hints: bool = False) -> dict[str, set[str]]:
    """Every diloco module, and the diloco modules it imports anywhere in its body (lazy imports too;
    those under `if TYPE_CHECKING:`, which only type hints see, with `type_hints` only)."""
    files = {}
    for path in SOURCE.rglob("*.py"):
        parts = path.relative_to(SOURCE).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in files.items():
        targets = set()
        tree = ast.parse(path.read_text())
        for block in [n for n in ast.walk(tree) if isinstance(n, ast.If) and _type_checking_only(n)
                      and not type_hints]:
            block.body = []  # imports for type hints alone are never executed: they make no cycle
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
            elif isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def test_no_module_of_the_package_imports_itself_back():
    graph = module_imports(type_hints=True)  # a module that needs another's types to be read depends on it
    assert sorted(name for name, deps in graph.items() if "diloco.cli" in deps) == sorted(ENTRY_POINTS)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for dep in graph[start] - seen:
            seen.add(dep)
            if dep == goal or reaches(dep, goal, seen):
                return True
        return False

    cycles = [name for name in graph if reaches(name, name, set())]
    assert not cycles, f"modules on an import cycle: {sorted(cycles)}"


@pytest.mark.integration  # runs `diloco` in a fresh interpreter
def test_help_of_every_command_loads_no_grpc():
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert {"sim", "run", "syncer", "learner"} <= set(commands)
    assert grpc_modules_loaded_by(["--help"], *([name, "--help"] for name in commands)) == []


NOT_ON_THE_SIMULATOR = ("diloco.shard", "diloco.client", "diloco.launch", "diloco.transport", "diloco.network",
                        "diloco.plan", "diloco.driver_kit", "diloco.virtual_run")
"""The real driver, the planner and what they share with the simulator: none may load it."""


def test_the_real_driver_and_the_planner_never_import_the_simulator():
    graph = module_imports(type_hints=True)

    def reached(start: str) -> set[str]:
        seen: set[str] = set()
        todo = [start]
        while todo:
            for dep in graph[todo.pop()] - seen:
                seen.add(dep)
                todo.append(dep)
        return seen

    offenders = {name: sorted(d for d in reached(name) if d == "diloco.sim" or d.startswith("diloco.sim."))
                 for name in graph if name.startswith(NOT_ON_THE_SIMULATOR)}
    assert not {name: sim for name, sim in offenders.items() if sim}


@pytest.mark.integration  # runs `diloco` in a fresh interpreter
def test_a_simulation_loads_no_grpc(tmp_path):
    sets = [x for o in TINY for x in ("--set", o)]
    assert grpc_modules_loaded_by(["sim", *sets, "--out", str(tmp_path), "-q"]) == []
    assert (tmp_path / "summary.json").is_file()
