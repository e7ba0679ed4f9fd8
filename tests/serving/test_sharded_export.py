"""Sharded export: a run whose table is split by rows over 4 devices exports each row
shard as its own piece (no whole-table gather), and the model dir serves the same
scores as an export of the same checkpoint on one device."""

import json

import numpy as np

from sparsejax import runner
from sparsejax.runner._export import export_run
from sparsejax.serving import Predictor

FAST = ["progress=false", "log_every=1000", "eval_every=null", "epochs=null", "steps=6"]


def test_a_row_sharded_table_exports_per_shard_and_serves_as_one_device(tmp_path):
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
    p4, p1 = Predictor.load(str(tmp_path / "m4")), Predictor.load(str(tmp_path / "m1"))
    examples = p4.example_request["examples"]
    np.testing.assert_array_equal(p4.predict(examples), p1.predict(examples))
