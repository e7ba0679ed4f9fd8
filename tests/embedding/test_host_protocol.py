"""The host-side protocol (`sparsejax.embedding.host.HostSide`): what a method a host side
does not support says, how the composite the trainer holds combines its parts, and that
the code above the stores never asks which kind of store it holds."""

from __future__ import annotations

import pathlib
import re

import pytest

from sparsejax.checkpoint import Checkpointer
from sparsejax.embedding import default_mesh
from sparsejax.embedding.host import (
    HostExecution,
    HostOperationError,
    HostSide,
    HostSides,
    HostTables,
)

ROOT = pathlib.Path(__file__).resolve().parents[2] / "sparsejax"


class Recorder(HostSide):
    """A host side that records its calls in `log` and tags what it returns."""

    def __init__(self, name: str, log: list, *, saves_rows=False, maps=True, ahead=False):
        self.name, self.log = name, log
        self.saves_rows, self.maps_batches, self.looks_ahead = saves_rows, maps, ahead

    def prepare(self, tables, batch, *, train):
        self.log.append((self.name, "prepare", train))
        return {**tables, self.name: "prepared"}, [*batch, self.name]

    def finish(self, tables, step, next_batch=None):
        self.log.append((self.name, "finish", step, next_batch))
        return {**tables, self.name: "finished"}

    def snapshot(self, tables, *, incremental):
        self.log.append((self.name, "snapshot", incremental))
        return {f"{self.name}/t": incremental}

    def mark_saved(self):
        self.log.append((self.name, "mark_saved"))

    def restore(self, chain):
        self.log.append((self.name, "restore", len(chain)))

    def export(self, tables):
        return {f"{self.name}/t": {"keys": [], "weights": [], "slots": {}}}

    def stats(self):
        return {f"{self.name}/t": {"rows_live": 1}}


@pytest.mark.parametrize(
    ("method", "args"),
    [
        ("prepare", ({}, None)),
        ("snapshot", ({},)),
        ("mark_saved", ()),
        ("restore", ([],)),
        ("export", ({},)),
    ],
)
def test_an_unsupported_method_names_the_host_side_and_the_method(method, args):
    class Bare(HostSide):
        name = "bare tables"

    kw = {"train": True} if method == "prepare" else {}
    kw |= {"incremental": False} if method == "snapshot" else {}
    with pytest.raises(HostOperationError) as e:
        getattr(Bare(), method)(*args, **kw)
    msg = str(e.value)
    assert "\n" not in msg and "bare tables" in msg and repr(method) in msg


def test_host_executed_tables_refuse_snapshots_by_name():
    """Their tables are in the train state (orbax saves them); a snapshot asked of them
    is a caller's mistake, answered in one line, never an AttributeError."""
    part = HostExecution({}, default_mesh())
    for call in (
        lambda: part.snapshot({}, incremental=False),
        lambda: part.restore([{}]),
        lambda: part.export({}),
    ):
        with pytest.raises(HostOperationError, match=r"^host-executed tables do not support"):
            call()
    assert not part.saves_rows and part.maps_batches


def test_an_empty_composite_passes_everything_through():
    host = HostSides()
    tables, batch = {"a": 1}, object()
    assert host.prepare(tables, batch, train=True) == (tables, batch)
    assert host.finish(tables, 3, batch) is tables
    assert host.step_sharding(tables, None) is tables
    assert host.device_tables(tables) is tables
    assert (host.saves_rows, host.maps_batches, host.looks_ahead) == (False, False, False)
    assert host.snapshot(tables, incremental=True) == {} and host.export(tables) == {}
    assert host.stats() == {} and host.tables == {}
    host.restore([{}])
    host.mark_saved()
    host.close()


def test_the_composite_runs_its_parts_in_order_and_merges_what_they_give():
    log: list = []
    first = Recorder("first", log)
    second = Recorder("second", log, saves_rows=True, ahead=True)
    host = HostSides([first, second])
    assert (host.saves_rows, host.maps_batches, host.looks_ahead) == (True, True, True)

    tables, batch = host.prepare({}, [], train=False)
    assert tables == {"first": "prepared", "second": "prepared"}
    assert batch == ["first", "second"]  # the second part sees the first one's batch
    host.finish({}, 7, "next")
    assert log == [
        ("first", "prepare", False),
        ("second", "prepare", False),
        ("first", "finish", 7, "next"),
        ("second", "finish", 7, "next"),
    ]
    log.clear()
    # checkpoints: only the part with host rows is asked
    assert host.snapshot({}, incremental=True) == {"second/t": True}
    host.mark_saved()
    host.restore([{}, {}])
    assert log == [("second", "snapshot", True), ("second", "mark_saved"), ("second", "restore", 2)]
    assert set(host.export({})) == {"second/t"}
    assert host.stats() == {"first/t": {"rows_live": 1}, "second/t": {"rows_live": 1}}
    second.looks_ahead = False  # the composite reads its parts' current settings
    assert not host.looks_ahead


def test_the_checkpointer_keeps_a_host_side_only_when_it_holds_rows(tmp_path):
    log: list = []
    none = Checkpointer(tmp_path / "a", {}, host=HostSides([Recorder("x", log)]))
    rows = HostSides([Recorder("y", log, saves_rows=True)])
    some = Checkpointer(tmp_path / "b", {}, host=rows)
    try:
        assert none.host is None and some.host is rows
    finally:
        none.close()
        some.close()


# The code above the stores talks to the two interfaces only (TableStore, HostSide):
# no store kinds named, no isinstance on stores, no probing for a kind's attributes.
_ABOVE = ("train", "checkpoint", "serving", "runner", "__main__.py")
_STORE_MODULES = {"serving/_store.py"}  # a store itself (the inference store)
_KINDS = re.compile(
    r"DeviceTableStore|ShardedTableStore|HybridTableStore|HostTables\b|HostExecution"
    r"|\bhost_exec\b|\.host_tables\b|isinstance\([^)]*[Ss]tore"
    r"|getattr\([^)]*(store|host)[^)]*,\s*\"[a-z_]+\",\s*[^)]"
)


def test_no_code_above_the_stores_asks_which_kind_of_store_it_holds():
    found = []
    for part in _ABOVE:
        for path in (
            sorted((ROOT / part).rglob("*.py")) if (ROOT / part).is_dir() else [ROOT / part]
        ):
            rel = path.relative_to(ROOT).as_posix()
            if rel in _STORE_MODULES:
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if _KINDS.search(line):
                    found.append(f"{rel}:{n}: {line.strip()}")
    assert not found, "\n".join(found)


def test_the_factory_is_where_store_kinds_are_told_apart():
    """The one factory knows HostExecution and HostTables; both say whether a model
    needs them from its stores alone."""
    assert not HostExecution.needed({}) and not HostTables.needed({})
