"""Sharded export: a run whose table is split by rows over 4 devices exports each row
shard as its own piece (no whole-table gather), and the model dir serves the same
scores as an export of the same checkpoint on one device; its check reads a large table
in the rows it looks up only. A table past int32 rows is refused before a restore."""

import json

import numpy as np
import pytest

from sparsejax import runner
from sparsejax.runner._export import export_run
from sparsejax.serving import Predictor, _export, _format

FAST = ["progress=false", "log_every=1000", "eval_every=null", "epochs=null", "steps=6"]


def test_a_row_sharded_table_exports_per_shard_and_serves_as_one_device(tmp_path, monkeypatch):
    cfg = runner.load_config(
        [],
        [
            f"out_dir={tmp_path / 'runs'}",
            "name=syn",
            *FAST,
            "data.kind=synthetic",
            "data.synthetic_options={vocab_sizes: [300, 50, 7, 120], num_dense: 3}",
            "data.batch_size=64",
            "data.eval_batches=1",
            "model.embedding_dim=8",
            "model.options={bottom: [16, 8], top: [16, 1]}",
            "sharding.devices=4",
            "tables.C1.placement=row_wise",
        ],
    )
    runner.train(cfg, log=lambda _: None)
    run = str(tmp_path / "runs" / "syn")
    opts = dict(quantize="int8", buckets=(1, 8), log=lambda _: None)
    four = export_run(run, str(tmp_path / "m4"), **opts)
    one = export_run(
        run,
        str(tmp_path / "m1"),
        overrides=["sharding.devices=1", "tables.C1.placement=null"],
        **opts,
    )

    def c1_pieces(manifest):
        return [
            p
            for e in manifest["arguments"].values()
            for p in e.get("pieces", ())
            if p["table"] == "C1" and ".data." in p["file"]
        ]

    sharded, whole = c1_pieces(four), c1_pieces(one)
    rows = json.loads((tmp_path / "m4" / "model.json").read_text())["tables"]["C1"]["rows"]
    assert len(whole) == 1 and whole[0]["table_rows"] == [0, rows]
    assert len(sharded) == 4  # one piece per row shard, in row order, covering the table
    bounds = [p["table_rows"] for p in sorted(sharded, key=lambda p: p["rows"])]
    assert bounds[0][0] == 0 and bounds[-1][1] == rows
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    assert four["check"]["max_abs_diff"] <= 1e-4
    # the check reading only the rows its batches look up agrees with the whole read
    sparse_reads = []
    monkeypatch.setattr(_export, "_WHOLE_BYTES", 0)
    monkeypatch.setattr(
        _format,
        "_read_piece_into",
        lambda *a, f=_format._read_piece_into: sparse_reads.append(a[-1] is not None) or f(*a),
    )
    assert export_run(run, str(tmp_path / "m4s"), **opts)["check"] == four["check"]
    assert any(sparse_reads)
    p4, p1 = Predictor.load(str(tmp_path / "m4")), Predictor.load(str(tmp_path / "m1"))
    examples = p4.example_request["examples"]
    np.testing.assert_array_equal(p4.predict(examples), p1.predict(examples))


def test_a_table_past_int32_rows_is_refused_before_the_restore(tmp_path, monkeypatch):
    """Serving keeps a table in one int32-addressed stack: a 3e9-row table (which trains
    row-wise) is refused in one line naming it, before its checkpoint is read; dynamic
    and composed tables are counted by what serving holds (keys, parts)."""
    from sparsejax import embedding as emb
    from sparsejax.runner import _evaluate
    from sparsejax.serving import ExportError, check_servable

    big = emb.TableSpec(name="wide", vocab_size=3_000_000_000, dim=1)
    with pytest.raises(ExportError, match=r"table 'wide' has 3,000,000,000 rows"):
        check_servable([emb.TableSpec(name="a", vocab_size=10, dim=4), big])
    check_servable(
        [
            emb.TableSpec(name="d", dim=4, dynamic=emb.DynamicVocab(max_rows=100)),
            emb.TableSpec(
                name="c",
                vocab_size=10**10,
                dim=4,
                compose=emb.Composition(kind="multihash", rows=1000),
            ),
        ]
    )
    run = tmp_path / "run"
    (run / "checkpoints" / "3").mkdir(parents=True)
    (run / "config.yaml").write_text("data:\n  kind: synthetic\n")

    class Data:
        tables = (big,)

    monkeypatch.setattr(_evaluate, "build_data", lambda cfg: Data())
    monkeypatch.setattr(_evaluate, "build_trainer", lambda *a, **k: pytest.fail("restored"))
    with pytest.raises(runner.ConfigError, match="table 'wide' has 3,000,000,000 rows"):
        export_run(str(run), str(tmp_path / "m"), log=lambda _: None)


def test_an_argument_read_in_some_rows_equals_the_whole_read_and_gaps_are_named(tmp_path):
    import ml_dtypes

    from sparsejax.serving import ModelLoadError

    rng = np.random.default_rng(0)
    for dtype in (np.float32, ml_dtypes.bfloat16, np.uint8):
        a = (rng.standard_normal((50, 3)) * 9).astype(dtype)
        bounds = [(0, 7), (7, 30), (30, 50)]
        pieces = [
            _format.write_piece(str(tmp_path / "t"), f"p{i}", a[r0:r1], rows=[r0, r1], table="T")
            for i, (r0, r1) in enumerate(bounds)
        ]
        entry = {"key": "w", "shape": [50, 3], "dtype": str(a.dtype), "pieces": pieces}
        np.testing.assert_array_equal(_format.read_argument(str(tmp_path), entry), a)
        rows = np.array([0, 6, 7, 29, 30, 49])
        got = _format.read_argument(str(tmp_path), entry, rows)
        np.testing.assert_array_equal(got[rows], a[rows])
        for broken, where in (
            ([pieces[0], pieces[2]], "rows 7..29"),
            (pieces + [pieces[1]], "rows 7..29"),
        ):
            with pytest.raises(
                ModelLoadError, match=f"{where} of argument w .*in no piece or in several"
            ):
                _format.read_argument(str(tmp_path), {**entry, "pieces": broken})
    with pytest.raises(ModelLoadError, match="rows 30..49 "):
        _format.read_argument(str(tmp_path), {**entry, "pieces": pieces[:2]})
