"""The layering is a contract, not a picture: pyproject.toml's import-linter contracts place every module on a
floor, and these tests hold the code to them (docs/ARCHITECTURE.md, "The floors")."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "trainwise"
CONTRACTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
# Imports of trainwise modules inside functions: only where loading lazily is the point. The package root
# exposes trainwise.train/load/plan without importing torch (PEP 562 __getattr__); the CLI's dispatcher
# loads the one command it runs (through importlib, so it has no import statement to list here).
LAZY_IMPORTS_ALLOWED = {"trainwise/__init__.py", "trainwise/cli.py"}
MAX_LINES = 500


def modules() -> list[str]:
    """Every module of the package, dotted (a package is its __init__)."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def _names(layer: str) -> list[str]:
    return [name.strip().strip("()") for name in layer.replace(":", "|").split("|")]


def placed() -> tuple[set[str], dict[str, set[str]]]:
    """(modules the floors contract names, {package: its modules that the package's own contract names})."""
    floors = next(c for c in CONTRACTS if not c.get("containers"))
    top = {name for layer in floors["layers"] for name in _names(layer)}
    inner = {}
    for contract in CONTRACTS:
        for container in contract.get("containers", []):
            inner[container] = {f"{container}.{name}" for layer in contract["layers"] for name in _names(layer)}
    return top, inner


def test_contracts_are_kept():
    lint = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    done = subprocess.run([lint, "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def test_every_module_is_placed_by_a_contract():
    top, inner = placed()
    unplaced = []
    for module in modules():
        parts = module.split(".")
        if len(parts) == 1:
            continue  # the package root
        if ".".join(parts[:2]) not in top:
            unplaced.append(f"{module} (no floor for {'.'.join(parts[:2])})")
        elif len(parts) > 2 and module not in inner.get(".".join(parts[:-1]), set()):
            unplaced.append(f"{module} (not in the contract of {'.'.join(parts[:-1])})")
    assert not unplaced, "modules no import-linter contract places: " + ", ".join(unplaced)
    # and the contracts name no module that is gone
    existing = set(modules())
    named = top | set().union(*inner.values())
    assert not named - existing, f"contracts name modules that do not exist: {sorted(named - existing)}"


def test_no_import_circle():
    graph = grimp.build_graph("trainwise")
    seen, on_path, circles = set(), [], []

    def visit(module: str) -> None:
        if module in on_path:
            circles.append(on_path[on_path.index(module):] + [module])
            return
        if module in seen:
            return
        seen.add(module)
        on_path.append(module)
        for target in sorted(graph.find_modules_directly_imported_by(module)):
            visit(target)
        on_path.pop()

    for module in sorted(graph.modules):
        visit(module)
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles[:5])


def test_trainwise_imports_inside_functions_only_where_lazy_loading_is_the_point():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for inner in ast.walk(node):
                name = (inner.module or "" if isinstance(inner, ast.ImportFrom) else
                        inner.names[0].name if isinstance(inner, ast.Import) else None)
                if name is not None and (name == "trainwise" or name.startswith("trainwise.")) \
                        and rel not in LAZY_IMPORTS_ALLOWED:
                    found.append(f"{rel}:{inner.lineno} ({node.name}) imports {name}")
    assert not found, "trainwise modules imported inside functions:\n" + "\n".join(sorted(set(found)))


def test_the_model_is_built_in_one_place():
    """Outside trainwise.model, only runtime/step.py's builder constructs the Transformer."""
    builders = [str(p.relative_to(ROOT)) for p in sorted(PACKAGE.rglob("*.py"))
                if "Transformer(" in p.read_text(encoding="utf-8") and p.parent.name != "model"]
    assert builders == ["trainwise/runtime/step.py"]


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_files_stay_small(path):
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines (at most {MAX_LINES}): split it"


def test_lines_stay_within_the_line_length():
    """pyproject.toml's [tool.ruff] line-length, checked by ruff (E501): a long line is wrapped, not widened."""
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    done = subprocess.run([ruff, "check", "--select", "E501", "--output-format", "concise",
                           "trainwise", "tests", "benchmarks"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-12000:] + done.stderr[-2000:]


def test_train_reads_as_phases():
    tree = ast.parse((PACKAGE / "trainer" / "loop.py").read_text(encoding="utf-8"))
    train = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train")
    assert train.end_lineno - train.lineno + 1 <= 60
