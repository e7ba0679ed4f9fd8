"""Composed tables (quotient-remainder and multi-hash, `TableSpec.compose`): the layer's
outputs equal a float64 reference built from the parts' rows, a sparse SGD step through
the Flax layer equals plain autodiff of that reference, the parts' ids keep padding and
out-of-range ids as the full table would, the sizes meet their budget, and what cannot
be composed is refused naming the table or feature."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax import nn as snn
from sparsejax import ops
from sparsejax.data import BatchPacker, JaggedIds, PaddedIds
from sparsejax.embedding import Composition, FeatureSpec, HostCache, TableSpec
from sparsejax.embedding._compose import expand, fmix32, part_ids, stored_values

B = 5


def _specs(optimizer=None):
    kw = {} if optimizer is None else {"optimizer": optimizer}
    tables = [
        TableSpec(name="qr", vocab_size=97, dim=6, compose=Composition(kind="qr"), **kw),
        TableSpec(
            name="mh",
            vocab_size=200,
            dim=6,
            compose=Composition(kind="multihash", rows=11, hashes=3, op="add"),
            **kw,
        ),
        TableSpec(
            name="cat",
            vocab_size=50,
            dim=6,
            compose=Composition(kind="qr", rows=9, op="concat"),
            **kw,
        ),
        TableSpec(name="plain", vocab_size=13, dim=6, **kw),
    ]
    features = [
        FeatureSpec(name="user", table="qr"),
        FeatureSpec(name="recent", table="qr", combiner=None, max_ids=3),
        FeatureSpec(name="tags", table="mh", combiner="sqrtn", max_ids=4, weighted=True),
        FeatureSpec(name="clicks", table="mh", combiner="mean", max_ids=3),
        FeatureSpec(name="cats", table="cat", combiner="max", max_ids=3),
        FeatureSpec(name="p", table="plain"),
    ]
    return tables, features


def _host_batch(rng, tables, features):
    vocab = {t.name: t.vocab_size for t in tables}
    out = {}
    for f in features:
        lengths = np.ones(B, np.int64) if f.max_ids == 1 else rng.integers(0, f.max_ids + 1, B)
        lengths[0] = 0 if f.max_ids > 1 else 1  # an empty bag
        values = rng.integers(0, vocab[f.table], lengths.sum())
        values[: min(2, len(values))] = vocab[f.table] - 1  # the last row, duplicated
        w = rng.random(lengths.sum()).astype(np.float32) if f.weighted else None
        out[f.name] = JaggedIds(lengths, values, w)
    return out


def _row_ref(table, part_weights, ids):
    """float64 rows of a composed table for ids, from its parts' weights."""
    comp = table.compose
    rows = [w.shape[0] for w in part_weights]
    pieces = [
        np.asarray(w, np.float64)[i]
        for w, i in zip(part_weights, part_ids(comp, ids, table.vocab_size, rows), strict=True)
    ]
    if comp.op == "concat":
        return np.concatenate(pieces, axis=-1)
    out = pieces[0]
    for p in pieces[1:]:
        out = out * p if comp.op == "mul" else out + p
    return out


def _reference(tables, weights, features, host):
    by_table = {t.name: t for t in tables}
    out = {}
    for f in features:
        t = by_table[f.table]
        if t.compose is None:
            rows_of = lambda ids, t=t: np.asarray(weights[t.name], np.float64)[ids]  # noqa: E731
        else:
            parts = [weights[p.name] for p in expand([t], []).tables]
            rows_of = lambda ids, t=t, parts=parts: _row_ref(t, parts, ids)  # noqa: E731
        col = host[f.name]
        starts = np.concatenate([[0], np.cumsum(col.lengths)])
        res = []
        for b in range(B):
            ids = col.values[starts[b] : starts[b + 1]]
            w = np.ones(len(ids)) if col.weights is None else col.weights[starts[b] : starts[b + 1]]
            r = rows_of(ids) * np.asarray(w, np.float64)[:, None]
            if f.is_sequence:
                seq = np.zeros((f.max_ids, t.dim))
                seq[: len(ids)] = r[-f.max_ids :]
                res.append(seq)
            elif len(ids) == 0:
                res.append(np.zeros(t.dim))
            elif f.combiner == "max":
                res.append(r.max(0))
            else:
                norm = {"sum": 1.0, "mean": w.sum(), "sqrtn": np.sqrt((w * w).sum())}
                res.append(r.sum(0) / norm[f.combiner])
        out[f.name] = np.stack(res)
    return out


def _layer_and_batch(seed, optimizer=None):
    rng = np.random.default_rng(seed)
    tables, features = _specs(optimizer)
    layer = snn.EmbeddingBagCollection(tables, features)
    host = _host_batch(rng, tables, features)
    batch = BatchPacker(tables, features, batch_size=B).pack(host, labels=np.zeros(B))
    variables = layer.init(jax.random.key(seed), batch.features, B)
    return tables, features, layer, host, batch, variables


@pytest.mark.parametrize("seed", [0, 1])
def test_composed_lookups_match_the_reference(seed):
    tables, features, layer, host, batch, variables = _layer_and_batch(seed)
    store = layer.store
    assert set(store.export_tables(variables[snn.EMBEDDING])) == {
        "qr.q", "qr.r", "mh.h0", "mh.h1", "mh.h2", "cat.q", "cat.r", "plain"
    }  # fmt: skip
    got = jax.jit(lambda v, f: layer.apply(v, f, B))(variables, batch.features)
    assert set(got) == {f.name for f in features}
    weights = {
        k: np.asarray(v["weights"])
        for k, v in store.export_tables(variables[snn.EMBEDDING]).items()
    }
    want = _reference(tables, weights, features, host)
    for f in features:
        np.testing.assert_allclose(got[f.name], want[f.name], rtol=1e-5, atol=1e-7, err_msg=f.name)
    assert got["cats"].shape == (B, 6) and weights["cat.q"].shape == (6, 3)  # concat: D/2 each


def test_sparse_sgd_step_through_the_layer_equals_autodiff_of_the_reference():
    lr = 0.3
    tables, features, layer, host, batch, variables = _layer_and_batch(4, ops.SGD(learning_rate=lr))
    store = layer.store
    rng = np.random.default_rng(9)
    proj = {
        f.name: jnp.asarray(rng.normal(size=(f.bags_per_example() * 6,)), jnp.float32)
        for f in features
    }

    def loss_of(out):
        return sum(jnp.sum(jnp.tanh(out[k].reshape(B, -1) @ proj[k])) for k in out)

    def loss_fn(probe):
        out, aux = layer.apply(
            {**variables, snn.EMBEDDING_GRADS: probe},
            batch.features,
            B,
            mutable=[snn.EMBEDDING_LOOKUPS],
        )
        return loss_of(out), aux[snn.EMBEDDING_LOOKUPS]

    g, lookups = jax.grad(loss_fn, has_aux=True)(variables[snn.EMBEDDING_GRADS])
    new = snn.apply_embedding_gradients(variables[snn.EMBEDDING], lookups, g, step=1)
    got = store.export_tables(new)
    old = {k: v["weights"] for k, v in store.export_tables(variables[snn.EMBEDDING]).items()}

    def dense_loss(w):  # the composed lookups in plain jnp, differentiated by jax
        ex = layer.expansion
        feats = ex.split_features(batch.features)
        out = {}
        for f in ex.features:
            pad = feats[f.name]
            out[f.name] = ops.embedding_bag_ref(
                w[f.table], pad.ids, pad.segments, B * f.bags_per_example(),
                weights=pad.weights, combiner=f.combiner or "sum",
            )  # fmt: skip
        return loss_of(ex.combine_outputs(_split(ex, out)))

    dense_g = jax.grad(dense_loss)(old)
    for name in old:
        want = np.asarray(old[name]) - lr * np.asarray(dense_g[name])
        np.testing.assert_allclose(got[name]["weights"], want, rtol=1e-5, atol=1e-6, err_msg=name)
    assert any(np.abs(np.asarray(dense_g[n])).max() > 0 for n in ("qr.q", "qr.r", "mh.h2"))


def _split(ex, pooled):
    return {
        f.name: pooled[f.name].reshape(B, f.max_ids, -1) if f.is_sequence else pooled[f.name]
        for f in ex.features
    }


def test_part_ids_keep_padding_and_out_of_range_ids():
    qr = Composition(kind="qr", rows=10)
    ids = np.array([-1, 0, 9, 10, 99, 100, 5000], np.int32)
    q, r = part_ids(qr, ids, 100, [10, 10])
    np.testing.assert_array_equal(q, [-1, 0, 0, 1, 9, 10, 10])  # >= V: row count, out of range
    np.testing.assert_array_equal(r, [-1, 0, 9, 0, 9, 10, 10])
    qj, rj = part_ids(qr, jnp.asarray(ids), 100, [10, 10])
    np.testing.assert_array_equal(qj, q)
    np.testing.assert_array_equal(rj, r)
    v = np.arange(1000, dtype=np.int32)  # quotient-remainder: no two ids share both parts
    q, r = part_ids(qr, v, 1000, [100, 10])
    assert len(set(zip(q.tolist(), r.tolist(), strict=True))) == 1000
    mh = Composition(kind="multihash", rows=37, hashes=3)
    parts = part_ids(mh, v, 1000, [37, 37, 37])
    assert all(p.min() >= 0 and p.max() < 37 for p in parts)
    # id 0 (missing / rare values) has row 0 of every part to itself
    assert all(p[0] == 0 and (p[1:] > 0).all() for p in parts)
    # independent hashes: about 1000**2 / (2 * 37**3) = 9.9 ids share all three rows
    assert len({tuple(x) for x in np.stack(parts, 1).tolist()}) > 975
    assert not np.array_equal(parts[0], parts[1])  # independent hashes
    for p, pj in zip(parts, part_ids(mh, jnp.asarray(v), 1000, [37] * 3), strict=True):
        np.testing.assert_array_equal(p, pj)
    u = v.astype(np.uint32)
    np.testing.assert_array_equal(fmix32(u, 7), np.asarray(fmix32(jnp.asarray(u), 7)))


def test_an_id_past_the_logical_table_is_an_error_naming_the_part():
    tables, features = (
        [TableSpec(name="t", vocab_size=100, dim=4, compose=Composition(kind="qr"))],
        [FeatureSpec(name="f", table="t")],
    )
    layer = snn.EmbeddingBagCollection(tables, features)
    feats = {"f": PaddedIds(jnp.array([3, 100], jnp.int32), jnp.array([0, 1], jnp.int32))}
    ok = {"f": PaddedIds(jnp.array([3, 99], jnp.int32), jnp.array([0, 1], jnp.int32))}
    variables = layer.init(jax.random.key(0), ok, 2)
    with pytest.raises(
        IndexError, match=r"feature 'f' \(table 't', vocab 100\): id 100 at position 1"
    ):
        layer.apply(variables, feats, 2)  # eager: always checked
    with ops.checks(), pytest.raises(Exception, match=r"feature 'f' \(table 't'.*id 100"):
        jax.block_until_ready(jax.jit(lambda v, f: layer.apply(v, f, 2))(variables, feats))
    out = jax.jit(lambda v, f: layer.apply(v, f, 2))(variables, feats)  # unchecked: as padding
    np.testing.assert_array_equal(out["f"][1], 0.0)


def test_sizes_meet_the_budget_and_oversize_parts_are_refused():
    for vocab in (64, 1000, 12_345, 10**6):
        for fraction in (0.25, 0.1):
            t = TableSpec(
                name="t", vocab_size=vocab, dim=16,
                compose=Composition(kind="qr", fraction=fraction),
            )  # fmt: skip
            q, m = t.compose.part_rows(vocab, 16)
            fewest = min(-(-vocab // k) + k for k in range(1, vocab + 1))
            if fewest > fraction * vocab:  # a small table: the fewest rows Q-R allows
                assert q + m == fewest
                continue
            assert stored_values(t) == (q + m) * 16 <= fraction * vocab * 16
            assert -(-vocab // (m + 1)) + m + 1 > fraction * vocab  # the most within it
    t = TableSpec(
        name="t",
        vocab_size=1000,
        dim=16,
        compose=Composition(kind="multihash", fraction=0.1, hashes=2),
    )
    assert t.compose.part_rows(1000, 16) == [50, 50] and stored_values(t) == 100 * 16
    auto = TableSpec(name="t", vocab_size=10_000, dim=8, compose=Composition(kind="qr"))
    assert auto.compose.part_rows(10_000, 8) == [100, 100]  # ceil(sqrt(V))
    with pytest.raises(
        ValueError,
        match=r"table 'small': its qr parts would take \[1, 6\] rows.*more than the full table's 5",
    ):
        TableSpec(name="small", vocab_size=5, dim=4, compose=Composition(kind="qr", rows=6))
    with pytest.raises(ValueError, match=r"table 'x'.*multihash parts would take \[60, 60\]"):
        TableSpec(name="x", vocab_size=100, dim=4, compose=Composition(kind="multihash", rows=60))


def test_what_cannot_be_composed_is_refused_naming_it():
    with pytest.raises(ValueError, match="multihash table needs `rows` or `fraction`"):
        Composition(kind="multihash")
    with pytest.raises(ValueError, match="`kind` must be one of"):
        Composition(kind="tt")
    comp = Composition(kind="qr")
    with pytest.raises(ValueError, match="TableSpec 'd'.*dynamic or host-cached"):
        TableSpec(name="d", vocab_size=1000, dim=4, cache=HostCache(rows=10), compose=comp)
    t = TableSpec(name="t", vocab_size=100, dim=5, compose=Composition(kind="qr", op="concat"))
    with pytest.raises(ValueError, match="table 't'.*splits dim 5 over 2 parts"):
        expand([t], [FeatureSpec(name="f", table="t")])
    t = TableSpec(name="t", vocab_size=100, dim=4, compose=comp)
    with pytest.raises(ValueError, match="feature 'bag'.*op 'mul'.*a bag of 3 ids"):
        expand([t], [FeatureSpec(name="bag", table="t", max_ids=3)])
    with pytest.raises(ValueError, match="feature 'w'.*op 'mul'.*weighted ids"):
        expand([t], [FeatureSpec(name="w", table="t", weighted=True)])
    t = TableSpec(name="t", vocab_size=100, dim=4, compose=Composition(kind="qr", op="add"))
    with pytest.raises(ValueError, match="feature 'm'.*'add'.*max pooling"):
        expand([t], [FeatureSpec(name="m", table="t", combiner="max", max_ids=2)])


# ---------------------------------------------------------------------------------------
# from a config


def _run_config(tmp_path, *overrides):
    from sparsejax import runner

    return runner.load_config(
        [],
        [
            f"out_dir={tmp_path}",
            "progress=false",
            "steps=3",
            "eval_every=null",
            "data.batch_size=32",
            "data.eval_batches=1",
            "data.synthetic_options={vocab_sizes: [3, 400, 5000], num_dense: 2}",
            "model.embedding_dim=8",
            "model.options={bottom: [8, 8], top: [8, 1]}",
            *overrides,
        ],
    )


def test_a_config_composes_its_tables_and_trains(tmp_path):
    from sparsejax import runner

    cfg = _run_config(
        tmp_path,
        "tables={'*': {compose: {kind: qr, fraction: 0.25}},"
        " C3: {compose: {kind: multihash, rows: 100, op: concat}}}",
    )
    data = runner.build_data(cfg)
    t = {s.name: s for s in data.tables}
    assert t["C1"].compose is None  # from "*": 3 rows cannot shrink, stays whole
    assert t["C2"].compose.kind == "qr" and stored_values(t["C2"]) <= 0.25 * 400 * 8
    # its own entry over "*", key by key (fraction stays, unused with rows)
    assert t["C3"].compose == Composition(kind="multihash", rows=100, op="concat", fraction=0.25)
    summary = runner.train(cfg, log=lambda _: None)
    assert summary["step"] == 3 and np.isfinite(summary["last_eval"]["loss"])


def test_config_errors_name_the_key(tmp_path):
    from sparsejax import runner
    from sparsejax.runner import ConfigError

    cases = [
        (
            "tables.C2.compose={kind: qr, rows: 399}",
            "tables.C2.compose: table 'C2': its qr parts would take [2, 399] rows",
        ),
        ("tables.C2.compose={kind: multihash}", "tables.C2.compose: Composition: a multihash"),
        ("tables.C2.compose={kind: tt}", "'tables.C2.compose.kind': 'tt' is not one of"),
        ("tables.C2.compose={kind: qr, fractoin: 0.2}", "did you mean 'fraction'?"),
    ]
    for override, message in cases:
        with pytest.raises(ConfigError) as e:
            runner.build_data(_run_config(tmp_path, override))
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


# ---------------------------------------------------------------------------------------
# mixed-dimension embeddings (model.mixed_dims)


def test_mixed_dims_follow_the_power_law_and_stacked_models_project_them(tmp_path):
    import flax

    from sparsejax import runner

    cfg = _run_config(
        tmp_path,
        "data.synthetic_options={vocab_sizes: [3, 40, 400, 5000, 60000], num_dense: 2}",
        "model.embedding_dim=16",
        "model.options={bottom: [8, 16], top: [8, 1]}",
        "model.mixed_dims={alpha: 0.3}",
        "tables.C5.dim=12",  # its own dim wins
    )
    data = runner.build_data(cfg)
    t = {s.name: s for s in data.tables}
    v_min = min(s.vocab_size for s in data.tables)
    for name in ("C1", "C2", "C3", "C4"):
        want = 16 * (v_min / t[name].vocab_size) ** 0.3
        assert t[name].dim == min(16, max(4, 4 * -(-want // 4))), name
    assert t["C1"].dim == 16 and t["C4"].dim < t["C2"].dim and t["C5"].dim == 12
    model = runner.build_model(cfg, data.tables, data.features)
    assert model.embedding_dim == 16
    run = runner.build_run(cfg, log=lambda _: None)
    params = flax.traverse_util.flatten_dict(run.state.params)
    projected = {k[0] for k in params if k[0].startswith("project_")}
    assert projected == {f"project_{n}" for n in t if t[n].dim != 16}
    assert params[("project_C5", "kernel")].shape == (12, 16)
    summary = runner.train_run(run, log=lambda _: None)
    assert np.isfinite(summary["last_eval"]["loss"])


def test_other_dims_without_mixed_dims_are_refused_naming_the_option(tmp_path):
    from sparsejax import runner

    cfg = _run_config(tmp_path, "tables.C2.dim=4")
    data = runner.build_data(cfg)
    with pytest.raises(runner.ConfigError, match=r"table 'C2' has dim 4.*set model.mixed_dims"):
        runner.build_model(cfg, data.tables, data.features)
    with pytest.raises(runner.ConfigError, match=r"alpha.*\[0, 1\]"):
        _run_config(tmp_path, "model.mixed_dims={alpha: 2}")


def test_a_run_with_composed_tables_exports_and_serves_its_scores(tmp_path):
    """The model dir keeps the parts (quantized per part) and the predictor's scores are
    the run's: the export's own check over the eval split, and a request from its
    example body."""
    from sparsejax import runner
    from sparsejax.runner import export_run
    from sparsejax.serving import Predictor

    cfg = _run_config(
        tmp_path,
        "name=c",
        "tables={'*': {compose: {kind: qr, fraction: 0.25}}, C3: {compose: {kind: multihash,"
        " rows: 300, op: add}}}",
    )
    runner.train(cfg, log=lambda _: None)
    for q, tol in (("fp32", 1e-6), ("int8", 5e-2)):
        out = str(tmp_path / f"m_{q}")
        manifest = export_run(cfg.run_dir, out, quantize=q, buckets=(8,), log=lambda _: None)
        assert manifest["check"]["max_abs_diff"] <= tol, q
        p = Predictor.load(out, warmup=False)
        scores = p.predict(p.example_request["examples"])
        assert scores.shape == (len(p.example_request["examples"]),)
        assert np.isfinite(scores).all()
