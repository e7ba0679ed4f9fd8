"""The import contracts' own checker (tools/import_contracts.py): it finds every import
circle between files and names each import of it with its line. (`lint-imports` runs the
contracts on the package in `.ci/run`.)"""

import importlib.util
from pathlib import Path

import grimp
import pytest

_PATH = Path(__file__).resolve().parents[1] / "tools" / "import_contracts.py"
_spec = importlib.util.spec_from_file_location("import_contracts", _PATH)
contracts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(contracts)


def _graph(edges):
    graph = grimp.ImportGraph()
    for line, (importer, imported) in enumerate(edges, start=1):
        graph.add_import(
            importer=importer, imported=imported, line_number=line, line_contents="import"
        )
    return graph


def _check(edges):
    contract = contracts.AcyclicModulesContract(
        name="circles", session_options={}, contract_options={}
    )
    return contract.check(_graph(edges), verbose=False)


def test_no_circle_is_kept():
    check = _check([("p.a", "p.b"), ("p.b", "p.c"), ("p.a", "p.c"), ("p", "p.a")])
    assert check.kept
    assert check.metadata["circles"] == []


def test_each_circle_named_with_its_lines():
    # p.a <-> p.b, and p.c -> p.d -> p.e -> p.c (p.x only leads into it)
    edges = [
        ("p.a", "p.b"),
        ("p.b", "p.a"),
        ("p.c", "p.d"),
        ("p.d", "p.e"),
        ("p.e", "p.c"),
        ("p.x", "p.c"),
    ]
    check = _check(edges)
    assert not check.kept
    assert check.metadata["circles"] == [
        [("p.a", "p.b", "l.1"), ("p.b", "p.a", "l.2")],
        [("p.c", "p.d", "l.3"), ("p.d", "p.e", "l.4"), ("p.e", "p.c", "l.5")],
    ]


def test_a_package_init_in_a_circle_counts():
    # acyclic_siblings misses this one: the package itself is no sibling of its children.
    check = _check([("p.data", "p.data._stream"), ("p.data._stream", "p.data")])
    assert [[link[:2] for link in c] for c in check.metadata["circles"]] == [
        [("p.data", "p.data._stream"), ("p.data._stream", "p.data")]
    ]


@pytest.mark.parametrize("n", [2, 5])
def test_every_module_of_a_tangle_is_on_a_printed_circle(n):
    # a hub importing and imported by n spokes: one tangle, n circles of two
    edges = [e for i in range(n) for e in (("p.hub", f"p.s{i}"), (f"p.s{i}", "p.hub"))]
    imports = {}
    for a, b in edges:
        imports.setdefault(a, set()).add(b)
        imports.setdefault(b, set())
    (component,) = contracts.strongly_connected(imports)
    cycles = contracts.covering_cycles(imports, component)
    assert {m for c in cycles for m in c} == set(component)
    assert all(len(c) == 2 for c in cycles)
