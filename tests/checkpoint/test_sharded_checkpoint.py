"""Checkpoints of sharded tables: each table saved in its logical layout as the store
shards it, restored as another store shards it (row-wise <-> table-wise, 4 devices -> 2
-> 1), every array verified against block checksums that do not depend on the sharding;
changed or missing data named (table, array, rows, folder); checkpoints of the previous
format (tables whole, no checksums) restored; a restore with too little memory refused
before it reads; a table alone in its stack written without a copy. The states need no
trainer: nothing here compiles a model."""

import dataclasses
import glob
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sparsejax import embedding as emb
from sparsejax.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointUnreadableError,
    _checkpointer,
    _sharded,
    _verify,
)
from sparsejax.checkpoint._checkpointer import NonFiniteStateError
from sparsejax.sharding import _layout, make_mesh, make_store
from sparsejax.train import TrainState

FEATURES = [emb.FeatureSpec(name="u", table="user"), emb.FeatureSpec(name="a", table="ad")]
LAYER = ("embedding",)


def _store(placements, devices):
    user, ad = placements
    tables = [
        emb.TableSpec(name="user", vocab_size=1001, dim=4, placement=user),
        emb.TableSpec(name="ad", vocab_size=50, dim=3, placement=ad, dtype="bfloat16"),
    ]
    mesh = make_mesh(model=devices, devices=jax.devices()[:devices])
    return make_store(tables, FEATURES, mesh=None if user == "device" else mesh)


def _state(store, step=3, seed=0) -> TrainState:
    tables = store.init(jax.random.key(seed))
    return TrainState(
        step=jnp.int32(step),
        params={"w": jnp.arange(6.0).reshape(2, 3)},
        opt_state=(),
        tables={"embedding": tables},
        rng=jax.random.key_data(jax.random.key(1)),
    )


def _by_name(store, state) -> dict:
    return jax.device_get(store.export_tables(state.tables["embedding"]))


def _ckpt(path, store) -> Checkpointer:
    return Checkpointer(path, {LAYER: store})


def _abstract(state):
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )


def _overwrite(item_dir, array, index, value) -> None:
    """Change values of one saved array in place (what corrupt data looks like to orbax:
    it reads without error)."""
    t = ts.open(
        {
            "driver": "zarr",
            "kvstore": {"driver": "ocdbt", "base": f"file://{item_dir}/", "path": f"{array}/"},
        }
    ).result()
    t[index].write(value).result()


# ---- the checksums ---------------------------------------------------------------------


def test_block_checksums_are_the_same_for_every_sharding_and_catch_changes():
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    rng = np.random.default_rng(0)
    for dtype in (np.float32, jnp.bfloat16, np.int8, np.bool_):
        x = (rng.standard_normal((1000, 6)) * 3).astype(dtype)
        whole = _verify.local_sums({"a": x}, {"a": 998})[0]["a"]
        for spec in (P(), P("model"), P(None, "model"), P(("data", "model")), P("data", "model")):
            sharded = jax.device_put(x, NamedSharding(mesh, spec))
            got = _verify.local_sums({"a": sharded}, {"a": 998})[0]["a"]
            np.testing.assert_array_equal(got, whole, err_msg=f"{dtype} {spec}")
        # rows past the counted ones (padding) are left out
        padded = np.concatenate([x, np.ones((10, 6), x.dtype)])
        np.testing.assert_array_equal(_verify.local_sums({"a": padded}, {"a": 998})[0]["a"], whole)
    x = rng.standard_normal((300_000, 2)).astype(np.float32)  # 5 blocks of 2**16 rows
    whole = _verify.local_sums({"a": x}, {"a": len(x)})[0]["a"]
    assert whole.shape == (5,)
    flipped = x.copy()
    flipped.view(np.uint32)[200_000, 1] ^= 1 << 30  # one bit, in block 3
    swapped = x.copy()
    swapped[[7, 8]] = swapped[[8, 7]]  # two rows swapped, in block 0
    for changed, block in ((flipped, 3), (swapped, 0)):
        got = _verify.local_sums({"a": changed}, {"a": len(x)})[0]["a"]
        assert np.nonzero(got != whole)[0].tolist() == [block]
        assert _verify.first_mismatch(whole.tolist(), got, len(x)) == (
            block * 65536,
            min(len(x), (block + 1) * 65536),
        )


# ---- resharding ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("saved", "restored"),
    [
        ((("row_wise", "table_wise"), 4), (("table_wise", "row_wise"), 2)),
        ((("table_wise", "row_wise"), 2), (("row_wise", "row_wise"), 3)),  # other padding
        ((("row_wise", "table_wise"), 4), (("device", "device"), 1)),
        ((("device", "device"), 1), (("row_wise", "table_wise"), 4)),
    ],
)
def test_restores_bitwise_on_other_placements_and_device_counts(
    tmp_path, monkeypatch, saved, restored
):
    """Read 16 rows of `user` at a time, straight into buffers the devices own."""
    monkeypatch.setattr(_sharded, "READ_BYTES", 16 * 4 * 4)
    src, dst = _store(*saved), _store(*restored)
    state = _state(src)
    with _ckpt(tmp_path, src) as ckpt:
        ckpt.save(state)
    with _ckpt(tmp_path, dst) as ckpt:
        got, meta = ckpt.restore(_abstract(_state(dst, seed=5)))
    assert meta["format"] == 2 and "tables/embedding/user/weights" in meta["checksums"]
    jax.tree.map(np.testing.assert_array_equal, _by_name(dst, got), _by_name(src, state))
    np.testing.assert_array_equal(got.params["w"], state.params["w"])
    with _ckpt(tmp_path, dst) as ckpt:  # tables alone (serving)
        tables, _ = ckpt.restore_tables()
    jax.tree.map(
        np.testing.assert_array_equal,
        jax.device_get(dst.export_tables(tables["embedding"])),
        _by_name(src, state),
    )


def _pointers(a: jax.Array) -> dict:
    return {s.device: s.data.unsafe_buffer_pointer() for s in a.addressable_shards}


@pytest.mark.parametrize("placements", [("row_wise", "table_wise"), ("device", "device")])
def test_a_table_alone_in_its_stack_is_saved_without_a_copy(tmp_path, monkeypatch, placements):
    """A table of `ALONE_BYTES` or more is a stack of its own, so what a save writes is
    its stack's arrays themselves (no copy of the table while it is saved)."""
    monkeypatch.setattr(emb._stacking, "ALONE_BYTES", 2048)
    monkeypatch.setattr(_layout, "ALONE_BYTES", 2048)
    src = _store(placements, 4)
    (user_stack,) = [n for n in src.stacks if n.endswith("_user")]
    assert not any(n.endswith("_ad") for n in src.stacks)  # a small table stays stacked
    if placements[0] == "row_wise":  # a restore's import copies the stacked blocks only
        (ad_stack,) = [n for n in src.stacks if n != user_stack]
        # ad (table-wise) is whole on one shard, the 3 others' blocks are filled; user:
        # 1001 rows in 4 blocks of 251, the last padded (so assembled)
        want = 3 * src.device_bytes(ad_stack) + src.device_bytes(user_stack)
        assert src.import_copy_bytes() == want
    state = _state(src)
    tables = state.tables["embedding"]
    sharded = src.sharded_tables(tables)
    assert _pointers(sharded["user"]["weights"]) == _pointers(tables[user_stack]["weights"])
    with _ckpt(tmp_path, src) as ckpt:
        ckpt.save(state)
    dst = _store(("table_wise", "row_wise") if placements[0] == "device" else ("device",) * 2, 2)
    with _ckpt(tmp_path, dst) as ckpt:
        got, _ = ckpt.restore(_abstract(_state(dst, seed=5)))
    jax.tree.map(np.testing.assert_array_equal, _by_name(dst, got), _by_name(src, state))


# ---- bad input -------------------------------------------------------------------------


def test_changed_table_data_is_named_and_an_older_checkpoint_used(tmp_path):
    store = _store(("row_wise", "table_wise"), 4)
    with _ckpt(tmp_path, store) as ckpt:
        ckpt.save(_state(store, step=1))
        good = _state(store, step=2, seed=1)
        ckpt.save(good)
        ckpt.save(_state(store, step=3, seed=2))
    _overwrite(tmp_path / "3" / "tables", "embedding.user.weights", (700, 2), 1.5e34)
    _overwrite(tmp_path / "2" / "state", "params.w", (1, 1), -7.0)
    with _ckpt(tmp_path, store) as ckpt:
        with pytest.raises(CheckpointUnreadableError) as e:
            ckpt.restore(_abstract(good), 3)
        msg = str(e.value)
        assert "\n" not in msg
        assert "checkpoint 3" in msg and "is corrupt: table 'user' (layer embedding) weights" in msg
        assert "rows [0, 1001)" in msg
        assert f"'embedding.user.weights' of {tmp_path / '3' / 'tables'}" in msg
        with pytest.raises(CheckpointUnreadableError, match=r"state params/w rows \[0, 2\)"):
            ckpt.restore(_abstract(good), 2)
        warnings = []
        got, _, skipped = ckpt.restore_readable(_abstract(good), warn=warnings.append)
    assert skipped == [3, 2] and int(got.step) == 1
    assert "checkpoints 3, 2" in warnings[0] and "table 'user'" in warnings[0]


def test_flipped_bytes_or_a_missing_data_file_name_the_table_and_folder(tmp_path):
    store = _store(("row_wise", "table_wise"), 4)
    state = _state(store)
    with _ckpt(tmp_path, store) as ckpt:
        ckpt.save(state)
    item = tmp_path / "3" / "tables"
    files = sorted(glob.glob(f"{item}/**/d/*", recursive=True), key=os.path.getsize)
    data = bytearray(Path(files[-1]).read_bytes())  # the largest: the tables' chunks
    for i in range(len(data) // 3, len(data) // 3 + 8):
        data[i] ^= 0xFF
    Path(files[-1]).write_bytes(bytes(data))
    with _ckpt(tmp_path, store) as ckpt, pytest.raises(CheckpointUnreadableError) as e:
        ckpt.restore(_abstract(state))
    msg = str(e.value)
    assert "\n" not in msg and ("table 'user'" in msg or "table 'ad'" in msg), msg
    assert str(item) in msg and ("checksum mismatch" in msg or "is corrupt" in msg), msg
    os.remove(files[-1])
    with _ckpt(tmp_path, store) as ckpt, pytest.raises(CheckpointUnreadableError) as e:
        ckpt.restore_tables()
    msg = str(e.value)
    assert "\n" not in msg and "(layer embedding) weights does not read" in msg, msg
    assert f"its data file {files[-1]} is missing" in msg, msg


def test_a_non_finite_table_is_not_saved_and_named(tmp_path):
    store = _store(("row_wise", "table_wise"), 4)
    state = _state(store)
    by_name = store.export_tables(state.tables["embedding"])
    by_name["user"]["weights"] = by_name["user"]["weights"].at[999, 1].set(jnp.inf)
    state = dataclasses.replace(state, tables={"embedding": store.import_tables(by_name)})
    with _ckpt(tmp_path, store) as ckpt, pytest.raises(NonFiniteStateError) as e:
        ckpt.save(state)
    assert "table 'user' (layer embedding) weights holds NaN or inf" in str(e.value)
    assert not os.path.exists(tmp_path / "3")


def test_a_restore_without_room_is_refused_before_reading(tmp_path, monkeypatch):
    store = _store(("row_wise", "table_wise"), 4)
    state = _state(store)
    with _ckpt(tmp_path, store) as ckpt:
        ckpt.save(state)
    monkeypatch.setattr(_checkpointer, "available_memory", lambda devices: (1000, "test memory"))
    read = []
    monkeypatch.setattr(_checkpointer.Checkpointer, "_read_layer", lambda *a: read.append(a))
    with _ckpt(tmp_path, store) as ckpt, pytest.raises(CheckpointError) as e:
        ckpt.restore(_abstract(state))
    msg = str(e.value)
    assert "\n" not in msg and not read
    assert "restoring needs" in msg and "in process 0" in msg
    assert "1000 B is available (test memory)" in msg


# ---- the previous format ---------------------------------------------------------------


def test_a_checkpoint_of_the_previous_format_restores(tmp_path):
    """Format 1 (before sharded checkpoints): each table whole `[vocab, dim]`, replicated,
    saved with `StandardSave`; meta without "format" and checksums."""
    old = _store(("device", "device"), 1)
    state = _state(old)
    with _ckpt(tmp_path, old) as ckpt:
        specs = ckpt._specs()
    rest = {"step": state.step, "params": state.params, "opt_state": (), "rng": state.rng}
    meta = {"step": 3, "tables": specs, "data_position": 7, "extra": {}, "host_tables": None}
    manager = ocp.CheckpointManager(tmp_path, options=ocp.CheckpointManagerOptions(create=True))
    manager.save(
        3,
        args=ocp.args.Composite(
            tables=ocp.args.StandardSave(
                {"embedding": old.export_tables(state.tables["embedding"])}
            ),
            state=ocp.args.StandardSave(rest),
            meta=ocp.args.JsonSave(meta),
        ),
    )
    manager.wait_until_finished()
    manager.close()
    new = _store(("row_wise", "table_wise"), 4)  # 1001 rows padded to 1004
    with _ckpt(tmp_path, new) as ckpt:
        got, meta = ckpt.restore(_abstract(_state(new, seed=9)))
    assert meta["data_position"] == 7 and "checksums" not in meta
    jax.tree.map(np.testing.assert_array_equal, _by_name(new, got), _by_name(old, state))
    np.testing.assert_array_equal(got.params["w"], state.params["w"])
