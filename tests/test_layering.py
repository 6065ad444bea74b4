"""The packages import in one direction (DESIGN.md §2: edge_agent -> executors, routing, storage -> coe).

Among the middle three the edges run storage <- routing <- executors, so the graph has no cycle;
`coe` imports none of them and never torch.  Imports under `if TYPE_CHECKING:` are annotations only
and are not counted.  Lazy imports inside functions are counted: they are edges all the same.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ORDER = ("coe", "storage", "routing", "executors", "edge_agent")   # each may import only those before it


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and (
        (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
        or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING"))


def imports(source: str) -> set[str]:
    """Top-level names of the absolute imports in `source`, outside `if TYPE_CHECKING:` blocks."""
    out: set[str] = set()
    stack = [ast.parse(source)]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
        stack += [c for c in ast.iter_child_nodes(node) if not _is_type_checking(c)]
    return out


def test_the_import_scanner_sees_lazy_imports_and_skips_type_checking_blocks():
    src = ("from typing import TYPE_CHECKING\nimport os.path\nif TYPE_CHECKING:\n    import executors\n"
           "def f():\n    from storage.pool import Pool\n    from . import sibling\n")
    assert imports(src) == {"typing", "os", "storage"}


@pytest.mark.parametrize("package", ORDER)
def test_a_package_imports_only_the_packages_below_it(package):
    above = set(ORDER[ORDER.index(package):]) - {package}
    bad = {}
    for f in sorted((ROOT / package).rglob("*.py")):
        hit = imports(f.read_text()) & (above | ({"torch"} if package == "coe" else set()))
        if hit:
            bad[str(f.relative_to(ROOT))] = sorted(hit)
    assert not bad, f"{package} imports what sits above it (or coe imports torch): {bad}"
