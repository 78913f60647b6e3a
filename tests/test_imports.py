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
ENTRY_POINTS = {"diloco.__main__", "diloco.learner"}
"""`python -m diloco` and `python -m diloco.learner`: the only modules that may import the command line."""
KNOWN_CYCLES = {"diloco.config", "diloco.config_rules", "diloco.launch.launcher", "diloco.launch.outages",
                "diloco.shard.regional_shard", "diloco.shard.resume", "diloco.shard.server", "diloco.shard.serving",
                "diloco.shard.snapshot", "diloco.sim.driver", "diloco.sim.summary"}
"""Modules still on a cycle once TYPE_CHECKING imports count (each through one): to be broken, and
removed from here as they are; the test fails on a name that is here but no longer on a cycle."""

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


def module_imports() -> dict[str, set[str]]:
    """Every diloco module, and the diloco modules it imports anywhere in its body (lazy imports too, and
    those under `if TYPE_CHECKING:`: a module that needs another's types to be read depends on it)."""
    files = {}
    for path in SOURCE.rglob("*.py"):
        parts = path.relative_to(SOURCE).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in files.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
            elif isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def test_no_module_of_the_package_imports_itself_back():
    graph = module_imports()
    assert sorted(name for name, deps in graph.items() if "diloco.cli" in deps) == sorted(ENTRY_POINTS)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for dep in graph[start] - seen:
            seen.add(dep)
            if dep == goal or reaches(dep, goal, seen):
                return True
        return False

    cycles = {name for name in graph if reaches(name, name, set())}
    assert not cycles - KNOWN_CYCLES, f"modules on an import cycle: {sorted(cycles - KNOWN_CYCLES)}"
    assert not KNOWN_CYCLES - cycles, f"no longer on a cycle, remove from KNOWN_CYCLES: {sorted(KNOWN_CYCLES - cycles)}"


@pytest.mark.integration  # runs `diloco` in a fresh interpreter
def test_help_of_every_command_loads_no_grpc():
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert {"sim", "run", "syncer", "learner"} <= set(commands)
    assert grpc_modules_loaded_by(["--help"], *([name, "--help"] for name in commands)) == []


@pytest.mark.integration  # runs `diloco` in a fresh interpreter
def test_a_simulation_loads_no_grpc(tmp_path):
    sets = [x for o in TINY for x in ("--set", o)]
    assert grpc_modules_loaded_by(["sim", *sets, "--out", str(tmp_path), "-q"]) == []
    assert (tmp_path / "summary.json").is_file()
