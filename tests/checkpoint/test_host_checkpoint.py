"""Checkpoints of the host side of tiered tables: full and incremental host steps beside
the orbax ones, checksummed, atomic, pruned with the checkpoints that read them.

`FakeHostTables` stands in for `sparsejax.embedding.HostTables` (the same three methods):
a dict of rows per table, the ids changed since the last save and the ids evicted since
(tombstones), so what a restore of full + deltas rebuilds can be compared with what the
fake held at that step. The train states are real (`TrainState` over a `DeviceTableStore`
with a static and a tiered table) but need no trainer: nothing here compiles a model.
"""

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from sparsejax import embedding as emb
from sparsejax.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointUnreadableError,
    CheckpointWriteError,
)
from sparsejax.checkpoint import _host_tables as ht
from sparsejax.checkpoint._checkpointer import NonFiniteStateError
from sparsejax.embedding.host import HostSide
from sparsejax.embedding.host._snapshot import TableSnapshot
from sparsejax.sharding import make_store
from sparsejax.train import TrainState

DIM = 3
KEYS = ("embedding/item", "tower/emb.x/..%odd name")  # "/" and odd characters in names


class FakeHostTables(HostSide):
    """A host side holding rows `{id: (weights f32[DIM], accumulator, count)}` per
    table, with change tracking; `train` touches and evicts some ids."""

    name = "fake host tables"
    saves_rows = True

    def __init__(self, keys=KEYS, seed=0):
        self.rows = {k: {} for k in keys}
        self.dirty = {k: set() for k in keys}
        self.tombstones = {k: set() for k in keys}
        self.rng = np.random.default_rng(seed)
        self.step = 0
        self.snapshots: list[bool] = []  # the `incremental` of each snapshot
        self.restored: list[list[dict]] = []  # the kinds of each chain restored
        self.marks = 0

    def train(self, step: int, *, evict=()) -> None:
        self.step = step
        for k, rows in self.rows.items():
            for i in self.rng.choice(40, size=6, replace=False).tolist():
                w, a, c = rows.get(i, (np.zeros(DIM, np.float32), 0.0, 0))
                rows[i] = (w + self.rng.normal(size=DIM).astype(np.float32), a + 1.5, c + 1)
                self.dirty[k].add(i)
                self.tombstones[k].discard(i)
            for i in [*evict, int(self.rng.choice(sorted(rows)))]:
                if rows.pop(i, None) is not None:
                    self.dirty[k].discard(i)
                    self.tombstones[k].add(i)

    def state(self) -> dict:
        return {
            k: {i: (tuple(w.tolist()), a, c) for i, (w, a, c) in rows.items()}
            for k, rows in self.rows.items()
        }

    def snapshot(self, state_tables, *, incremental: bool) -> dict[str, TableSnapshot]:
        assert "embedding" in state_tables  # it gets the state's tables
        self.snapshots.append(incremental)
        out = {}
        for k, rows in self.rows.items():
            ids = sorted(self.dirty[k] if incremental else rows)
            arrays = {
                "keys": np.array(ids, np.int64),
                "weights": np.array([rows[i][0] for i in ids], np.float32).reshape(-1, DIM),
                "slot/accumulator": np.array([rows[i][1] for i in ids], np.float32),
                "count": np.array([rows[i][2] for i in ids], np.int32),
                "tombstones": np.array(sorted(self.tombstones[k]) if incremental else [], np.int64),
                "admission/counts": np.arange(4, dtype=np.uint8),
            }
            kind = "delta" if incremental else "full"
            out[k] = TableSnapshot(kind, self.step, arrays, {"rows": np.int64(len(rows))})
        return out

    def restore(self, chain: list[dict[str, TableSnapshot]]) -> None:
        for k in self.rows:
            if k not in chain[0]:
                raise KeyError(f"the checkpoint has no host state for tiered table {k!r}")
        self.restored.append([{k: s.kind for k, s in snaps.items()} for snaps in chain])
        rows: dict = {k: {} for k in self.rows}
        for snaps in chain:
            for k, s in snaps.items():
                a = s.arrays
                if s.kind == "full":
                    rows[k] = {}
                for i in a["tombstones"].tolist():
                    rows[k].pop(i, None)
                for i, w, acc, c in zip(
                    a["keys"].tolist(),
                    a["weights"],
                    a["slot/accumulator"].tolist(),
                    a["count"].tolist(),
                    strict=True,
                ):
                    rows[k][i] = (np.array(w), acc, c)
                assert s.meta["rows"] >= 0
        self.rows = rows
        self.dirty = {k: set() for k in rows}
        self.tombstones = {k: set() for k in rows}
        self.step = next(iter(chain[-1].values())).step

    def mark_saved(self) -> None:
        self.marks += 1
        self.dirty = {k: set() for k in self.rows}
        self.tombstones = {k: set() for k in self.rows}


@pytest.fixture(scope="module")
def store():
    tables = [
        emb.TableSpec(name="user", vocab_size=10, dim=DIM),
        emb.TableSpec(
            name="item", dynamic=emb.DynamicVocab(), cache=emb.HostCache(rows=4), dim=DIM
        ),
    ]
    feats = [emb.FeatureSpec(name="u", table="user"), emb.FeatureSpec(name="i", table="item")]
    return make_store(tables, feats)


def _state(store, step: int) -> TrainState:
    tables = store.init(jax.random.key(step))
    return TrainState(
        step=jnp.int32(step),
        params={"w": jnp.full(2, float(step))},
        opt_state=(),
        tables={"embedding": tables},
        rng=jax.random.key_data(jax.random.key(1)),
    )


def _ckpt(path, store, host, **kw) -> Checkpointer:
    return Checkpointer(path, {("embedding",): store}, host=host, **kw)


def _train_and_save(ckpt, host, store, steps, *, evict=()) -> dict[int, dict]:
    """Train the fake to each step and save; the fake's state at each step."""
    at = {}
    for s in steps:
        host.train(s, evict=evict)
        ckpt.save(_state(store, s))
        at[s] = host.state()
    return at


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


# ---- the host steps alone -----------------------------------------------------------------
def test_full_and_deltas_rebuild_every_step_and_evicted_ids_stay_evicted(tmp_path):
    host = FakeHostTables()
    at, prev = {}, None
    for s in range(1, 6):
        host.train(s, evict=[7] if s == 3 else ())
        ht.write_step(
            tmp_path, s, host.snapshot({"embedding": {}}, incremental=s != 1), previous=prev
        )
        host.mark_saved()
        at[s], prev = host.state(), s
    assert ht.host_steps(tmp_path) == [1, 2, 3, 4, 5]
    assert ht.chain_steps(tmp_path, 4) == [1, 2, 3, 4]
    for s in range(1, 6):
        back = FakeHostTables()
        back.restore(ht.read_chain(tmp_path, s))
        assert back.state() == at[s], s
    assert all(7 not in rows for rows in at[5].values())  # tombstones carried
    m = ht.read_manifest(tmp_path, 3)
    assert (m["kind"], m["previous"]) == ("delta", 2)
    entry = m["tables"]["tower/emb.x/..%odd name"]
    assert entry["dir"] == "tower%2Femb.x%2F..%25odd%20name"
    assert entry["arrays"]["slot/accumulator"]["file"] == "slot%2Faccumulator.npy"
    assert set(entry["arrays"]["weights"]) >= {"crc32", "shape", "dtype", "bytes"}
    assert entry["meta"] == {"rows": len(at[3]["tower/emb.x/..%odd name"])}


def test_dtypes_and_large_arrays_round_trip(tmp_path):
    big = np.arange(300_000, dtype=np.float32).reshape(-1, 4)  # > 1 MiB: memory-mapped
    arrays = {
        "weights": big,
        "bf16": np.arange(6, dtype=ml_dtypes.bfloat16).reshape(2, 3),
        "empty": np.zeros((0, 4), np.float32),
        "u64": np.array([2**63 + 5], np.uint64),
    }
    ht.write_step(tmp_path, 9, {".": TableSnapshot("full", 9, arrays, {})}, previous=None)
    (got,) = ht.read_chain(tmp_path, 9)
    for name, a in arrays.items():
        assert got["."].arrays[name].dtype == a.dtype
        np.testing.assert_array_equal(got["."].arrays[name], a)
    got["."].arrays["weights"][0] = -1  # writable copy-on-write: the file keeps its bytes
    (again,) = ht.read_chain(tmp_path, 9)
    assert again["."].arrays["weights"][0, 0] == 0
    assert sorted(os.listdir(ht.step_dir(tmp_path, 9))) == ["%2E", "manifest.json"]


def test_a_delta_on_a_replaced_base_is_refused(tmp_path):
    host = FakeHostTables()
    for s, prev in [(1, None), (2, 1), (3, 2)]:
        host.train(s)
        ht.write_step(
            tmp_path, s, host.snapshot({"embedding": {}}, incremental=bool(prev)), previous=prev
        )
    # restored to 1 and trained on: a new save of step 2 replaces the one step 3 built on
    ht.write_step(tmp_path, 2, host.snapshot({"embedding": {}}, incremental=True), previous=1)
    assert ht.chain_steps(tmp_path, 2) == [1, 2]
    with pytest.raises(CheckpointUnreadableError, match=r"step 3 builds on a save of step 2 that"):
        ht.read_chain(tmp_path, 3)


def test_a_non_finite_host_array_is_named_and_nothing_is_written(tmp_path):
    host = FakeHostTables()
    host.train(1)
    snaps = host.snapshot({"embedding": {}}, incremental=False)
    snaps["embedding/item"].arrays["weights"][0, 1] = np.nan
    with pytest.raises(
        NonFiniteStateError, match=r"step 1: host table 'embedding/item' array 'weights'"
    ):
        ht.write_step(tmp_path, 1, snaps, previous=None)
    assert not os.path.exists(ht.host_dir(tmp_path)) or os.listdir(ht.host_dir(tmp_path)) == []
    with pytest.raises(CheckpointError, match="no previous save to build on"):
        ht.write_step(
            tmp_path, 2, host.snapshot({"embedding": {}}, incremental=True), previous=None
        )


# ---- through the Checkpointer ---------------------------------------------------------------
def test_checkpointer_saves_full_every_nth_and_restores_the_chain(tmp_path, store):
    host = FakeHostTables()
    ckpt = _ckpt(tmp_path, store, host, max_to_keep=5, full_every=3)
    at = _train_and_save(ckpt, host, store, [1, 2, 3, 4], evict=[5])
    assert host.snapshots == [False, True, True, False] and host.marks == 4
    kinds = [ht.read_manifest(tmp_path, s)["kind"] for s in (1, 2, 3, 4)]
    assert kinds == ["full", "delta", "delta", "full"]
    assert ckpt.steps() == [1, 2, 3, 4]  # orbax does not list host_tables/
    assert ckpt.read_meta(3)["host_tables"] == {
        "kind": "delta",
        "previous": 2,
        "tables": sorted(KEYS),
        "owners": 1,  # processes that wrote parts
    }
    back = FakeHostTables(seed=1)
    other = _ckpt(tmp_path, store, back, max_to_keep=5, full_every=3)
    state, meta = other.restore(_state(store, 0), step=3)
    assert int(state.step) == 3 and meta["step"] == 3 and back.state() == at[3]
    np.testing.assert_array_equal(state.params["w"], [3.0, 3.0])
    full, delta = dict.fromkeys(KEYS, "full"), dict.fromkeys(KEYS, "delta")
    assert back.restored == [[full, delta, delta]]
    # the static table came back from orbax; the tiered one is not in orbax's items
    exported = store.export_tables(state.tables["embedding"])
    assert set(exported) == {"user"}
    np.testing.assert_array_equal(
        exported["user"]["weights"],
        store.export_tables(_state(store, 3).tables["embedding"])["user"]["weights"],
    )
    # restored at 2 (one delta since its full save), the next save is the second delta
    other.restore(_state(store, 0), step=2)
    assert back.state() == at[2] and back.restored[-1] == [full, delta]
    back.train(6)
    other.save(_state(store, 6))
    assert back.snapshots == [True] and ht.read_manifest(tmp_path, 6)["previous"] == 2
    assert [snaps["embedding/item"].step for snaps in other.read_host_chain(6)] == [1, 2, 6]
    other.close()
    ckpt.close()


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_a_corrupt_delta_is_named_and_older_checkpoints_restore(tmp_path, store, damage):
    host = FakeHostTables()
    ckpt = _ckpt(tmp_path, store, host, max_to_keep=5, full_every=3)
    at = _train_and_save(ckpt, host, store, [1, 2, 3])  # full, delta, delta
    entry = ht.read_manifest(tmp_path, 3)["tables"]["embedding/item"]
    path = os.path.join(ht.step_dir(tmp_path, 3), entry["dir"], entry["arrays"]["weights"]["file"])
    if damage == "truncate":
        with open(path, "r+b") as fh:
            fh.truncate(os.path.getsize(path) - 5)
    elif damage == "flip":
        with open(path, "r+b") as fh:
            fh.seek(-3, os.SEEK_END)
            b = fh.read(1)
            fh.seek(-3, os.SEEK_END)
            fh.write(bytes([b[0] ^ 0xFF]))
    else:
        os.remove(path)
    back = FakeHostTables()
    other = _ckpt(tmp_path, store, back, max_to_keep=5, full_every=3)
    with pytest.raises(CheckpointUnreadableError) as e:
        other.restore(_state(store, 0), step=3)
    msg = _one_line(e)
    assert msg.startswith("checkpoint 3 in ") and path in msg
    assert msg.endswith("other checkpoints: [1, 2]")
    assert {"truncate": "bytes", "flip": "crc32 mismatch", "delete": "missing"}[damage] in msg
    assert back.restored == []  # nothing half-restored
    warned = []  # the full save and its earlier delta still restore
    state, _, skipped = other.restore_readable(_state(store, 0), warn=warned.append)
    assert int(state.step) == 2 and skipped == [3] and back.state() == at[2]
    assert warned[0].startswith("checkpoint 3 in ") and "using checkpoint 2" in warned[0]
    assert path in warned[0]
    # set aside (as the runner does): the delta goes with it, the next save builds on 2
    other.set_aside(3)
    assert other.steps() == [1, 2] and ht.host_steps(tmp_path) == [1, 2]
    assert os.path.isdir(ht.step_dir(str(tmp_path) + "_unreadable", 3))
    back.train(3)
    other.save(_state(store, 3))
    assert ht.read_manifest(tmp_path, 3)["previous"] == 2
    other.close()
    ckpt.close()


def test_a_missing_manifest_or_host_step_is_named(tmp_path, store):
    host = FakeHostTables()
    ckpt = _ckpt(tmp_path, store, host, max_to_keep=5, full_every=3)
    _train_and_save(ckpt, host, store, [1, 2, 3])
    manifest = os.path.join(ht.step_dir(tmp_path, 2), "manifest.json")
    os.remove(manifest)  # step 3's chain reads step 2
    for step in (2, 3):
        with pytest.raises(CheckpointUnreadableError) as e:
            ckpt.restore(_state(store, 0), step=step)
        assert f"checkpoint {step} in " in _one_line(e) and f"{manifest} is missing" in str(e.value)
    with open(os.path.join(ht.step_dir(tmp_path, 1), "manifest.json"), "w") as fh:
        fh.write('{"format": 1, "st')
    with pytest.raises(
        CheckpointUnreadableError, match=r"host-table file .*1/manifest.json is unreadable"
    ):
        ckpt.restore(_state(store, 0), step=1)
    with pytest.raises(
        CheckpointUnreadableError, match=r"no checkpoint in .* is readable \(steps 1, 2, 3"
    ):
        ckpt.restore_readable(_state(store, 0))
    ckpt.close()


def test_pruning_keeps_the_full_base_of_kept_deltas(tmp_path, store):
    host = FakeHostTables()
    ckpt = _ckpt(tmp_path, store, host, max_to_keep=2, full_every=3)
    kept = []
    for s in range(1, 6):  # full 1, delta 2, delta 3, full 4, delta 5
        host.train(s)
        ckpt.save(_state(store, s))
        kept.append((ckpt.steps(), ht.host_steps(tmp_path)))
    assert kept == [
        ([1], [1]),
        ([1, 2], [1, 2]),
        ([2, 3], [1, 2, 3]),  # 2 and 3 are deltas on the full 1
        ([3, 4], [1, 2, 3, 4]),
        ([4, 5], [4, 5]),
    ]
    ckpt.close()


def test_a_save_killed_midway_is_ignored_and_cleaned(tmp_path, store):
    host = FakeHostTables()
    ckpt = _ckpt(tmp_path, store, host, max_to_keep=3, full_every=2)
    at = _train_and_save(ckpt, host, store, [1, 2])
    # killed while writing step 3's host files (a temp folder), and killed after writing
    # step 4's but before its orbax save (a complete host step no checkpoint lists)
    gone = _dead_pid()
    tmp = os.path.join(ht.host_dir(tmp_path), f".tmp-3-{gone}-0badc0de")
    os.makedirs(os.path.join(tmp, "embedding%2Fitem"))
    with open(os.path.join(tmp, "embedding%2Fitem", "weights.npy"), "wb") as fh:
        fh.write(b"\x93NUMPY half")
    busy = os.path.join(ht.host_dir(tmp_path), f".tmp-3-{os.getppid()}-0badc0de")
    os.makedirs(busy)  # a save in progress in a live process: left alone
    host.train(4)
    ht.write_step(tmp_path, 4, host.snapshot({"embedding": {}}, incremental=True), previous=2)
    assert ht.host_steps(tmp_path) == [1, 2, 4] and ckpt.steps() == [1, 2]

    back = FakeHostTables()
    fresh = _ckpt(tmp_path, store, back, max_to_keep=3, full_every=2)
    state, _, skipped = fresh.restore_readable(_state(store, 0))
    assert int(state.step) == 2 and skipped == [] and back.state() == at[2]
    with pytest.raises(CheckpointError, match=r"no checkpoint 3 in .*available: \[1, 2\]"):
        fresh.restore(_state(store, 0), step=3)
    with pytest.raises(CheckpointUnreadableError, match=r"host_tables/3/manifest.json is missing"):
        ht.read_chain(tmp_path, 3)
    back.train(3)
    fresh.save(_state(store, 3))  # prunes the orphan 4 and the dead save's temp folder
    assert ht.host_steps(tmp_path) == [1, 2, 3]
    assert set(os.listdir(ht.host_dir(tmp_path))) == {"1", "2", "3", os.path.basename(busy)}
    fresh.close()
    ckpt.close()


def _dead_pid() -> int:
    import subprocess

    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_a_failed_orbax_save_leaves_the_tracking_and_the_chain_intact(tmp_path, store, monkeypatch):
    host = FakeHostTables()
    ckpt = _ckpt(tmp_path, store, host, max_to_keep=3, full_every=3)
    _train_and_save(ckpt, host, store, [1])
    host.train(2)

    def fail(*a, **k):
        raise OSError("disk full")

    with monkeypatch.context() as m:
        m.setattr(ckpt.manager, "save", fail)
        with pytest.raises(
            CheckpointWriteError,
            match=r"checkpoint 2 could not be written to .* \(OSError: disk full\); its partial "
            r"files were removed, the newest checkpoint is 1$",
        ):
            ckpt.save(_state(store, 2))
    assert host.marks == 1 and host.dirty["embedding/item"]  # not marked: the next delta has it
    assert ht.host_steps(tmp_path) == [1]  # the failed save's host step holds no disk space
    at = _train_and_save(ckpt, host, store, [3])
    assert ht.host_steps(tmp_path) == [1, 3] and ht.read_manifest(tmp_path, 3)["previous"] == 1
    back = FakeHostTables()
    _ckpt(tmp_path, store, back).restore(_state(store, 0), step=3)
    assert back.state() == at[3]
    ckpt.close()


def test_a_save_failing_after_orbax_wrote_leaves_only_complete_checkpoints(
    tmp_path, store, monkeypatch
):
    """A save that fails once orbax has written its files (e.g. the disk fills up while
    it finalizes) removes them: its temp folder or step folder, and its host step. A
    temp folder of a save killed earlier goes at the first save; complete ones stay."""
    host = FakeHostTables()
    ckpt = _ckpt(tmp_path, store, host, max_to_keep=3, full_every=1)
    _train_and_save(ckpt, host, store, [1])
    killed = tmp_path / "7.orbax-checkpoint-tmp"
    (killed / "state").mkdir(parents=True)  # a save killed midway, before this process
    fresh = _ckpt(tmp_path, store, host, max_to_keep=3, full_every=1)
    real_wait = fresh.manager.wait_until_finished
    calls = []

    def fail_once():
        real_wait()  # the files are on disk
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("RESOURCE_EXHAUSTED: Error writing local file")

    monkeypatch.setattr(fresh.manager, "wait_until_finished", fail_once)
    host.train(2)
    with pytest.raises(CheckpointWriteError, match="checkpoint 2 could not be written"):
        fresh.save(_state(store, 2))
    assert sorted(os.listdir(tmp_path)) == ["1", "host_tables"]
    assert fresh.steps() == [1] and ht.host_steps(tmp_path) == [1]
    at = _train_and_save(fresh, host, store, [2])  # the step saves again, then restores
    back = FakeHostTables()
    _ckpt(tmp_path, store, back).restore(_state(store, 0), step=2)
    assert back.state() == at[2] and fresh.steps() == [1, 2]
    fresh.close()
    ckpt.close()


def test_host_tables_are_needed_both_ways_and_a_second_checkpointer_leaves_tracking_alone(
    tmp_path, store
):
    host = FakeHostTables()
    ckpt = _ckpt(tmp_path / "run", store, host, full_every=4)
    best = _ckpt(tmp_path / "best", store, host, full_every=4, tracks_changes=False)
    at = _train_and_save(ckpt, host, store, [1])
    host.train(2)
    best.save(_state(store, 2))  # full, and the run's tracking still holds step 2's changes
    host.train(3)
    best.save(_state(store, 3))
    at |= _train_and_save(ckpt, host, store, [4])
    assert host.snapshots == [False, False, False, True] and host.marks == 2
    back = FakeHostTables()
    _ckpt(tmp_path / "run", store, back).restore(_state(store, 0))
    assert back.state() == at[4]
    assert ht.read_manifest(tmp_path / "best", 3)["kind"] == "full"
    added = FakeHostTables(keys=(*KEYS, "embedding/new"))
    with pytest.raises(CheckpointError, match=r"checkpoint 4 in .*: the checkpoint has no host"):
        _ckpt(tmp_path / "run", store, added).restore(_state(store, 0))

    plain = Checkpointer(tmp_path / "run", {("embedding",): store})
    with pytest.raises(CheckpointError, match=r"holds tiered tables .*give the Checkpointer host="):
        plain.restore(_state(store, 0))
    plain.save(_state(store, 7))
    again = _ckpt(tmp_path / "run", store, host)
    with pytest.raises(CheckpointError, match="checkpoint 7 in .* was saved without host tables"):
        again.restore(_state(store, 0), step=7)
    with pytest.raises(CheckpointError, match="was saved without host tables"):
        again.read_host_chain(7)
    with pytest.raises(ValueError, match=r"checkpoint 7 already exists in "):
        again.save(_state(store, 7))  # refused before the host step is written
    assert 7 not in ht.host_steps(tmp_path / "run")
    assert [sorted(c) for c in ckpt.read_host_chain(4)] == [sorted(KEYS)] * 2
    for c in (ckpt, best, plain, again):
        c.close()


def test_every_table_tiered_and_serving_restores_the_host_side(tmp_path):
    """No static table: orbax gets no tables item (it refuses an empty one)."""
    only = make_store(
        [emb.TableSpec(name="item", dynamic=emb.DynamicVocab(max_rows=8), dim=DIM)],
        [emb.FeatureSpec(name="i", table="item")],
    )
    host = FakeHostTables(keys=("embedding/item",))
    ckpt = _ckpt(tmp_path, only, host, full_every=5)
    at = _train_and_save(ckpt, host, only, [1, 2])
    back = FakeHostTables(keys=("embedding/item",))
    state, _ = _ckpt(tmp_path, only, back).restore(_state(only, 0), step=1)
    assert int(state.step) == 1 and back.state() == at[1]
    serving = _ckpt(tmp_path, only, back)
    tables, meta = serving.restore_tables()  # no template, no trainer
    assert meta["host_tables"] == {
        "kind": "delta",
        "previous": 1,
        "tables": ["embedding/item"],
        "owners": 1,
    }
    assert back.state() == at[2] and len(back.restored) == 2
    cache = tables["embedding"]
    assert jax.tree.map(np.shape, cache) == jax.tree.map(
        np.shape, _state(only, 0).tables["embedding"]
    )
    assert not np.asarray(jax.tree.leaves(cache)[-1]).any()  # an empty cache
    with pytest.raises(CheckpointError, match=r"holds tiered tables \['embedding/item'\]"):
        Checkpointer(tmp_path, {("embedding",): only}).restore_tables()
    ckpt.close()
