"""Per-shard init: a table's initial values are a pure function of (key, table name,
global row), drawn in fixed blocks, so any range of rows drawn alone, any placement on
1, 2 or 8 devices, and 2 processes give bitwise the table one device draws; each process
draws only its shards. Memory and int32 refusals name the table, the need and what is
available (or the devices it needs)."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from sparsejax import ops
from sparsejax.embedding import (
    DeviceTableStore,
    FeatureSpec,
    TableSpec,
    fill_rows,
    init_block_rows,
    normal_init,
    truncated_normal_init,
    uniform_init,
)
from sparsejax.sharding import ShardedTableStore, _launch, make_mesh

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLACEMENTS = ["replicated", "table_wise", "column_wise", "table_row_wise", "row_wise"]


def _mesh(data, model):
    return make_mesh(model=model, devices=jax.devices()[: data * model])


def _specs(placement, vocab=(50, 37, 9)):
    opt = ops.Adagrad(learning_rate=0.1)
    tables = [
        TableSpec(name="user", vocab_size=vocab[0], dim=8, optimizer=opt, placement=placement),
        TableSpec(name="item", vocab_size=vocab[1], dim=8, optimizer=opt, placement=placement),
        TableSpec(
            name="tag",
            vocab_size=vocab[2],
            dim=4,
            optimizer=opt,
            placement=placement,
            initializer=normal_init(0.3),
        ),
    ]
    features = [FeatureSpec(name=t.name, table=t.name) for t in tables]
    return tables, features


def _device_tables(tables, features, key):
    plain = [TableSpec(**{**t.__dict__, "placement": "device"}) for t in tables]
    ref = DeviceTableStore(plain, features)
    return jax.tree.map(np.asarray, ref.export_tables(ref.init(key)))


@pytest.mark.parametrize(
    "init",
    [uniform_init(), normal_init(), truncated_normal_init(0.1), lambda k, s, d: None],
    ids=["uniform", "normal", "truncated", "jax"],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_any_range_of_rows_drawn_alone_equals_the_whole_table(init, dtype):
    if not hasattr(init, "fill"):  # a jax initializer: one draw per block
        init = lambda k, s, d: jax.random.uniform(k, s, d, -0.5, 0.5)  # noqa: E731
    dim = 16
    br = init_block_rows(dim)
    spec = TableSpec(name="t", vocab_size=2 * br + 123, dim=dim, dtype=dtype, initializer=init)
    key = jax.random.key(5)
    whole = np.empty((spec.vocab_size, dim), jax.numpy.dtype(dtype))
    fill_rows(key, spec, 0, whole)
    assert np.unique(whole[:, 0]).size > 100  # drawn, not constant
    assert not np.array_equal(whole[:br], whole[br : 2 * br])  # blocks differ
    for lo, hi in [
        (0, 1),
        (br - 3, br + 5),
        (br, 2 * br),
        (7, 2 * br + 123),
        (2 * br + 100, 2 * br + 123),
    ]:
        part = np.empty((hi - lo, dim), whole.dtype)
        fill_rows(key, spec, lo, part)
        np.testing.assert_array_equal(part, whole[lo:hi], err_msg=f"rows {lo}:{hi}")
        cols = np.empty((hi - lo, 4), whole.dtype)
        fill_rows(key, spec, lo, cols, slice(4, 8))
        np.testing.assert_array_equal(cols, whole[lo:hi, 4:8])
    other = np.empty_like(whole[:10])
    fill_rows(
        key,
        TableSpec(name="u", vocab_size=spec.vocab_size, dim=dim, dtype=dtype, initializer=init),
        0,
        other,
    )
    assert not np.array_equal(other, whole[:10])  # the name counts


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_every_placement_on_1_2_8_devices_draws_the_one_device_tables(placement):
    tables, features = _specs(placement)
    key = jax.random.key(11)
    want = _device_tables(tables, features, key)
    for data, model in [(1, 1), (1, 2), (2, 1), (2, 4)]:
        store = ShardedTableStore(tables, features, mesh=_mesh(data, model))
        got = jax.tree.map(np.asarray, store.export_tables(store.init(key)))
        jax.tree.map(np.testing.assert_array_equal, got, want)


@pytest.mark.parametrize("placement", ["replicated", "table_row_wise", "row_wise"])
def test_tables_staged_in_small_blocks_are_the_tables_one_block_gives(monkeypatch, placement):
    """Blocks of a few rows (the last one overlapping the one before) give the tables
    one block gives."""
    from sparsejax.embedding import _device_store

    tables, features = _specs(placement)
    key = jax.random.key(5)
    want = _device_tables(tables, features, key)
    monkeypatch.setattr(_device_store, "FILL_BYTES", 3 * 8 * 4)  # 3 rows of dim 8
    plain = [TableSpec(**{**t.__dict__, "placement": "device"}) for t in tables]
    for store in (
        DeviceTableStore(plain, features),
        ShardedTableStore(tables, features, mesh=_mesh(2, 4)),
    ):
        got = jax.tree.map(np.asarray, store.export_tables(store.init(key)))
        jax.tree.map(np.testing.assert_array_equal, got, want)


def test_memory_refusal_names_the_table_the_need_and_what_is_available(monkeypatch):
    from sparsejax.sharding import _store

    tables, features = _specs("row_wise", vocab=(4000, 37, 9))
    tables = tables[:1]
    store = ShardedTableStore(tables, features[:1], mesh=_mesh(2, 2))
    per_device, host = store.init_memory(next(iter(store.stacks)))
    assert per_device == 1000 * 8 * 4 * 2  # one shard: weights + Adagrad's accumulator
    monkeypatch.setattr(_store, "available_memory", lambda devices: (1000, "host MemAvailable"))
    with pytest.raises(MemoryError) as e:
        store.init(jax.random.key(0))
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("ShardedTableStore.init: table 'user' (row_wise) needs ")
    assert "but 1000 B is available (host MemAvailable)" in msg


def test_a_shard_over_int32_rows_is_refused_with_the_devices_it_needs():
    opt = ops.SGD(learning_rate=0.1)
    big = TableSpec(name="wide", vocab_size=3 * 10**9, dim=1, optimizer=opt, placement="row_wise")
    f = [FeatureSpec(name="w", table="wide")]
    with pytest.raises(ValueError, match=r"table 'wide': .* row_wise needs at least 2 devices"):
        ShardedTableStore([big], f, mesh=_mesh(1, 1))
    # accepted on 2 devices: each shard 1.5e9 rows; the logical table keeps all its rows
    store = ShardedTableStore([big], f, mesh=_mesh(1, 2))
    sds = store.abstract_sharded_tables()["wide"]["weights"]
    assert sds.shape == (3 * 10**9, 1)
    (st,) = store.stacks.values()
    owner, local = st.pieces[0].route(np.array([0, 1_500_000_000, 2**31 + 5], np.int64), 2)
    np.testing.assert_array_equal(owner, [0, 1, 1])
    np.testing.assert_array_equal(local, [0, 0, 2**31 + 5 - 1_500_000_000])
    with pytest.raises(ValueError, match="int32"):  # a whole table stays below 2**31
        TableSpec(name="huge", vocab_size=2**31, dim=1, optimizer=opt, placement="table_wise")


_CHILD = r"""
import sys
import numpy as np
from sparsejax.sharding import _distributed
_distributed.initialize_from_env()
import jax
from sparsejax import ops
from sparsejax.embedding import FeatureSpec, TableSpec
from sparsejax.sharding import ShardedTableStore, make_mesh

opt = ops.Adagrad(learning_rate=0.1)
tables = [
    TableSpec(name="rows", vocab_size=301, dim=8, optimizer=opt, placement="row_wise"),
    TableSpec(name="whole", vocab_size=40, dim=8, optimizer=opt, placement="table_wise"),
    TableSpec(name="cols", vocab_size=30, dim=8, optimizer=opt, placement="column_wise"),
]
features = [FeatureSpec(name=t.name, table=t.name) for t in tables]
store = ShardedTableStore(tables, features, mesh=make_mesh(model=2))
state = store.init(jax.random.key(11))
sharded = store.sharded_tables(state)
out = {}
for name, t in sharded.items():
    for sh in t["weights"].addressable_shards:
        r, c = sh.index
        out[f"{name}_{r.start or 0}_{c.start or 0}"] = np.asarray(sh.data)
# back through the seam: each device rebuilds its block from its own rows
again = store.sharded_tables(store.import_sharded_tables(sharded))
for name, t in again.items():
    for a, b in zip(t["weights"].addressable_shards, sharded[name]["weights"].addressable_shards):
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data)), name
np.savez(sys.argv[1] + f"/p{jax.process_index()}.npz", **out)
"""


def test_two_processes_draw_only_their_shards_and_match_one_process(tmp_path):
    port = _launch.free_port()
    env0 = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(tmp_path)],
            env=_launch.child_env(i, 2, f"127.0.0.1:{port}", devices_per_process=1, base=env0),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out.decode()[-2000:]
    opt = ops.Adagrad(learning_rate=0.1)
    tables = [
        TableSpec(name="rows", vocab_size=301, dim=8, optimizer=opt),
        TableSpec(name="whole", vocab_size=40, dim=8, optimizer=opt),
        TableSpec(name="cols", vocab_size=30, dim=8, optimizer=opt),
    ]
    want = _device_tables(
        tables, [FeatureSpec(name=t.name, table=t.name) for t in tables], jax.random.key(11)
    )
    parts = [dict(np.load(tmp_path / f"p{i}.npz")) for i in range(2)]
    # row-wise: process i holds rows [151 i, 151 (i + 1)); table-wise: one process none
    assert {k for k in parts[0] if k.startswith("rows")} == {"rows_0_0"}
    assert {k for k in parts[1] if k.startswith("rows")} == {"rows_151_0"}
    assert sum(any(k.startswith("whole") for k in p) for p in parts) == 1
    got_rows = np.concatenate([parts[0]["rows_0_0"], parts[1]["rows_151_0"]])
    np.testing.assert_array_equal(got_rows[:301], want["rows"]["weights"])
    (whole,) = [p["whole_0_0"] for p in parts if "whole_0_0" in p]
    np.testing.assert_array_equal(whole, want["whole"]["weights"])
    cols = np.concatenate([parts[0]["cols_0_0"], parts[1]["cols_0_4"]], axis=1)
    np.testing.assert_array_equal(cols, want["cols"]["weights"])
