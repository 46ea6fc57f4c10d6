"""Library code reimplements torch.distributed.optim and friends; it must not import them."""

from __future__ import annotations

import ast
from pathlib import Path

FORBIDDEN = (
    "torch.distributed.optim",
    "torch.distributed.algorithms.model_averaging",
    "torch.distributed.algorithms.ddp_comm_hooks",
)
SRC = Path(__file__).resolve().parents[1] / "src" / "distoptim"


def _imported_modules(tree: ast.AST) -> list[str]:
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
            names.extend(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _forbidden_imports(source: str) -> list[str]:
    return [
        name
        for name in _imported_modules(ast.parse(source))
        if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN)
    ]


def test_rule_catches_every_spelling() -> None:
    assert _forbidden_imports("import torch.distributed.optim")
    assert _forbidden_imports("from torch.distributed.optim import ZeroRedundancyOptimizer")
    assert _forbidden_imports("from torch.distributed.algorithms import model_averaging")
    assert _forbidden_imports("from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook")
    assert not _forbidden_imports("import torch.distributed as dist\nfrom torch.optim import AdamW")


def test_library_does_not_import_torch_implementations() -> None:
    files = sorted(SRC.rglob("*.py"))
    assert files, f"no sources found under {SRC}"
    offenders = {str(path.relative_to(SRC)): bad for path in files if (bad := _forbidden_imports(path.read_text()))}
    assert not offenders, f"library modules import what they must reimplement: {offenders}"
