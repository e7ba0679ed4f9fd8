"""Resharding restores: a checkpoint saved on one mesh restores on another, exactly.

The library: a DLRM with row-wise and table-wise tables trained on a 2x4 mesh, saved, then
restored on 2 devices (1x2), on 1 device (the single-device store) and back on 8, each
hop training on and saving for the next: dense state, tables and slots bitwise what the
previous hop saved, and the loss curve the uninterrupted 8-device run's (within 1e-6).
The runner: a run on 8 devices (a dynamic row-wise table among them) resumed with
`sharding.devices=2` and then 1 continues the uninterrupted run's losses in
metrics.jsonl (within 1e-5), the changes logged and recorded. A checkpoint of another
model is refused in one line naming the table (`sparsejax train`: a user error)."""

import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import pytest
import yaml
from _cli import run_sparsejax

from sparsejax import ops, runner, train
from sparsejax.__main__ import main
from sparsejax.checkpoint import Checkpointer, CheckpointError
from sparsejax.nn import embedding_layouts
from sparsejax.sharding import make_mesh

TINY = {
    "data": {
        "batch_size": 64,
        "eval_batches": 1,
        "synthetic_options": {"vocab_sizes": [300, 50, 7, 120], "num_dense": 3},
    },
    "model": {"embedding_dim": 8, "options": {"bottom": [8], "top": [8, 1]}},
}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLACEMENTS = {"C1": "row_wise", "C2": "table_wise", "C3": "table_wise", "C4": "row_wise"}


def _config(root, values) -> str:
    path = root / "tiny.yaml"
    path.write_text(yaml.safe_dump({**values, "out_dir": str(root / "runs")}))
    return str(path)


def _mesh(data, model):
    return make_mesh(model=model, devices=jax.devices()[: data * model])


def _abstract(state):
    """A restore template: the state's shapes, dtypes and shardings (no values)."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )


def _host(trainer, state) -> dict:
    """Everything a checkpoint holds, on the host, tables by name (any mesh's)."""
    fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
    fields["tables"] = trainer.tables_by_name(state)
    return jax.tree.map(np.asarray, fields)


def _max_diff(a, b) -> float:
    return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(np.abs(x - y).max()), a, b)))


def test_library_restores_8_to_2_to_1_to_8_devices_exactly(tmp_path):
    cfg = runner.load_config([_config(tmp_path, TINY)])
    data = runner.build_data(cfg)
    model = runner.build_model(cfg, data.tables, data.features)
    placed = model.clone(
        tables=tuple(dataclasses.replace(t, placement=PLACEMENTS[t.name]) for t in model.tables)
    )
    b = data.packer.batch_size
    batches = [
        data.packer.pack(s, labels=y, dense=d)
        for s, y, d in (data.train_source.batch(i, b) for i in range(8))
    ]
    tx = runner.dense_optimizer(cfg.optimizer)
    eight = train.Trainer(placed, tx, mesh=_mesh(2, 4))
    state = eight.init(jax.random.key(0), batches[0])
    template8 = _abstract(state)
    for batch in batches[:2]:
        state, _ = eight.train_step(state, batch)
    saved = _host(eight, state)
    with Checkpointer(tmp_path / "ckpt", eight.layouts) as ckpt:
        ckpt.save(state)
    reference = []  # the uninterrupted 8-device run
    for batch in batches[2:]:
        state, m = eight.train_step(state, batch)
        reference.append(float(m["loss"]))

    hops = [
        ("1x2", train.Trainer(placed, tx, mesh=_mesh(1, 2)), None),
        ("one device", train.Trainer(model, tx), None),  # placement "device"
        ("2x4", eight, template8),
    ]
    step, losses = 2, []
    for _, trainer, template in hops:
        if template is None:
            template = _abstract(trainer.init(jax.random.key(1), batches[0]))
        with Checkpointer(tmp_path / "ckpt", trainer.layouts) as ckpt:
            state, meta = ckpt.restore(template, step)
            assert meta["step"] == step
            # dense state, step, rng, tables and their slots: what the last hop saved
            jax.tree.map(np.testing.assert_array_equal, _host(trainer, state), saved)
            for batch in batches[step : step + 2]:
                state, m = trainer.train_step(state, batch)
                losses.append(float(m["loss"]))
            step += 2
            saved = _host(trainer, state)
            ckpt.save(state)
    np.testing.assert_allclose(losses, reference, rtol=0, atol=1e-6)


# ---- the runner ------------------------------------------------------------------------

RUN = {
    **TINY,
    "log_every": 1,
    "eval_every": None,
    "checkpoint_every": 2,
    "keep_checkpoints": 3,
    "progress": False,
    "tables": {"C1": {"dynamic": True, "cache_rows": 200}},
}
ON_8 = ["sharding.devices=8", "sharding.model=4"] + [
    f"tables.{t}.placement={p}" for t, p in PLACEMENTS.items()
]


def _records(run_dir, kind):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if r["kind"] == kind}


def test_runner_resumes_on_2_then_1_device_continuing_the_loss_curve(tmp_path, capsys):
    """A run of 6 steps on 8 devices ("ref"); its copy at step 2 ("rs") resumed on 2
    devices to step 4, then on 1 device to step 6."""
    config = _config(tmp_path, RUN)
    runner.train(runner.load_config([config], ["name=ref", "steps=6", *ON_8]), log=print)
    ref, rs = tmp_path / "runs" / "ref", tmp_path / "runs" / "rs"
    shutil.copytree(ref, rs)
    with Checkpointer(rs / "checkpoints", {}) as ckpt:
        for step in (4, 6):  # the copy goes back to step 2
            ckpt.manager.delete(step)
        ckpt.prune_host_tables()
    log: list[str] = []
    two = [*ON_8[1:], "sharding.devices=2", "sharding.model=2"]
    for steps, keys in [(4, two), (6, ["sharding.devices=1"])]:
        cfg = runner.load_config([config], ["name=rs", f"steps={steps}", *keys])
        runner.train(cfg, log=log.append)

    want, got = _records(ref, "train"), _records(rs, "train")
    assert sorted(got) == sorted(want) == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose(
        [got[s]["loss"] for s in range(1, 7)], [want[s]["loss"] for s in range(1, 7)], atol=1e-5
    )
    e_want, e_got = _records(ref, "eval")[6], _records(rs, "eval")[6]
    assert e_got["loss"] == pytest.approx(e_want["loss"], abs=1e-5)
    assert e_got["auc"] == pytest.approx(e_want["auc"], abs=1e-5)
    assert any("resuming with sharding.devices: 8 -> 2, sharding.model: 4 -> 2" in x for x in log)
    assert any("sharding.devices: 2 -> 1" in x and "C1.placement: row_wise" in x for x in log)
    history = json.loads((rs / "run.json").read_text())["history"]
    assert [h["changed"]["sharding.devices"] for h in history[1:]] == [[8, 2], [2, 1]]

    # `sparsejax train` over these checkpoints with another sparse optimizer (other
    # slots): a user error in one line naming the table
    shutil.copytree(rs / "checkpoints", tmp_path / "runs" / "other" / "checkpoints")
    capsys.readouterr()
    assert main(["train", config, "name=other", "optimizer.sparse=sgd"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    assert "table 'C1' was saved with optimizer='LazyAdam'" in err, err


def test_a_checkpoint_of_another_model_is_refused_naming_the_table(tmp_path):
    """Restoring into a model whose C2 has another vocabulary, which lacks C4, or whose C3
    has another sparse optimizer (other slots): one line naming the table."""
    cfg = runner.load_config([_config(tmp_path, TINY)])
    data = runner.build_data(cfg)
    batch = data.eval_batches[0]
    trainer = train.Trainer(
        runner.build_model(cfg, data.tables, data.features), runner.dense_optimizer(cfg.optimizer)
    )
    state = trainer.init(jax.random.key(0), batch)
    with Checkpointer(tmp_path / "ckpt", trainer.layouts) as ckpt:
        ckpt.save(state)
    tables = {t.name: t for t in data.tables}
    sgd = ops.optimizers.SGD(learning_rate=0.1)
    others = {
        "table 'C2' was saved with vocab_size=50, the model has vocab_size=60": (
            {**tables, "C2": dataclasses.replace(tables["C2"], vocab_size=60)},
            data.features,
        ),
        "table 'C4' (layer embedding) was saved but the model has no such table": (
            {k: t for k, t in tables.items() if k != "C4"},
            [f for f in data.features if f.table != "C4"],
        ),
        "table 'C3' was saved with optimizer='LazyAdam', the model has optimizer='SGD'": (
            {**tables, "C3": dataclasses.replace(tables["C3"], optimizer=sgd)},
            data.features,
        ),
    }
    for message, (t, f) in others.items():
        model = runner.build_model(cfg, list(t.values()), f)
        with Checkpointer(tmp_path / "ckpt", embedding_layouts(model, batch)) as ckpt:
            with pytest.raises(CheckpointError) as e:
                ckpt.restore_tables()
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


# ---- many processes --------------------------------------------------------------------

PROCS = {
    **TINY,
    "log_every": 1,
    "eval_every": None,
    "checkpoint_every": 2,
    "keep_checkpoints": 3,
    "progress": False,
    "data": {**TINY["data"], "synthetic_options": {"vocab_sizes": [301, 50, 7], "num_dense": 3}},
}
PROC_PLACEMENTS = ["tables.C1.placement=row_wise", "tables.C2.placement=table_wise"]


# slow (three runs of 1-2 processes, ~50 s): the default run restores across device counts
# in one process (8 -> 2 -> 1 -> 8 above, the runner's 2 -> 1) and across process counts
# (2 -> 1 and 1 -> 2, tests/runner/test_dynamic_processes.py)
@pytest.mark.slow
def test_processes_2_to_1_to_2_restore_each_others_shards_and_continue_the_losses(tmp_path):
    """A run of 6 steps on 2 processes (one device each, C1 row-wise over both, C2
    table-wise: each process writes its own shards); its copy at step 2 resumed on 1
    process to step 4 (each process's shards read by one), then on 2 processes to step 6
    (the one process's tables split again). Every restore verifies every array's
    checksums; the losses continue the never-stopped 2-process run's (within 1e-5), and
    checkpoint 2 (saved by 2 processes) restores bitwise the same on 1, 2 and 8 devices
    of one process."""
    config = _config(tmp_path, PROCS)
    run_sparsejax("launch", "-n", "2", config, "name=ref", "steps=6", *PROC_PLACEMENTS)
    ref, rs = tmp_path / "runs" / "ref", tmp_path / "runs" / "rs"
    item = ref / "checkpoints" / "2" / "tables"
    for p in (0, 1):  # each process wrote its own shards
        assert os.listdir(item / f"ocdbt.process_{p}" / "d"), p
    shutil.copytree(ref, rs, ignore=shutil.ignore_patterns("launch"))
    with Checkpointer(rs / "checkpoints", {}) as ckpt:
        for step in (4, 6):  # the copy goes back to step 2
            ckpt.manager.delete(step)
    run_sparsejax("train", config, "name=rs", "steps=4", *PROC_PLACEMENTS)
    run_sparsejax("launch", "-n", "2", config, "name=rs", "steps=6", *PROC_PLACEMENTS)
    want, got = _records(ref, "train"), _records(rs, "train")
    assert sorted(got) == sorted(want) == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose(
        [got[s]["loss"] for s in range(1, 7)], [want[s]["loss"] for s in range(1, 7)], atol=1e-5
    )
    history = json.loads((rs / "run.json").read_text())["history"]
    assert [h.get("processes", 1) for h in history] == [2, 1, 2]

    cfg = runner.load_config([config], PROC_PLACEMENTS)
    data = runner.build_data(cfg)
    model = runner.build_model(cfg, data.tables, data.features)
    placed = model.clone(
        tables=tuple(dataclasses.replace(t, placement=PLACEMENTS[t.name]) for t in model.tables)
    )
    tx = runner.dense_optimizer(cfg.optimizer)
    tables = []
    for trainer in (
        train.Trainer(model, tx),
        train.Trainer(placed, tx, mesh=_mesh(1, 2)),
        train.Trainer(placed, tx, mesh=_mesh(2, 4)),
    ):
        state = trainer.init(jax.random.key(1), data.eval_batches[0])
        with Checkpointer(ref / "checkpoints", trainer.layouts) as ckpt:
            restored, _ = ckpt.restore_tables(2)
        state = dataclasses.replace(state, tables=restored)
        tables.append(jax.device_get(trainer.tables_by_name(state)))
    for other in tables[1:]:
        jax.tree.map(np.testing.assert_array_equal, other, tables[0])
