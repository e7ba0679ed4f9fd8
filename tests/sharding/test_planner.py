"""The table planner: plans fit every device (weights, optimizer slots and caches
counted), pinned placements are kept or refused by name, a plan that cannot fit names
every table's need, table-wise tables are balanced, the byte formulas hold by hand, the
1e11-row plan's printed figures are recomputed independently, `sparsejax plan` prints
it, and a run on a mesh places its tables as planned."""

import dataclasses
import json
import math
import pathlib

import numpy as np
import pytest

from sparsejax import runner
from sparsejax.__main__ import main
from sparsejax.embedding import FeatureSpec, TableSpec
from sparsejax.embedding._memory import format_bytes
from sparsejax.ops.optimizers import SGD, Adagrad, RowWiseAdagrad
from sparsejax.runner import ConfigError
from sparsejax.runner._plan import place_tables, plan_config, planned_tables, run_devices
from sparsejax.sharding._placement import assign_table_wise
from sparsejax.sharding._planner import PlanError, TableShape, comm_bytes, plan_tables

ROOT = pathlib.Path(__file__).resolve().parents[2]
MESH = {"data": 2, "model": 4}
ROW_ADAGRAD = RowWiseAdagrad(learning_rate=0.1)


def _specs(sizes, dim=16, optimizer=ROW_ADAGRAD, combiner="sum"):
    tables = [
        TableSpec(name=f"t{i}", vocab_size=v, dim=dim, optimizer=optimizer)
        for i, v in enumerate(sizes)
    ]
    features = [
        FeatureSpec(name=f"f{i}", table=t.name, combiner=combiner) for i, t in enumerate(tables)
    ]
    return tables, features


def _row_bytes(dim, optimizer):
    """Weights (f32) and slots of one row, counted here from the optimizer's slots."""
    return 4 * dim + 4 * sum(1 if s.per_row else dim for s in optimizer.slots())


def _piece(spec, placement, mesh):
    """Bytes of a table's piece on a device holding one, by hand."""
    n, m = mesh["data"] * mesh["model"], mesh["model"]
    v, d = spec.vocab_size, spec.dim
    rows, dim = {
        "replicated": (v, d),
        "table_wise": (v, d),
        "column_wise": (v, d // m),
        "table_row_wise": (math.ceil(v / m), d),
        "row_wise": (math.ceil(v / n), d),
    }[placement]
    return rows * _row_bytes(dim, spec.optimizer)


def _device_loads(plan, tables, mesh):
    loads = [0] * mesh["model"]
    for t in tables:
        p = plan.placements[t.name]
        for i in [plan.assignment[t.name]] if p == "table_wise" else range(mesh["model"]):
            loads[i] += _piece(t, p, mesh)
    return loads


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("memory", [2_000_000, 8_000_000, 40_000_000])
def test_every_device_fits_its_budget(seed, memory):
    rng = np.random.default_rng(seed)
    sizes = [int(x) for x in rng.integers(10, 200_000, rng.integers(3, 12))]
    tables, features = _specs(sizes, optimizer=[ROW_ADAGRAD, Adagrad(learning_rate=0.1)][seed % 2])
    try:
        plan = plan_tables(tables, features, batch_size=64, mesh_shape=MESH, device_memory=memory)
    except PlanError as e:  # then not even every table split over all 8 devices fits
        assert sum(_piece(t, "row_wise", MESH) for t in tables) > 0.9 * memory, e
        return
    loads = _device_loads(plan, tables, MESH)
    assert list(plan.device_bytes) == loads
    assert max(loads) <= 0.9 * memory == plan.budget
    for t in tables:
        assert plan.memory[t.name] == _piece(t, plan.placements[t.name], MESH)


def test_optimizer_slots_and_caches_are_counted():
    # 100k x 16 f32 weights take 6.4 MB; the row-wise Adagrad slot adds 0.4 MB
    (t,), feats = _specs([100_000])
    fits_without_slots = dict(batch_size=64, mesh_shape=MESH, device_memory=6_600_000, reserve=0.0)
    plan = plan_tables([t], feats, **fits_without_slots)
    assert plan.placements["t0"] == "table_row_wise"  # not whole on one device
    assert plan.memory["t0"] == 25_000 * (16 * 4 + 4)
    # Adagrad keeps a slot per weight: 12.8 MB whole; column-wise would split it too,
    # but table-row-wise moves fewer bytes
    (t,), feats = _specs([100_000], optimizer=Adagrad(learning_rate=0.1))
    plan = plan_tables([t], feats, batch_size=64, mesh_shape=MESH, device_memory=10_000_000)
    assert plan.placements["t0"] == "table_row_wise"
    assert plan.memory["t0"] == 25_000 * 16 * 8
    # SGD has no slots: the same table fits whole
    (t,), feats = _specs([100_000], optimizer=SGD(learning_rate=0.1))
    plan = plan_tables([t], feats, **fits_without_slots)
    assert plan.placements["t0"] == "table_wise"
    # a host-cached table takes its cache (and default row) on the device, not its rows
    from sparsejax.embedding import HostCache

    cached = dataclasses.replace(t, name="c", optimizer=ROW_ADAGRAD, cache=HostCache(rows=999))
    plan = plan_tables(
        [cached],
        [FeatureSpec(name="f", table="c")],
        batch_size=64,
        mesh_shape=MESH,
        device_memory=10**9,
    )
    assert plan.memory["c"] == 1000 * (16 * 4 + 4)


def test_pinned_placements_are_kept_or_refused_by_name():
    tables, feats = _specs([100, 1000, 10_000])
    kw = dict(batch_size=64, mesh_shape=MESH, device_memory=10**9)
    free = plan_tables(tables, feats, **kw)
    assert set(free.placements.values()) == {"replicated"}
    plan = plan_tables(tables, feats, pinned={"t0": "row_wise", "t1": "table_wise"}, **kw)
    assert plan.placements == {"t0": "row_wise", "t1": "table_wise", "t2": "replicated"}
    assert plan.pinned == {"t0", "t1"}
    # a spec placed already counts as pinned; `pinned` wins over it
    placed = [dataclasses.replace(tables[0], placement="table_row_wise"), *tables[1:]]
    assert plan_tables(placed, feats, **kw).placements["t0"] == "table_row_wise"
    assert plan_tables(placed, feats, pinned={"t0": "row_wise"}, **kw).placements["t0"] == (
        "row_wise"
    )
    for pinned, opts, message in [
        ({"t1": "column_wise"}, {"dim": 6, "optimizer": SGD(learning_rate=0.1)}, "'t1'.*dim 6"),
        ({"t2": "column_wise"}, {}, "'t2'.*RowWiseAdagrad keeps one value per whole row"),
        ({"t0": "row_wise"}, {"combiner": "max"}, "'t0'.*feature 'f0' pools by max"),
        ({"t0": "sideways"}, {}, "'t0'.*'sideways' is not one of"),
        ({"nope": "row_wise"}, {}, "'nope'"),
    ]:
        tables, feats = _specs([100, 1000, 10_000], **opts)
        with pytest.raises(PlanError, match=message):
            plan_tables(tables, feats, pinned=pinned, **kw)
    # max pooling: never split rows, even unpinned
    tables, feats = _specs([200_000], combiner="max", optimizer=SGD(learning_rate=0.1))
    plan = plan_tables(tables, feats, batch_size=64, mesh_shape=MESH, device_memory=8_000_000)
    assert plan.placements["t0"] == "column_wise"


def test_a_plan_that_cannot_fit_names_every_table_and_the_memory():
    tables, feats = _specs([5_000_000, 3_000_000, 10])
    with pytest.raises(PlanError) as e:
        plan_tables(tables, feats, batch_size=64, mesh_shape=MESH, device_memory=50_000_000)
    msg = str(e.value)
    assert "\n" not in msg
    assert f"{format_bytes(45_000_000)} available per device" in msg
    for t in tables:  # each table's need under its best placement (row-wise here)
        assert f"{t.name} {format_bytes(_piece(t, 'row_wise', MESH))} (row_wise)" in msg
    # a pinned table's need is under its pinned placement
    with pytest.raises(PlanError, match=r"t0 \S+ MiB \(table_wise\)"):
        plan_tables(
            tables,
            feats,
            batch_size=64,
            mesh_shape=MESH,
            device_memory=50_000_000,
            pinned={"t0": "table_wise"},
        )


def test_table_wise_tables_are_balanced_over_the_model_axis():
    unit = 10_000
    tables, feats = _specs([k * unit for k in range(8, 0, -1)])
    plan = plan_tables(
        tables,
        feats,
        batch_size=64,
        mesh_shape=MESH,
        device_memory=10**9,
        replicate_max=0.0,
    )
    assert set(plan.placements.values()) == {"table_wise"}
    sizes = {t.name: t.vocab_size * _row_bytes(16, ROW_ADAGRAD) for t in tables}
    assert plan.assignment == assign_table_wise(sizes, 4)
    assert len(set(plan.device_bytes)) == 1  # 8+1, 7+2, 6+3, 5+4
    # too big together (9 units per index): tables move down until every device fits
    budget = 17 * unit * _row_bytes(16, ROW_ADAGRAD) // 2  # 8.5 units: 9 per index is over
    plan = plan_tables(
        tables,
        feats,
        batch_size=64,
        mesh_shape=MESH,
        device_memory=budget,
        reserve=0.0,
        replicate_max=0.0,
    )
    assert max(_device_loads(plan, tables, MESH)) <= budget
    # spreading the largest over "model" alone leaves 9 units per index: it is split
    # over every device, and the rest stay whole
    assert plan.placements == {"t0": "row_wise", **{f"t{i}": "table_wise" for i in range(1, 8)}}


def test_comm_bytes_by_hand():
    n, b, d = 40, 16, 8  # ids and bags on one device; 2 x 4 devices
    x = 12 * n
    cases = {
        "replicated": (0, 8 * (x + 4 * b * d)),
        "table_wise": (4 * x + 4 * 4 * b * d, 4 * 4 * b * d + 2 * (4 * x + 4 * 4 * b * d)),
        "table_row_wise": (4 * x + 4 * 4 * b * d, 4 * 4 * b * d + 2 * (4 * x + 4 * 4 * b * d)),
        # 4 column pieces of dim 2, each reading every id: 4x the ids, table-wise's rows
        "column_wise": (16 * x + 4 * 4 * b * d, 4 * 4 * b * d + 2 * (16 * x + 4 * 4 * b * d)),
        "row_wise": (8 * x + 4 * 8 * b * d, 4 * 8 * b * d),
    }
    for p, (fwd, bwd) in cases.items():
        got = comm_bytes(p, ids=n, bags=b, dim=d, mesh_shape=MESH)
        assert got == {"forward": fwd, "backward": bwd}, p
    assert comm_bytes("row_wise", ids=n, bags=b, dim=d, mesh_shape=MESH, id_bytes=8) == {
        "forward": 8 * 8 * n + 4 * 8 * b * d,
        "backward": 4 * 8 * b * d,
    }
    one = {"data": 1, "model": 1}
    for p in cases:  # one device: nothing moves
        assert comm_bytes(p, ids=n, bags=b, dim=d, mesh_shape=one) == {"forward": 0, "backward": 0}


def test_plan_bytes_do_not_depend_on_the_vocabulary():
    def plan(v):
        tables, feats = _specs([v, v])
        return plan_tables(
            tables,
            feats,
            batch_size=64,
            mesh_shape=MESH,
            device_memory=10**9,
            pinned={"t0": "row_wise", "t1": "table_wise"},
        )

    small, big = plan(1000), plan(100_000)
    assert small.comm == big.comm and small.bytes_per_device > 0
    # one-hot sum features send 8 bytes an id (no coefficient): 8 ids/device, 8 bags
    assert small.comm["t0"]["forward"] == 8 * 8 * 8 + 4 * 8 * 8 * 16


def test_plan_apply_and_table():
    tables, feats = _specs([100, 1000])
    plan = plan_tables(
        tables,
        feats,
        batch_size=64,
        mesh_shape=MESH,
        device_memory=10**9,
        pinned={"t1": "row_wise"},
    )
    applied = plan.apply(tables)
    assert [t.placement for t in applied] == ["replicated", "row_wise"]
    assert applied[1] == dataclasses.replace(tables[1], placement="row_wise")
    with pytest.raises(ValueError, match="'x' is not in the plan"):
        plan.apply([dataclasses.replace(tables[0], name="x")])
    text = plan.table()
    assert text.splitlines()[0].startswith("plan: 2 tables on 8 devices (1 host x 8; mesh data 2")
    assert "row_wise (pinned)" in text and "memory per device" in text and "per host" in text


def test_a_table_past_int32_rows_is_planned_as_a_table_shape():
    with pytest.raises(ValueError, match="int32"):  # one device cannot take its row ids
        TableSpec(name="big", vocab_size=10**10, dim=64, placement="replicated")
    big = TableShape(name="big", vocab_size=10**10, dim=64)
    plan = plan_tables(
        [big],
        [FeatureSpec(name="f", table="big")],
        batch_size=512,
        mesh_shape={"data": 64, "model": 8},
        device_memory=80 * 10**9,
    )
    assert plan.placements["big"] == "row_wise"
    assert plan.memory["big"] == math.ceil(10**10 / 512) * (64 * 4 + 4)


# ---- scale on paper: configs/dlrm_1e11.yaml over 64 hosts x 8 devices of 80 GB -------------


@pytest.fixture(scope="module")
def plan_1e11():
    cfg = runner.load_config([ROOT / "configs" / "dlrm_1e11.yaml"])
    return cfg, plan_config(cfg, hosts=64, devices_per_host=8, device_memory="80GB")


def test_the_1e11_row_plan_adds_up(plan_1e11):
    cfg, plan = plan_1e11
    vocab = cfg.data.synthetic_options["vocab_sizes"]
    assert sum(vocab) >= 10**11 and len(vocab) == 26
    n_dev, model, hosts, dim = 512, 8, 64, 64
    row = dim * 4 + 4  # f32 weights and row-wise Adagrad's one accumulator per row
    budget = 0.9 * 80 * 10**9
    ids = bags = 65_536 // n_dev  # one id and one bag per example and table, per device
    w = 4 * bags * dim
    by_hand = {  # (rows per device, forward, backward) per placement
        "row_wise": (lambda v: math.ceil(v / n_dev), n_dev * (8 * ids + w), n_dev * w),
        "table_row_wise": (
            lambda v: math.ceil(v / model),
            model * (8 * ids + w),
            model * w + hosts * model * (8 * ids + w),
        ),
        "replicated": (lambda v: v, 0, n_dev * (8 * ids + w)),
    }
    total_memory = total_bytes = 0
    for i, v in enumerate(vocab):
        name, p = f"C{i + 1}", plan.placements[f"C{i + 1}"]
        rows, fwd, bwd = by_hand[p]
        assert plan.memory[name] == rows(v) * row, name
        assert plan.comm[name] == {"forward": fwd, "backward": bwd}, name
        total_memory += rows(v) * row
        total_bytes += fwd + bwd
    # no table-wise table: every device holds the same
    assert plan.device_bytes == (total_memory,) * model and total_memory <= budget
    assert plan.bytes_per_device == total_bytes and plan.bytes_per_host == 8 * total_bytes
    # the 1e10-row tables are split over every device, the small ones replicated
    assert all(plan.placements[f"C{i}"] == "row_wise" for i in range(1, 13))
    assert all(plan.placements[f"C{i}"] == "replicated" for i in range(17, 27))
    text = plan.table()
    assert f"memory per device: {format_bytes(total_memory)} (fullest device)" in text
    assert f"{format_bytes(total_bytes)} per device, {format_bytes(8 * total_bytes)} per host" in (
        text
    )
    for i, v in enumerate(vocab):
        name = f"C{i + 1}"
        rows, fwd, bwd = by_hand[plan.placements[name]]
        cells = text.splitlines()[i + 2].split()
        assert cells[0] == name and " ".join(cells[-4:]) == (
            f"{format_bytes(rows(v) * row)} {format_bytes(fwd + bwd)}"
        )


def test_the_1e11_plan_is_the_one_recorded_in_results(plan_1e11):
    _, plan = plan_1e11
    assert plan.table() in (ROOT / "experiments" / "RESULTS.md").read_text(), (
        "experiments/RESULTS.md 'Scale on paper' holds another plan: paste `sparsejax plan "
        "configs/dlrm_1e11.yaml --hosts 64 --devices-per-host 8 --device-memory 80GB`"
    )


def test_sparsejax_plan_prints_the_table_and_refuses_what_cannot_fit(capsys, plan_1e11):
    config = str(ROOT / "configs" / "dlrm_1e11.yaml")
    args = ["plan", config, "--hosts", "64", "--devices-per-host", "8"]
    assert main([*args, "--device-memory", "80GB"]) == 0
    assert capsys.readouterr().out.strip() == plan_1e11[1].table()
    assert main([*args, "--device-memory", "40GB"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the tables do not fit" in err and "C26" in err


# ---- the runner: the run's devices, mesh and placements ------------------------------------


def _cfg(*overrides, tmp_path=None):
    base = [
        "data.synthetic_options={vocab_sizes: [500, 300, 40]}",
        "data.batch_size=64",
        "data.eval_batches=1",
    ]
    if tmp_path is not None:
        base += [f"out_dir={tmp_path}", "progress=false", "eval_every=null", "log_every=1"]
    return runner.load_config([], [*base, *overrides])


def _run_specs(cfg):
    data = runner.build_data(cfg)
    return data.tables, data.features


def test_a_cpu_run_takes_one_device_unless_told_and_plans_when_it_has_more(monkeypatch):
    cfg = _cfg()
    assert len(run_devices(cfg)) == 1  # the 8 fake CPU devices share one memory
    monkeypatch.setenv("SPARSEJAX_LOCAL_DEVICES", "8")  # launch --devices-per-process 8
    assert len(run_devices(cfg)) == 8
    monkeypatch.delenv("SPARSEJAX_LOCAL_DEVICES")
    tables, features = _run_specs(cfg)
    assert place_tables(cfg, tables, features) == (tables, None)  # unchanged: "device"
    logged = []
    cfg = _cfg("sharding.devices=8", "sharding.model=4")
    placed, mesh = place_tables(cfg, tables, features, log=logged.append)
    assert dict(mesh.shape) == {"data": 2, "model": 4}
    assert {t.placement for t in placed} == {"replicated"}
    assert logged[0].startswith("plan: 3 tables on 8 devices")
    cfg = _cfg("tables.C1.placement=row_wise")  # pinned: shards on its one device
    placed, mesh = place_tables(cfg, tables, features)
    assert dict(mesh.shape) == {"data": 1, "model": 1}
    assert [t.placement for t in placed] == ["row_wise", "replicated", "replicated"]
    with pytest.raises(ConfigError, match="sharding.devices=16: the process has 8 devices"):
        run_devices(_cfg("sharding.devices=16"))
    with pytest.raises(PlanError, match="batch of 64 does not split over the 3 devices"):
        place_tables(_cfg("sharding.devices=3"), tables, features)


def test_first_order_tables_follow_their_table():
    cfg = _cfg(
        "model.name=deepfm", "sharding.devices=8", "sharding.model=4", "optimizer.sparse=adagrad"
    )
    tables, features = _run_specs(cfg)
    planned, _, follow = planned_tables(cfg, tables, features)
    assert follow == {f"C{i}_linear": f"C{i}" for i in (1, 2, 3)} and len(planned) == 6
    placed, _ = place_tables(cfg, tables, features)
    assert all(t.placement == "replicated" for t in placed)
    # a 1-dim first-order twin cannot split its columns over 4 devices
    pinned = _cfg(
        "model.name=deepfm",
        "sharding.devices=8",
        "sharding.model=4",
        "optimizer.sparse=adagrad",
        "tables.C1.placement=column_wise",
    )
    with pytest.raises(PlanError, match="'C1' pinned column_wise.*'C1_linear'"):
        place_tables(pinned, tables, features)


def _losses(run_dir):
    with open(pathlib.Path(run_dir) / "metrics.jsonl") as f:
        return [r["loss"] for r in map(json.loads, f) if r.get("kind") == "train"]


@pytest.mark.slow  # the store's own mesh tests cover the numbers; this, the runner's wiring
def test_a_run_on_a_mesh_trains_as_on_one_device(tmp_path, capsys):
    common = ["steps=2", "checkpoint_every=null", "keep_checkpoints=1"]
    one = runner.train(_cfg(*common, "name=one", tmp_path=tmp_path), log=lambda _: None)
    lines = []
    mesh = _cfg(
        *common,
        "name=mesh",
        "sharding.devices=8",
        "sharding.model=4",
        "tables.C1.placement=row_wise",
        "tables.C2.placement=table_row_wise",
        tmp_path=tmp_path,
    )
    two = runner.train(mesh, log=lines.append)
    capsys.readouterr()
    np.testing.assert_allclose(_losses(two["run_dir"]), _losses(one["run_dir"]), rtol=1e-5)
    assert np.isclose(two["last_eval"]["loss"], one["last_eval"]["loss"], rtol=1e-5)
