"""Imports run downward: the artifact container and the runtime import no model family (the
Engine injects what they need), read from the source with ast so a function-level import counts
too."""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "ninfer"


def imported_modules(path: pathlib.Path) -> list:
    """Absolute dotted names of every module `path` imports (relative imports resolved)."""
    package = ("ninfer." + ".".join(path.relative_to(ROOT).with_suffix("").parts)).rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = base[:len(base) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            out.append(module)
            if node.module is None:         # from .. import models
                out.extend(f"{module}.{alias.name}" for alias in node.names)
    return out


def test_imported_modules_resolves_relative_imports():
    """The walk sees what the check below must catch: engine.py (the composition root) imports
    the family inside a function, through a relative import."""
    got = imported_modules(ROOT / "engine.py")
    assert "ninfer.models.qwen3_5" in got and "ninfer.artifact" in got and "numpy" in got
    assert "ninfer.errors" in imported_modules(ROOT / "runtime" / "scoring.py")


@pytest.mark.parametrize("package", ["artifact", "runtime"])
def test_package_imports_no_model_family(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files
    bad = [(str(f.relative_to(ROOT)), m) for f in files for m in imported_modules(f)
           if m == "ninfer.models" or m.startswith("ninfer.models.")]
    assert not bad, f"ninfer/{package} imports a model family: {bad}"
