"""Host-executed tables (`placement="host"`): looked up and updated on the host's CPU
beside the dense step, they train bit for bit as the same tables on the device: alone
or beside device tables, with the look-ahead pipeline (the next batch looked up before
the update, the bags reading an updated row recomputed after it), on a data-parallel
mesh, with schedules and L2, through evals, restores and the runner."""

import dataclasses

import jax
import numpy as np
import optax
import pytest

from sparsejax import runner
from sparsejax.data import PaddedIds, SparseBatch
from sparsejax.embedding import Composition, FeatureSpec, HostCache, TableSpec
from sparsejax.embedding.host import HostExecution, HybridTableStore
from sparsejax.nn import DLRM
from sparsejax.ops.optimizers import SGD, RowWiseAdagrad
from sparsejax.runner._config import ConfigError
from sparsejax.sharding import make_mesh
from sparsejax.train import Schedule, Trainer
from sparsejax.train._trainer import TrainState

B, DIM = 16, 4
FEATURES = (
    FeatureSpec(name="user", table="user"),
    FeatureSpec(name="items", table="item", combiner="mean", max_ids=3),
    FeatureSpec(name="items_max", table="item", combiner="max", max_ids=3),
    FeatureSpec(name="plain", table="plain", combiner="sqrtn", max_ids=2),
)


def _look_ahead(trainer: Trainer, on: bool) -> None:
    """Turn the host-executed tables' look-ahead on or off (default: on accelerators)."""
    for part in trainer.host.parts:
        if isinstance(part, HostExecution):
            part.looks_ahead = on


def _tables(opt, host=()):
    sizes = {"user": 300, "item": 200, "plain": 30}
    return tuple(
        TableSpec(
            name=n,
            vocab_size=v,
            dim=DIM,
            optimizer=opt,
            placement="host" if n in host else "device",
        )
        for n, v in sizes.items()
    )


def _bags(rng, vocab, width, s=1.1):
    """CSR ids of B bags of 0..width zipf ids (duplicates, empty bags, padding at the
    end, out-of-table ids never)."""
    p = 1.0 / np.arange(1, vocab + 1) ** s
    lens = rng.integers(0, width + 1, B)
    ids = np.full(B * width, -1, np.int32)
    segs = np.full(B * width, B - 1, np.int32)
    at = 0
    for b, n in enumerate(lens):
        ids[at : at + n] = rng.choice(vocab, n, p=p / p.sum())
        segs[at : at + n] = b
        at += n
    return PaddedIds(ids, segs)


def _batches(steps, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        user = _bags(rng, 300, 1)
        user = PaddedIds(
            np.maximum(user.ids, rng.integers(0, 300, B)).astype(np.int32),
            np.arange(B, dtype=np.int32),
        )
        out.append(
            SparseBatch(
                features={
                    "user": user,
                    "items": _bags(rng, 200, 3),
                    "items_max": _bags(rng, 200, 3),
                    "plain": _bags(rng, 30, 2),
                },
                dense=rng.normal(size=(B, 2)).astype(np.float32),
                labels=rng.integers(0, 2, B).astype(np.float32),
                mask=np.ones(B, np.float32),
            )
        )
    return out


def _trainer(tables, **kw):
    model = DLRM(tables=tables, features=FEATURES, bottom=(8, DIM), top=(8, 1))
    return Trainer(model, optax.adam(0.01), **kw)


def _train(trainer, batches, *, look_ahead=False, evals=()):
    state = trainer.init(jax.random.key(0), batches[0])
    _look_ahead(trainer, look_ahead)
    losses, evaluated = [], []
    for i, b in enumerate(batches):
        nxt = batches[i + 1] if i + 1 < len(batches) else None
        state, m = trainer.train_step(state, b, nxt)
        losses.append(float(m["loss"]))
        if i in evals:
            evaluated.append(trainer.evaluate(state, batches[:2])["loss"])
    return state, np.array(losses), evaluated


def _tables_of(trainer, state):
    return jax.device_get(trainer.tables_by_name(state))["embedding"]


def _assert_same_tables(a, b):
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name]["weights"], b[name]["weights"])
        for k in a[name]["slots"]:
            np.testing.assert_array_equal(a[name]["slots"][k], b[name]["slots"][k])


@pytest.mark.parametrize("look_ahead", [False, True])
@pytest.mark.parametrize("host", [("user", "item"), ("user", "item", "plain")])
def test_host_tables_train_bit_for_bit_as_on_the_device(host, look_ahead):
    opt = RowWiseAdagrad(learning_rate=0.2)
    batches = _batches(25)
    kw = {"sparse_schedule": Schedule(warmup_steps=5), "sparse_l2": 1e-3}
    ref = _trainer(_tables(opt), **kw)
    ref_state, ref_losses, ref_evals = _train(ref, batches, evals=(3, 10))
    hybrid = _trainer(_tables(opt, host), **kw)
    state, losses, evals = _train(hybrid, batches, look_ahead=look_ahead, evals=(3, 10))
    assert isinstance(hybrid.layouts[("embedding",)], HybridTableStore)
    # the host tables live on the host's CPU, outside the jitted step
    host_leaf = jax.tree.leaves(state.tables["embedding"]["host"])[0]
    assert host_leaf.devices() == {jax.devices("cpu")[0]}
    np.testing.assert_array_equal(losses, ref_losses)
    np.testing.assert_array_equal(evals, ref_evals)
    _assert_same_tables(_tables_of(hybrid, state), _tables_of(ref, ref_state))
    stats = hybrid.host.stats()["host-executed tables"]
    if look_ahead:  # every step but the first was looked up ahead; some bags redone
        assert stats["bags_looked_ahead"] > 0 and 0 < stats["recomputed_fraction"] < 1
    else:
        assert stats["bags_looked_ahead"] == 0


def test_composed_host_tables_train_as_on_the_device():
    """A quotient-remainder table on the host: the host splits the feature's ids into
    its parts' as the layer does, so it trains as the same composed table on the device."""
    opt = RowWiseAdagrad(learning_rate=0.2)
    compose = {  # "items" pools bags (sum, max): its table's parts are concatenated
        "user": Composition(kind="qr", fraction=0.5),
        "item": Composition(kind="qr", fraction=0.5, op="concat"),
    }

    def tables(host):
        return tuple(
            dataclasses.replace(t, compose=compose.get(t.name)) for t in _tables(opt, host)
        )

    batches = _batches(8)
    ref = _trainer(tables(()))
    ref_state, ref_losses, _ = _train(ref, batches)
    hybrid = _trainer(tables(("user", "item")))
    state, losses, _ = _train(hybrid, batches, look_ahead=True)
    assert set(hybrid.layouts[("embedding",)].host.tables) == {
        "user.q",
        "user.r",
        "item.q",
        "item.r",
    }
    np.testing.assert_array_equal(losses, ref_losses)
    _assert_same_tables(_tables_of(hybrid, state), _tables_of(ref, ref_state))


def test_host_tables_beside_a_host_cached_device_table():
    """A device table behind a host cache (`HostTables` exchanges its rows) in the same
    layer as host-executed tables: both host sides run, in their order, each step."""
    opt = RowWiseAdagrad(learning_rate=0.2)

    def tables(host):
        cached = HostCache(rows=24)
        return tuple(
            dataclasses.replace(t, cache=cached) if t.name == "plain" else t
            for t in _tables(opt, host)
        )

    batches = _batches(8)
    ref_state, ref_losses, _ = _train(_trainer(tables(())), batches)
    hybrid = _trainer(tables(("user", "item")))
    state, losses, _ = _train(hybrid, batches, look_ahead=True)
    assert [p.name for p in hybrid.host.parts] == ["host-executed tables", "tiered tables"]
    np.testing.assert_array_equal(losses, ref_losses)


def test_a_look_ahead_of_another_batch_or_state_is_not_used():
    """The next call's batch or state differs from what `finish` saw: a full lookup."""
    opt = SGD(learning_rate=0.3)
    batches, other = _batches(6), _batches(6, seed=1)
    ref = _trainer(_tables(opt))
    ref_state = ref.init(jax.random.key(0), batches[0])
    hybrid = _trainer(_tables(opt, ("item",)))
    state = hybrid.init(jax.random.key(0), batches[0])
    _look_ahead(hybrid, True)
    for b, promised in zip(batches, other, strict=True):  # promises a batch never given
        ref_state, ref_m = ref.train_step(ref_state, b)
        state, m = hybrid.train_step(state, b, promised)
        assert float(m["loss"]) == float(ref_m["loss"])
    assert hybrid.host.stats()["host-executed tables"]["bags_looked_ahead"] == 0
    _assert_same_tables(_tables_of(hybrid, state), _tables_of(ref, ref_state))


def test_host_tables_beside_a_data_parallel_mesh():
    opt = RowWiseAdagrad(learning_rate=0.2)
    batches = _batches(8)
    mesh = make_mesh(model=1, devices=jax.devices()[:4])
    ref = _trainer(_tables(opt), mesh=mesh)
    ref_state, ref_losses, _ = _train(ref, batches)
    hybrid = _trainer(_tables(opt, ("user",)), mesh=mesh)
    state, losses, _ = _train(hybrid, batches, look_ahead=True)
    np.testing.assert_array_equal(losses, ref_losses)
    _assert_same_tables(_tables_of(hybrid, state), _tables_of(ref, ref_state))


def test_a_restored_state_continues_exactly(tmp_path):
    """A state put back from saved tables (new arrays: no look-ahead applies) trains on
    as the uninterrupted one."""
    opt = RowWiseAdagrad(learning_rate=0.2)
    batches = _batches(12)
    hybrid = _trainer(_tables(opt, ("user", "item")))
    state, losses, _ = _train(hybrid, batches, look_ahead=True)
    again = _trainer(_tables(opt, ("user", "item")))
    mid = again.init(jax.random.key(0), batches[0])
    _look_ahead(again, True)
    for i, b in enumerate(batches[:6]):
        mid, _ = again.train_step(mid, b, batches[i + 1])
    saved = jax.device_get(mid)
    restored = again.put_state(
        TrainState(**{f.name: getattr(saved, f.name) for f in dataclasses.fields(saved)})
    )
    tail = []
    for i, b in enumerate(batches[6:], 6):
        nxt = batches[i + 1] if i + 1 < len(batches) else None
        restored, m = again.train_step(restored, b, nxt)
        tail.append(float(m["loss"]))
    np.testing.assert_array_equal(tail, losses[6:])
    _assert_same_tables(_tables_of(again, restored), _tables_of(hybrid, state))


def test_bad_host_placements_get_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match="placement 'host'.*dynamic or host-cached"):
        HybridTableStore(
            [TableSpec(name="t", vocab_size=10, dim=4, placement="host", cache=HostCache(rows=4))],
            [FeatureSpec(name="f", table="t")],
        )
    with pytest.raises(ValueError, match="placement"):
        TableSpec(name="t", vocab_size=10, dim=4, placement="cpu")
    cfg = runner.load_config(
        [],
        [
            f"out_dir={tmp_path}",
            "progress=false",
            "tables={C1: {placement: host}, C2: {placement: row_wise}}",
        ],
    )
    with pytest.raises(ConfigError, match=r"\['C1'\] have placement 'host' and tables \['C2'\]"):
        runner.build_run(cfg, log=lambda _: None)


TINY = [
    "progress=false",
    "data.batch_size=64",
    "data.eval_batches=2",
    "data.synthetic_options={vocab_sizes: [500, 300, 40], num_dense: 3}",
    "model.embedding_dim=8",
    "model.options={bottom: [16, 8], top: [16, 1]}",
]


def _run(tmp_path, name, steps, *extra):
    cfg = runner.load_config(
        [],
        [
            f"out_dir={tmp_path}",
            f"name={name}",
            f"steps={steps}",
            "checkpoint_every=5",
            *TINY,
            *extra,
        ],
    )
    return runner.train(cfg, log=lambda _: None)


def test_the_runner_trains_host_tables_as_device_tables_and_resumes(tmp_path):
    """`tables.<name>.placement: host` from a config: same eval as all on the device,
    and a run stopped at step 10 and resumed (the loader's `peek` feeding the look-ahead
    must not skip a batch) ends where the uninterrupted one does."""
    host = "tables={C1: {placement: host}, C2: {placement: host}}"
    ref = _run(tmp_path, "ref", 20)
    whole = _run(tmp_path, "whole", 20, host, "seed=0")
    assert whole["last_eval"] == ref["last_eval"]
    _run(tmp_path, "parts", 10, host)
    resumed = _run(tmp_path, "parts", 20, host)
    assert resumed["last_eval"] == whole["last_eval"]


def test_the_planner_leaves_host_tables_out(tmp_path, capsys):
    from sparsejax.runner._plan import plan_command, plan_config

    over = [f"out_dir={tmp_path}", *TINY, "tables={C1: {placement: host}}"]
    plan = plan_config(runner.load_config([], over), devices=4, device_memory="1GB")
    assert "C1" not in plan.placements and {"C2", "C3"} <= set(plan.placements)
    assert plan_command([], over, devices=4, device_memory="1GB") == 0
    assert "not planned): ['C1']" in capsys.readouterr().out
