"""Custom import-linter contract: no import circle between files.

import-linter's `acyclic_siblings` looks for circles between the children of each
package, treating a subpackage as one node; it does not see a circle that passes through
a package's `__init__` (`sparsejax.data` -> `._stream` -> `sparsejax.data`). This
contract works on files: it finds every strongly connected set of modules in the import
graph and prints circles that together cover each set, one import per line with its line
number. A function-local import counts (it hides a circle, it does not break one);
`if TYPE_CHECKING:` imports do not when the session sets `exclude_type_checking_imports`.
"""

from __future__ import annotations

from collections import deque

import grimp
from importlinter import Contract, ContractCheck, output


class AcyclicModulesContract(Contract):
    """Kept when no module imports, directly or through others, a module that imports it."""

    type_name = "acyclic_modules"

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        imports = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
        circles = []
        for component in strongly_connected(imports):
            for cycle in covering_cycles(imports, component):
                pairs = zip(cycle, cycle[1:] + cycle[:1], strict=True)
                circles.append([_link(graph, a, b) for a, b in pairs])
        return ContractCheck(kept=not circles, warnings=None, metadata={"circles": circles})

    def render_broken_contract(self, check: ContractCheck) -> None:
        output.print_error("Import circles (each is broken by removing one of its imports):")
        output.new_line()
        for circle in check.metadata["circles"]:
            for i, (importer, imported, where) in enumerate(circle):
                output.print_error(f"{'-' if i == 0 else ' '} {importer} -> {imported} ({where})")
            output.new_line()
        output.print(
            "Move what both sides need into a module they both import; a function-local "
            "import hides a circle but does not break it."
        )


def strongly_connected(imports: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative): the sets of two or more modules that reach each
    other, each sorted, in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(imports):
        if root in index:
            continue
        work = [(root, iter(sorted(imports[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in imports:
                    continue
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(imports[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def covering_cycles(imports: dict[str, set[str]], component: list[str]) -> list[list[str]]:
    """Shortest circles inside one strongly connected set until every module is on one."""
    members = set(component)
    covered: set[str] = set()
    cycles = []
    for start in component:
        if start in covered:
            continue
        # Breadth-first from `start` back to itself: the shortest circle through it.
        previous: dict[str, str] = {}
        queue = deque([start])
        while queue:
            node = queue.popleft()
            if start in imports[node] and (node != start):
                break
            for nxt in sorted(imports[node] & members):
                if nxt not in previous and nxt != start:
                    previous[nxt] = node
                    queue.append(nxt)
        path = [node]
        while path[-1] != start:
            path.append(previous[path[-1]])
        cycle = path[::-1]
        covered.update(cycle)
        cycles.append(cycle)
    return cycles


def _link(graph: grimp.ImportGraph, importer: str, imported: str) -> tuple[str, str, str]:
    details = graph.get_import_details(importer=importer, imported=imported)
    lines = ", ".join(f"l.{d['line_number']}" for d in details)
    return importer, imported, lines or "line unknown"
