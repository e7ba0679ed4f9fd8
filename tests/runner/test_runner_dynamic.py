"""Dynamic and host-cached tables from a config: the `tables` section ("*" and per table,
merged key by key) made into `TableSpec`s (dynamic vocabularies, device caches sized by
a fraction of the distinct train ids, the static table's initializer scale), errors
naming the key, `RawIdMapping` (raw ids as int64 keys), the packer's int64 ids of a
dynamic table, and a run end to end that reports the tables' stats in summary.json."""

import json
import math
import pathlib

import numpy as np
import pytest

from sparsejax import data as sd
from sparsejax import runner
from sparsejax.embedding import FeatureSpec, TableSpec
from sparsejax.embedding._spec import (
    MISSING_KEY,
    BloomAdmission,
    CountAdmission,
    DynamicVocab,
    Eviction,
    HostCache,
)
from sparsejax.runner import ConfigError

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"
FAST = ["progress=false", "log_every=1000", "eval_every=null", "epochs=null", "steps=4"]
SCHEMA = "data.schema={label: label, categorical: [user, item, shop]}"


def _csv(path: pathlib.Path, n: int = 200, seed: int = 0) -> None:
    """Clicks with a string user, an integer item (some missing) and a shop: user and
    item of a few dozen values each, so fractions of their distinct ids are visible."""
    rng = np.random.default_rng(seed)
    lines = ["label,user,item,shop"]
    for _ in range(n):
        user = f"u{int(rng.zipf(1.3)) % 60}"
        item = "" if rng.random() < 0.1 else str(int(rng.integers(0, 40)) * 1_000_003)
        lines.append(f"{int(rng.random() < 0.3)},{user},{item},s{int(rng.integers(0, 5))}")
    path.write_text("\n".join(lines) + "\n")


def _load(tmp_path, *overrides, kind="delimited"):
    base = [f"out_dir={tmp_path / 'runs'}", *FAST]
    if kind == "delimited":
        _csv(tmp_path / "clicks.csv")
        base += [
            "data.kind=delimited",
            f"data.train={tmp_path / 'clicks.csv'}",
            SCHEMA,
            "data.batch_size=32",
            "data.split={by: rows, train: 150}",
        ]
    else:
        base += [f"data.kind={kind}", "data.batch_size=32", "data.eval_batches=1"]
    return runner.load_config([], [*base, *overrides])


def _train_ids(data, table):
    cols = [f.name for f in data.features if f.table == table]
    return np.concatenate([data.train_source.sparse[c].values for c in cols])


# ---------------------------------------------------------------------------------------
# config -> specs


def test_star_and_per_table_entries_merge_key_by_key_into_specs(tmp_path):
    cfg = _load(
        tmp_path,
        "tables={'*': {dynamic: true, cache_rows: 0.5, admission: {bloom: {hashes: 2}}},"
        " user: {admission: {min_count: 3}, max_rows: 1000, eviction: {ttl_steps: 50},"
        " cache_policy: lfu, ram_bytes: 1MiB, disk_dir: spill},"
        " item: {cache_rows: 7, default_row: trainable, when_full: evict, max_rows: 100},"
        " shop: {dynamic: false, cache_rows: 0, vocab_size: 11, dim: 4}}",
        "model.name=din",  # takes mixed dims
    )
    data = runner.build_data(cfg)
    t = {s.name: s for s in data.tables}
    user, item, shop = t["user"], t["item"], t["shop"]
    # user: the "*" bloom filter (its hashes) and the table's own min_count
    assert user.dynamic == DynamicVocab(
        max_rows=1000,
        admission=BloomAdmission(min_count=3, hashes=2),
        eviction=Eviction(ttl_steps=50),
    )
    distinct = np.unique(_train_ids(data, "user")).size
    rows = max(math.ceil(0.5 * distinct), min(distinct, 32))
    assert user.cache == HostCache(
        rows=rows,
        policy="lfu",
        ram_bytes=1 << 20,
        disk_dir=str(pathlib.Path(cfg.run_dir).resolve() / "spill"),
    )
    assert user.vocab_size is None and user.device_rows == rows
    # item: its own row count wins over the "*" fraction
    assert item.dynamic.admission == BloomAdmission(hashes=2)
    assert (item.dynamic.default_row, item.dynamic.when_full) == ("trainable", "evict")
    assert item.cache == HostCache(rows=7)
    # shop opts out of both: a static table of 11 hash buckets, dim 4
    assert (shop.dynamic, shop.cache, shop.vocab_size, shop.dim) == (None, None, 11, 4)
    assert {user.dim, item.dim} == {cfg.model.embedding_dim}
    assert "tables: 2 dynamic, 2 with a device cache" in data.report
    assert f"user {rows}/{distinct}" in data.report


def test_a_fraction_counts_distinct_train_ids_and_a_batch_always_fits(tmp_path):
    cfg = _load(tmp_path, "tables={'*': {dynamic: true, cache_rows: 0.1}}")
    data = runner.build_data(cfg)
    for spec in data.tables:
        distinct = np.unique(_train_ids(data, spec.name)).size
        assert spec.cache.rows == max(math.ceil(0.1 * distinct), min(distinct, 32)), spec.name
        assert spec.cache.rows <= distinct
        assert spec.dynamic == DynamicVocab(admission=CountAdmission(min_count=1))
    big = _load(tmp_path, "tables.user={dynamic: true, cache_rows: 1.0}")
    user = {s.name: s for s in runner.build_data(big).tables}["user"]
    assert user.cache.rows == np.unique(_train_ids(data, "user")).size


def test_dynamic_rows_start_at_the_static_tables_scale(tmp_path):
    static = runner.build_data(_load(tmp_path, "data.min_count=2"))
    dynamic = runner.build_data(
        _load(tmp_path, "data.min_count=2", "tables.*={dynamic: true, cache_rows: 16}")
    )
    for s, d in zip(static.tables, dynamic.tables, strict=True):
        assert d.initializer.scale == pytest.approx(math.sqrt(1 / s.vocab_size)), s.name
        assert s.initializer.scale is None  # the static table's default, from its shape


def test_tables_dim_and_vocab_size_supersede_the_feature_options(tmp_path):
    cfg = _load(
        tmp_path,
        "data.features={user: {dim: 8, hash_buckets: 50}}",
        "tables={'*': {dim: 4, vocab_size: 30}, shop: {dim: 2}}",
        "model.name=din",
    )
    t = {s.name: s for s in runner.build_data(cfg).tables}
    # own entry > data.features > "*" > model.embedding_dim
    assert (t["user"].dim, t["user"].vocab_size) == (8, 50)
    assert (t["item"].dim, t["item"].vocab_size) == (4, 30)
    assert (t["shop"].dim, t["shop"].vocab_size) == (2, 30)


def test_synthetic_data_trains_dynamic_tables_on_its_ids(tmp_path):
    cfg = _load(
        tmp_path,
        "data.synthetic_options={vocab_sizes: [50, 7]}",
        "tables={'*': {dynamic: true, cache_rows: 40}, C2: {cache_rows: 0, max_rows: 7}}",
        kind="synthetic",
    )
    data = runner.build_data(cfg)
    c1, c2 = data.tables
    assert c1.dynamic == DynamicVocab() and c1.cache == HostCache(rows=40)
    assert c2.cache is None and c2.device_rows == 7
    assert c1.initializer.scale == pytest.approx(math.sqrt(1 / 50))
    batch = data.eval_batches[0]
    assert all(f.ids.dtype == np.int64 for f in batch.features.values())


def test_config_round_trips_through_its_yaml(tmp_path):
    cfg = _load(
        tmp_path,
        "tables={'*': {dynamic: true, cache_rows: 0.25, ram_bytes: 2GB}, item: {cache_rows: 1}}",
    )
    assert cfg.tables["*"].ram_bytes == 2 * 10**9
    assert isinstance(cfg.tables["*"].cache_rows, float) and cfg.tables["item"].cache_rows == 1
    again = runner.config_from_dict(runner._config.to_dict(cfg))
    assert again == cfg and runner.config_hash(again) == runner.config_hash(cfg)


def test_a_cache_size_may_change_on_resume_turning_a_cache_on_may_not(tmp_path):
    tables = "tables={'*': {dynamic: true, cache_rows: %s}, shop: {dynamic: false, cache_rows: %d}}"
    first = _load(tmp_path, tables % ("0.5", 0))
    (pathlib.Path(first.run_dir) / "checkpoints" / "4").mkdir(parents=True)
    runner._run_dir._record_start(first, {})
    bigger = _load(tmp_path, tables % ("0.9", 0), "tables.user.ram_bytes=1GB")
    notes, entry = runner._run_dir._prepare_run_dir(bigger, restart=False)
    assert "tables.*.cache_rows: 0.5 -> 0.9" in notes[0] and entry["event"] == "resume"
    assert runner.config_hash(bigger) == runner.config_hash(first)
    with pytest.raises(ConfigError, match=r"tables.shop.cache_rows: 0 -> 10\)"):
        runner._run_dir._prepare_run_dir(_load(tmp_path, tables % ("0.5", 10)), restart=False)


def test_the_shipped_dynamic_config_makes_every_criteo_table_dynamic():
    cfg = runner.load_config([CONFIGS / "dlrm_criteo_dynamic.yaml"])
    assert cfg.data.kind == "criteo" and cfg.model.name == "dlrm"
    tc = runner._table_config.resolve_table(cfg.tables, "C7")
    assert (tc.dynamic, tc.cache_rows, tc.admission.min_count) == (True, 0.1, 2)
    static = runner.load_config([CONFIGS / "dlrm_criteo.yaml"])
    differ = {k for k, _, _ in runner.config_changes(*map(runner._config.to_dict, (static, cfg)))}
    assert {k.split(".")[0] for k in differ} == {"name", "tables"}  # the same run otherwise


@pytest.mark.parametrize(
    "override,message",
    [
        ("tables.user.dynamc=true", "'tables.user.dynamc'; did you mean 'dynamic'?"),
        ("tables.usr.dim=4", "'tables.usr': the run has no table 'usr'; did you mean 'user'?"),
        (
            "tables.user={dynamic: true, max_rows: 9, admission: {min_cont: 2}}",
            "'tables.user.admission.min_cont'; did you mean 'min_count'?",
        ),
        ("tables.user.dynamic=true", "tables.user: a dynamic table needs a device size"),
        ("tables.user.admission={min_count: 2}", "tables.user.admission is for a dynamic table"),
        ("tables.user.ram_bytes=1GiB", "tables.user.ram_bytes is for a table with a device cache"),
        ("tables.user.cache_rows=1.5", "a float is a fraction in (0, 1]"),
        ("tables.user.cache_rows=-3", "'tables.user.cache_rows' must be >= 0 rows"),
        ("tables.user.cache_rows=[1]", "'tables.user.cache_rows': expected rows (an int)"),
        ("tables.user={cache_rows: 5, ram_bytes: 3 parsecs}", "'tables.user.ram_bytes': expected"),
        ("tables.user.dim=0", "tables.user.dim must be >= 1"),
        (
            "tables={'*': {dynamic: true, max_rows: 5}, user: {vocab_size: 9}}",
            "tables.user.vocab_size: table 'user' is dynamic (tables.*.dynamic)",
        ),
        (
            "tables.user={dynamic: true, max_rows: 5, admission: {min_count: 300, bloom: {}}}",
            "tables.user.admission.min_count must be <= 255 with bloom",
        ),
        (
            "tables.user={dynamic: true, max_rows: 5, when_full: never}",
            "'tables.user.when_full': 'never' is not one of",
        ),
        ("tables=[user]", "config key 'tables': expected a mapping"),
        ("tables.user=4", "tables.user: expected a mapping of table options"),
        (
            "data.features={user: {dim: 8}}",
            "tables.user.dim=4 and data.features (table 'user') dim=8 disagree",
        ),
    ],
)
def test_errors_name_the_key(tmp_path, override, message):
    extra = ["tables.user.dim=4"] if override.startswith("data.features") else []
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, override, *extra)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "kind,override,message",
    [
        ("synthetic", "tables.C1={dynamic: true, cache_rows: 0.1}", "needs file data read into"),
        ("synthetic", "tables.C1.vocab_size=10", "hash buckets are for file data"),
        ("synthetic", "tables.C27.dim=4", "no table 'C27'; did you mean 'C"),
        ("behavior", "tables.item={dynamic: true, max_rows: 9}", "dynamic tables need data.kind"),
    ],
)
def test_what_a_data_kind_cannot_give_is_refused_at_load(tmp_path, kind, override, message):
    with pytest.raises(ConfigError, match=None) as e:
        _load(tmp_path, override, kind=kind)
    assert message in str(e.value)


def test_a_stream_takes_rows_not_fractions(tmp_path):
    with pytest.raises(ConfigError, match="data.stream"):
        runner.load_config(
            [],
            [
                "data.kind=criteo",
                "data.train=a.txt",
                "data.eval=b.txt",
                "data.stream=true",
                "data.id_mapping=hash",
                "steps=3",
                "epochs=null",
                "tables.C1={dynamic: true, cache_rows: 0.1}",
            ],
        )


# ---------------------------------------------------------------------------------------
# Raw ids and the packer


def test_raw_id_mapping_keeps_raw_ids_as_keys():
    m = sd.RawIdMapping()
    assert m.vocab_size is None
    raw = np.array([0, 5, -1, (1 << 63) - 2, 123456789012345], np.int64)
    out = m(raw)
    assert out.dtype == np.int64
    assert out.tolist() == [0, 5, MISSING_KEY, (1 << 63) - 2, 123456789012345]
    u = np.array([1, (1 << 63) - 1], np.uint64)
    assert m(u).tolist() == [1, (1 << 63) - 1] and m(u).dtype == np.int64
    with pytest.raises(ValueError, match="raw id 9223372036854775808 is >= 2"):
        m(np.array([1 << 63], np.uint64))
    assert m(np.array([7], np.int32)).dtype == np.int64


def test_readers_give_raw_ids_a_dynamic_table_keeps(tmp_path):
    data = runner.build_data(_load(tmp_path, "tables.*={dynamic: true, cache_rows: 16}"))
    item = data.train_source.sparse["item"].values
    assert item.dtype == np.int64
    raw = {MISSING_KEY} | {sd.stable_hash(str(k * 1_000_003)) for k in range(40)}
    assert set(item.tolist()) <= raw and MISSING_KEY in set(item.tolist())
    user = data.train_source.sparse["user"].values
    assert set(user.tolist()) <= {sd.stable_hash(f"u{k}") for k in range(60)}


def _packer(batch_size=4):
    tables = [
        TableSpec(name="d", dim=2, dynamic=DynamicVocab(), cache=HostCache(rows=8)),
        TableSpec(name="s", vocab_size=10, dim=2),
    ]
    features = [
        FeatureSpec(name="one", table="d"),
        FeatureSpec(name="bag", table="d", max_ids=3, combiner="mean"),
        FeatureSpec(name="static", table="s"),
    ]
    return sd.BatchPacker(tables, features, batch_size=batch_size)


def test_the_packer_keeps_int64_keys_for_dynamic_tables():
    big = (1 << 62) + 3
    sparse = {
        "one": sd.JaggedIds(lengths=np.ones(3, np.int32), values=np.array([big, 0, 7])),
        "bag": sd.JaggedIds(lengths=np.array([2, 0, 1]), values=np.array([big, 5, MISSING_KEY])),
        "static": sd.JaggedIds(lengths=np.ones(3, np.int32), values=np.array([1, 2, 9])),
    }
    b = _packer().pack(sparse, labels=np.zeros(3))
    one, bag, static = (b.features[k] for k in ("one", "bag", "static"))
    assert one.ids.dtype == bag.ids.dtype == np.int64 and static.ids.dtype == np.int32
    assert one.ids.tolist() == [big, 0, 7, -1]
    assert bag.ids.tolist()[:3] == [big, 5, MISSING_KEY] and set(bag.ids.tolist()[3:]) == {-1}
    assert bag.segments.tolist()[:3] == [0, 0, 2]
    assert static.ids.tolist() == [1, 2, 9, -1]
    top = (1 << 63) - 1
    u = dict(sparse, one=sd.JaggedIds(lengths=np.ones(3), values=np.array([top, 1, 2], "u8")))
    ids = _packer().pack(u, labels=np.zeros(3)).features["one"].ids
    assert ids.dtype == np.int64 and ids.tolist() == [top, 1, 2, -1]


@pytest.mark.parametrize(
    "values,message",
    [
        (np.array([1, -5, 2]), "feature 'one': id -5 of example 1 is negative"),
        (np.array([1, 2, 3], np.int32), "feature 'one': ids of dtype int32, but table 'd' is"),
        (np.array([1.0, 2.0, 3.0]), "ids of dtype float64"),
        (np.array([1, 2, (1 << 64) - 1], np.uint64), "of example 2 is >= 2**63"),
    ],
)
def test_bad_ids_of_a_dynamic_table_name_the_feature(values, message):
    sparse = {
        "one": sd.JaggedIds(lengths=np.ones(3, np.int32), values=values),
        "bag": sd.JaggedIds(lengths=np.zeros(3, np.int32), values=np.zeros(0, np.int64)),
        "static": sd.JaggedIds(lengths=np.ones(3, np.int32), values=np.array([1, 2, 3])),
    }
    with pytest.raises(ValueError) as e:
        _packer().pack(sparse, labels=np.zeros(3))
    assert message in str(e.value)


# ---------------------------------------------------------------------------------------
# End to end


def test_a_run_with_dynamic_tables_reports_their_stats(tmp_path):
    pytest.importorskip("sparsejax.embedding.host")
    cfg = _load(
        tmp_path,
        "name=dyn",
        "tables={'*': {dynamic: true, cache_rows: 0.5, admission: {min_count: 2}},"
        " user: {ram_bytes: 1KiB}, shop: {dynamic: false, cache_rows: 0}}",
        "checkpoint_every=2",
        "checkpoint_full_every=2",
    )
    lines = []
    summary = runner.train(cfg, log=lines.append)
    assert summary["step"] == 4
    assert any(line.startswith("tables: 2 tiered, ") for line in lines), lines
    on_disk = json.loads((pathlib.Path(cfg.run_dir) / "summary.json").read_text())
    stats = on_disk["tables"]
    assert {k.split("/")[-1] for k in stats} == {"user", "item"}
    user, item = (next(v for k, v in stats.items() if k.endswith(t)) for t in ("user", "item"))
    assert user["host_disk_bytes"] > 0 and item["host_disk_bytes"] == 0  # RAM 1 KiB: disk
    assert (pathlib.Path(cfg.run_dir) / "host_rows").is_dir()
    assert 0 < user["rows_live"] <= user["admitted"] and user["cache_rows"] > 0
    assert math.isfinite(on_disk["last_eval"]["auc"])
    host = pathlib.Path(cfg.run_dir) / "checkpoints" / "host_tables"
    kinds = [json.loads((host / s / "manifest.json").read_text())["kind"] for s in ("2", "4")]
    assert kinds == ["full", "delta"]  # checkpoint_full_every=2


def test_a_full_disk_while_spilling_is_one_line_and_the_last_checkpoint_restores(
    tmp_path, monkeypatch, capsys
):
    pytest.importorskip("sparsejax.embedding.host")
    import errno
    import os

    from sparsejax.__main__ import main

    _csv(tmp_path / "clicks.csv")
    args = [
        "train",
        f"out_dir={tmp_path / 'runs'}",
        *FAST,
        "data.kind=delimited",
        f"data.train={tmp_path / 'clicks.csv'}",
        SCHEMA,
        "data.batch_size=32",
        "data.split={by: rows, train: 150}",
        "tables={'*': {dynamic: true, cache_rows: 0.5}, user: {ram_bytes: 1KiB}}",
        "checkpoint_every=2",
    ]
    assert main([*args, "steps=2"]) == 0

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:  # the resumed run's disk tier cannot grow
        m.setattr(os, "posix_fallocate", no_space)
        assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'user'" in err[0] and "disk tier" in err[0], err
    assert main(args) == 0  # the step-2 checkpoint is intact: the run resumes and ends
    summary = json.loads((tmp_path / "runs" / "default" / "summary.json").read_text())
    assert summary["step"] == 4
