"""The table-store contract, one suite for every store kind.

Each kind (a fixture param) is the same two tables behind a different store: the
device store, the sharded store (row-wise and table-wise on a 2-device mesh), the
hybrid store (a host-executed table), a host-cached static table and a dynamic table
(64-bit keys); the last two keep their rows on the host side (`trainer.host`). Every
kind runs the same tests, driven the way a user drives it (through `Trainer` and
`Checkpointer`): init, lookup and one sparse update against float64 numpy references,
export/import by table name, checkpoint save/restore, stats and bad input.

A kind's tables read as `{table: {"keys", "weights", "slots"}}` (`Case.tables`): a
static table's keys are its row ids, a dynamic table's the keys it holds rows for. A
key without a row reads the default row (zeros) and gets no update.
"""

from __future__ import annotations

import dataclasses
import json

import _reference as ref
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sparsejax import ops
from sparsejax.checkpoint import Checkpointer, CheckpointError, layer_key
from sparsejax.data import PaddedIds, SparseBatch
from sparsejax.embedding import DynamicVocab, FeatureSpec, HostCache, TableSpec, subtree
from sparsejax.nn import EmbeddingBagCollection
from sparsejax.sharding import make_mesh, make_store
from sparsejax.train import Trainer

B, DIM = 8, 4
LAYER = ("emb",)
VOCAB = {"a": 40, "b": 24}
FEATURES = (
    FeatureSpec(name="fa", table="a", combiner="sum", max_ids=3),
    FeatureSpec(name="fb", table="b", combiner="mean", max_ids=2),
)
OPT = ops.RowWiseAdagrad(learning_rate=0.5)
COEF = {  # the probe model's logit: sum over features of <pooled row, COEF>
    "fa": np.array([1.0, -0.5, 0.25, 2.0]),
    "fb": np.array([-1.0, 0.75, 1.5, -0.25]),
}
KEYS = np.random.default_rng(11).integers(0, 2**62, VOCAB["a"])  # the dynamic table's
KINDS = ("device", "sharded", "host", "tiered", "dynamic")
TIERED = ("tiered", "dynamic")  # kinds whose table "a" lives on the host side


def _specs(kind: str, dim_a: int = DIM) -> tuple[TableSpec, ...]:
    """Table "a" is the one the kind is about, "b" its neighbour (plain where "a" is
    tiered or host-executed, as most models mix them)."""
    a, b = {}, {}
    if kind == "sharded":
        a, b = {"placement": "row_wise"}, {"placement": "table_wise"}
    elif kind == "host":
        a = {"placement": "host"}
    elif kind == "tiered":
        a = {"cache": HostCache(rows=24)}  # fewer slots than rows: the cache evicts
    elif kind == "dynamic":
        a = {"dynamic": DynamicVocab(), "cache": HostCache(rows=24)}
    size = lambda n, kw: {} if "dynamic" in kw else {"vocab_size": VOCAB[n]}  # noqa: E731
    return tuple(
        TableSpec(name=n, dim=d, optimizer=OPT, **size(n, kw), **kw)
        for n, d, kw in (("a", dim_a, a), ("b", DIM, b))
    )


class _Probe(nn.Module):
    """One embedding layer and no dense parameters: eval returns the pooled rows
    (`[B, 2 * DIM]`, what the lookup gave), train a fixed linear logit of them, so the
    gradient of every pooled row is known in closed form."""

    tables: tuple
    features: tuple

    @nn.compact
    def __call__(self, batch, train: bool = False):
        emb = EmbeddingBagCollection(self.tables, self.features, name=LAYER[0])(
            batch.features, batch.batch_size
        )
        if not train:
            return jnp.concatenate([emb[f.name] for f in self.features], axis=1)
        return sum(
            emb[f] @ jnp.asarray(c[: emb[f].shape[-1]], jnp.float32) for f, c in COEF.items()
        )


def _mesh(kind: str):
    if kind != "sharded":
        return None
    if len(jax.devices()) < 2:
        pytest.skip("the sharded store needs 2+ devices (XLA_FLAGS from tests/conftest.py)")
    return make_mesh(2, jax.devices()[:2])


# ---- batches ------------------------------------------------------------------------------
def _bags(rng, keys: np.ndarray, width: int, *, dtype, lengths=None) -> PaddedIds:
    """CSR ids of B bags of 0..width ids drawn from `keys` (duplicates; bag 0 empty,
    bag 1 full and holding the first and last key), padding (-1) at the end."""
    lengths = rng.integers(0, width + 1, B) if lengths is None else lengths
    lengths[:2] = 0, width
    per = [rng.choice(keys, n) for n in lengths]
    if width >= 2:
        per[1][:2] = keys[0], keys[-1]
    if width >= 3:
        per[1][2] = keys[-1]  # a duplicate inside one bag
    ids = np.full(B * width, -1, np.int64)
    segments = np.full(B * width, B - 1, np.int32)
    flat = np.concatenate(per)
    ids[: flat.shape[0]] = flat
    segments[: flat.shape[0]] = np.repeat(np.arange(B), lengths)
    return PaddedIds(ids.astype(dtype), segments)


def _batch(case: Case, seed: int, keys=None, *, lengths=None) -> SparseBatch:
    """A batch of fresh random ids of `keys` (default: every row of each table)."""
    rng = np.random.default_rng(seed)
    features = {}
    for f in FEATURES:
        k = case.all_keys(f.table) if keys is None else keys[f.table]
        dtype = np.int64 if case.dynamic(f.table) else np.int32
        features[f.name] = _bags(rng, k, f.max_ids, dtype=dtype, lengths=lengths)
    return SparseBatch(
        features=features,
        dense=np.zeros((B, 0), np.float32),
        labels=rng.integers(0, 2, B).astype(np.float32),
        mask=np.array([1.0] * (B - 1) + [0.0], np.float32),  # the last row pads
    )


# ---- one store kind behind a trainer --------------------------------------------------------
class Case:
    """A store kind's model, trainer and state (initialized with `key`)."""

    def __init__(self, kind: str, key: int = 0, *, dim_a: int = DIM):
        self.kind = kind
        self.specs = {t.name: t for t in _specs(kind, dim_a)}
        self.trainer = Trainer(
            _Probe(tuple(self.specs.values()), FEATURES), optax.sgd(0.1), mesh=_mesh(kind)
        )
        self.state = self.trainer.init(jax.random.key(key), _batch(self, 0))

    @property
    def host(self):
        """The trainer's host side (`HostSides`: empty for the device-only kinds)."""
        return self.trainer.host

    @property
    def store(self):
        return self.trainer.layouts[LAYER]

    def dynamic(self, table: str) -> bool:
        return self.specs[table].dynamic is not None

    def all_keys(self, table: str) -> np.ndarray:
        return KEYS if self.dynamic(table) else np.arange(VOCAB[table])

    def tables(self, state) -> dict:
        """`{table: {"keys", "weights", "slots"}}` as numpy: the store's export by name,
        and the host side's for tables whose rows live there."""
        by_name = jax.device_get(self.trainer.tables_by_name(state))[layer_key(LAYER)]
        out = {n: {"keys": np.arange(t["weights"].shape[0]), **t} for n, t in by_name.items()}
        for key, t in self.host.export(state.tables).items():
            out[key.rsplit("/", 1)[1]] = t
        return out

    def lookup(self, state, batch) -> dict[str, np.ndarray]:
        out = np.asarray(self.trainer.eval_step(state, batch))
        return {f.name: out[:, i * DIM : (i + 1) * DIM] for i, f in enumerate(FEATURES)}

    def train(self, state, batch):
        state, metrics = self.trainer.train_step(state, batch)
        return state, float(metrics["loss"])


# ---- numpy references -------------------------------------------------------------------------
def _rows_of(table: dict, ids: np.ndarray) -> np.ndarray:
    """Row index in `table` of every id: -1 for padding, len(keys) (the default row,
    zeros) for a key without a row."""
    keys = table["keys"]
    pos = np.searchsorted(keys, ids)
    pos = np.minimum(pos, max(keys.shape[0] - 1, 0))
    has = (keys.shape[0] > 0) & (keys[pos] == ids) if keys.shape[0] else np.zeros_like(ids, bool)
    return np.where(ids < 0, -1, np.where(has, pos, keys.shape[0]))


def _with_default(table: dict) -> np.ndarray:
    return np.concatenate([ref.f64(table["weights"]), np.zeros((1, DIM))])


def _pooled(tables: dict, batch: SparseBatch) -> dict[str, np.ndarray]:
    """float64 pooled rows of every feature (`_reference.embedding_bag`)."""
    out = {}
    for f in FEATURES:
        t, p = tables[f.table], batch.features[f.name]
        rows = _rows_of(t, np.asarray(p.ids))
        out[f.name] = ref.embedding_bag(_with_default(t), rows, p.segments, B, combiner=f.combiner)
    return out


def _coefficients(f: FeatureSpec, rows: np.ndarray, segments: np.ndarray) -> np.ndarray:
    """Each id's pooling factor (1, or 1/n for "mean" of a bag of n ids)."""
    n = np.bincount(segments[rows >= 0], minlength=B)
    return np.ones(rows.shape) if f.combiner == "sum" else 1.0 / np.maximum(n[segments], 1)


def _sgd_reference(tables: dict, batch: SparseBatch, step: int) -> tuple[dict, dict, float]:
    """(new tables, touched row masks, loss) of one train step of the probe model."""
    pooled = _pooled(tables, batch)
    logits = sum(pooled[f] @ c for f, c in COEF.items())
    mask, labels = np.asarray(batch.mask, np.float64), np.asarray(batch.labels, np.float64)
    loss = np.sum(mask * (np.logaddexp(0, logits) - labels * logits)) / mask.sum()
    d_logit = mask * (1 / (1 + np.exp(-logits)) - labels) / mask.sum()
    new, touched = {}, {}
    for name, t in tables.items():
        n = t["keys"].shape[0]
        grads: dict[int, np.ndarray] = {}
        for f in (f for f in FEATURES if f.table == name):
            p = batch.features[f.name]
            rows, segs = _rows_of(t, np.asarray(p.ids)), np.asarray(p.segments)
            coef = _coefficients(f, rows, segs)
            g = ref.row_grads(rows, segs, coef, d_logit[:, None] * COEF[f.name], n + 1)
            for r, v in g.items():
                grads[r] = grads.get(r, 0) + v
        grads.pop(n, None)  # the default row takes no update
        w, s = ref.apply_row_grads(OPT, t["weights"], t["slots"], grads, step)
        new[name] = {"keys": t["keys"], "weights": w, "slots": s}
        touched[name] = np.isin(np.arange(n), list(grads))
    return new, touched, loss


def _assert_bits_equal(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    for name in want:
        for part in ("keys", "weights"):
            np.testing.assert_array_equal(
                ref.bits(got[name][part]), ref.bits(want[name][part]), err_msg=f"{what}: {name}"
            )
        assert sorted(got[name]["slots"]) == sorted(want[name]["slots"])
        for s, v in want[name]["slots"].items():
            np.testing.assert_array_equal(ref.bits(got[name]["slots"][s]), ref.bits(v), s)


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert msg and "\n" not in msg, msg
    assert not isinstance(e.value, AttributeError), msg
    return msg


# ---- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=KINDS)
def run(request):
    """A kind trained two steps: one on random ids (for a dynamic table: admitting the
    keys the second step reads), one on ids of rows the tables then hold. Records the
    tables before and after the second step."""
    case = Case(request.param)
    first = _batch(case, 1)
    case.state, _ = case.train(case.state, first)
    before = case.tables(case.state)
    held = {n: t["keys"] for n, t in before.items()}
    batch = _batch(case, 2, held)
    state, loss = case.train(case.state, batch)
    case.state = state
    yield dataclasses.make_dataclass("Run", ["case", "first", "before", "batch", "loss", "after"])(
        case, first, before, batch, loss, case.tables(state)
    )
    case.host.close()


# ---- the contract -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_init_has_the_specs_shapes_and_depends_on_the_key_only(kind):
    one, again, other = Case(kind, 0), Case(kind, 0), Case(kind, 1)
    tables = one.tables(one.state)
    assert sorted(tables) == ["a", "b"]
    for name, t in tables.items():
        spec = one.specs[name]
        rows = 0 if spec.dynamic is not None else spec.vocab_size  # rows come with keys
        assert t["keys"].shape == (rows,) and t["weights"].shape == (rows, DIM)
        assert t["weights"].dtype == np.float32
        assert {k: (v.shape, v.dtype) for k, v in t["slots"].items()} == {
            "accumulator": ((rows,), np.float32)
        }
        np.testing.assert_array_equal(t["slots"]["accumulator"], 0.0)
    _assert_bits_equal(again.tables(again.state), tables, "same key")
    differs = other.tables(other.state)
    assert not np.array_equal(differs["b"]["weights"], tables["b"]["weights"])
    if one.specs["a"].dynamic is None:
        assert not np.array_equal(differs["a"]["weights"], tables["a"]["weights"])
    for c in (one, again, other):
        c.host.close()


def test_lookup_matches_the_reference_on_fresh_ids(run):
    """Duplicates, empty and full bags, the first and last rows, padding; for a dynamic
    table, keys without a row (the default row, zeros)."""
    case = run.case
    tables = case.tables(case.state)
    for seed in (3, 4):
        batch = _batch(case, seed)
        got, want = case.lookup(case.state, batch), _pooled(tables, batch)
        for f in FEATURES:
            np.testing.assert_allclose(got[f.name], want[f.name], **ref.TOL[jnp.float32])
    # a lookup changes nothing
    _assert_bits_equal(case.tables(case.state), tables, "after lookups")
    empty = _batch(case, 5, lengths=np.zeros(B, np.int64))
    for f in FEATURES:
        empty.features[f.name].ids[:] = -1
    got = case.lookup(case.state, empty)
    for f in FEATURES:
        np.testing.assert_array_equal(got[f.name], 0.0)


def _part(table: dict, part: str) -> np.ndarray:
    return table["weights"] if part == "weights" else table["slots"][part]


def test_update_moves_the_touched_rows_as_the_reference_and_no_other(run):
    want, touched, loss = _sgd_reference(run.before, run.batch, step=2)
    assert run.loss == pytest.approx(loss, rel=1e-5)
    for name, new in run.after.items():
        np.testing.assert_array_equal(new["keys"], want[name]["keys"])
        assert touched[name].any()
        hit, old = touched[name], run.before[name]
        for part in ("weights", "accumulator"):
            np.testing.assert_array_equal(
                ref.bits(_part(new, part)[~hit]), ref.bits(_part(old, part)[~hit]), part
            )
            np.testing.assert_allclose(
                ref.f64(_part(new, part)[hit]),
                ref.f64(_part(want[name], part)[hit]),
                **ref.TOL[jnp.float32],
                err_msg=f"{name} {part}",
            )


def test_export_import_round_trip_by_table_name(run):
    case = run.case
    store, layer = case.store, subtree(case.state.tables, LAYER)
    exported = jax.device_get(store.export_tables(layer))
    # tables whose rows live on the host side are not in the store's export
    assert sorted(exported) == sorted(set(case.specs) - set(store.tiered_tables))
    imported = store.import_tables(exported)
    assert jax.tree.structure(imported) == jax.tree.structure(store.abstract_state())
    for got, want in zip(
        jax.tree.leaves(imported), jax.tree.leaves(store.state_shardings()), strict=True
    ):
        assert got.sharding.is_equivalent_to(want, got.ndim)
    again = jax.device_get(store.export_tables(imported))
    for name, t in exported.items():
        np.testing.assert_array_equal(ref.bits(again[name]["weights"]), ref.bits(t["weights"]))
        for s, v in t["slots"].items():
            np.testing.assert_array_equal(ref.bits(again[name]["slots"][s]), ref.bits(v))


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_restores_every_table_bit_exactly(kind, tmp_path):
    """Through `Checkpointer` with the trainer's host side: the host rows too, from a
    full save and a delta (`full_every=2`)."""
    case = Case(kind)
    with Checkpointer(tmp_path, case.trainer.layouts, host=case.host, full_every=2) as ckpt:
        for seed in (1, 2):
            case.state, _ = case.train(case.state, _batch(case, seed))
            ckpt.save(case.state)
    want = case.tables(case.state)
    other = Case(kind, key=7)
    with Checkpointer(tmp_path, other.trainer.layouts, host=other.host) as ckpt:
        state, _ = ckpt.restore(other.state)
    state = other.trainer.put_state(state)
    _assert_bits_equal(other.tables(state), want, "restored")
    batch = _batch(case, 6)
    got, ref_out = other.lookup(state, batch), case.lookup(case.state, batch)
    for f in FEATURES:
        np.testing.assert_array_equal(got[f.name], ref_out[f.name])
    for c in (case, other):
        c.host.close()


def test_stats_are_json_and_count_the_host_tables_lookups(run):
    case = run.case
    stats = case.host.stats()
    json.dumps(stats)
    if case.kind in TIERED:
        st = stats[f"{layer_key(LAYER)}/a"]
        ids = [np.asarray(b.features["fa"].ids) for b in (run.first, run.batch)]
        assert st["lookups_per_step"] == sum(int((i >= 0).sum()) for i in ids) / 2
        assert st["rows_live"] == run.after["a"]["keys"].shape[0]
    else:
        assert not any(k.endswith("/a") for k in stats)


def test_an_id_outside_its_table_looks_up_nothing_or_is_refused_in_one_line(run):
    """The store's contract: an id outside its table looks up nothing (the device
    stores); a host side that maps ids refuses it, naming the feature, table and id."""
    case = run.case
    batch = _batch(case, 8)
    ids = np.asarray(batch.features["fa"].ids)
    bad, dropped = ids.copy(), ids.copy()
    bad[0], dropped[0] = (-5 if case.dynamic("a") else VOCAB["a"]), -1
    with_ids = lambda i: dataclasses.replace(  # noqa: E731
        batch, features={**batch.features, "fa": dataclasses.replace(batch.features["fa"], ids=i)}
    )
    if case.kind in TIERED:
        with pytest.raises(ValueError) as e:
            case.lookup(case.state, with_ids(bad))
        msg = _one_line(e)
        assert "'fa'" in msg and "'a'" in msg and str(int(bad[0])) in msg
    else:
        got, want = (
            case.lookup(case.state, with_ids(bad)),
            case.lookup(case.state, with_ids(dropped)),
        )
        for f in FEATURES:
            np.testing.assert_array_equal(got[f.name], want[f.name])


@pytest.mark.parametrize("kind", KINDS)
def test_checks_report_an_id_outside_its_table_in_one_line(kind):
    """With `ops.checks()` on while the steps are traced, every store reports an id
    outside its table by name (a host side that maps ids does so always)."""
    with ops.checks():
        case = Case(kind)
        batch = _batch(case, 8)
        bad = np.asarray(batch.features["fa"].ids).copy()
        bad[0] = -5 if case.dynamic("a") else VOCAB["a"]
        batch.features["fa"] = dataclasses.replace(batch.features["fa"], ids=bad)
        with pytest.raises(Exception) as e:
            jax.block_until_ready(case.lookup(case.state, batch))
    case.host.close()
    msg = _one_line(e)
    assert "'fa'" in msg and "'a'" in msg and str(int(bad[0])) in msg


@pytest.mark.parametrize("kind", KINDS)
def test_a_feature_of_an_unknown_table_is_one_line_naming_it(kind):
    mesh = _mesh(kind)
    features = (*FEATURES, FeatureSpec(name="fc", table="nope"))
    with pytest.raises(ValueError) as e:
        make_store(_specs(kind), features, mesh=mesh)
    msg = _one_line(e)
    assert "'fc'" in msg and "'nope'" in msg


def test_a_missing_feature_is_one_line_naming_it(run):
    case = run.case
    batch = _batch(case, 9)
    features = {k: v for k, v in batch.features.items() if k != "fa"}
    with pytest.raises(Exception) as e:
        case.lookup(case.state, dataclasses.replace(batch, features=features))
    assert "fa" in _one_line(e)


def test_a_wrong_dim_on_import_is_one_line_naming_the_table(run, tmp_path):
    case = run.case
    store = case.store
    exported = jax.device_get(store.export_tables(subtree(case.state.tables, LAYER)))
    exported["b"]["weights"] = np.zeros((VOCAB["b"], DIM + 1), np.float32)
    with pytest.raises(ValueError) as e:
        store.import_tables(exported)
    msg = _one_line(e)
    assert "'b'" in msg and str(DIM + 1) in msg
    # table "a" (on the host side where tiered) restored from a checkpoint into a model
    # that gives it another dim
    with Checkpointer(tmp_path, case.trainer.layouts, host=case.host) as ckpt:
        ckpt.save(case.state)
    wide = Case(case.kind, dim_a=DIM + 1)
    with Checkpointer(tmp_path, wide.trainer.layouts, host=wide.host) as ckpt:
        with pytest.raises(CheckpointError) as e:
            ckpt.restore(wide.state)
    msg = _one_line(e)
    assert "'a'" in msg and str(DIM + 1) in msg
    wide.host.close()
