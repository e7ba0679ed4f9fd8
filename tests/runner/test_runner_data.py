"""Data from a config alone: splits and files, labels, joins with side tables, indicator
bags, per-column options and shared tables, and the shipped example configs, each trained
end to end on a small generated file of the real dataset's shape (no downloads)."""

import dataclasses
import math
import pathlib
import types

import jax
import numpy as np
import pytest
from _data import write_criteo_like

from sparsejax import data as sd
from sparsejax import runner
from sparsejax.data import _transforms as tf
from sparsejax.runner import ConfigError
from sparsejax.train import evaluate_ranking

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"
FAST = ["progress=false", "log_every=1000", "eval_every=null", "epochs=null", "steps=4"]


def _load(config, tmp_path, *overrides):
    files = [CONFIGS / config] if config else []
    return runner.load_config(files, [f"out_dir={tmp_path / 'runs'}", *FAST, *overrides])


def _train(cfg, data):
    """A few training steps of the configured model on `data`, then the eval and test
    splits: the loss moves and every metric is finite. (The runner's own loop, with its
    checkpoints and plots, is tested in test_cli.py; here one compile per step kind.)
    Returns the trainer and the state."""
    model = runner.build_model(cfg, data.tables, data.features)
    trainer = runner.Trainer(model, runner.dense_optimizer(cfg.optimizer))
    batches = sd.pack_examples(data.train_source, data.packer)[: cfg.steps]
    state = trainer.init(jax.random.key(cfg.seed), batches[0])
    before = trainer.evaluate(state, data.eval_batches)
    for b in batches:
        state, _ = trainer.train_step(state, b)
    after = trainer.evaluate(state, data.eval_batches)
    assert after["loss"] != before["loss"]
    for split in (data.eval_batches, data.test_batches or []):
        if split:
            m = trainer.evaluate(state, split)
            assert all(math.isfinite(v) for v in m.values()), m
    return trainer, state


# ---------------------------------------------------------------------------------------
# Generated files of the public datasets' shapes

AVAZU_COLS = (
    "id,click,hour,C1,banner_pos,site_id,site_domain,site_category,app_id,app_domain,"
    "app_category,device_id,device_ip,device_model,device_type,device_conn_type,C14,C15,C16,"
    "C17,C18,C19,C20,C21"
).split(",")


def _avazu(root: pathlib.Path, n=300, first=150):
    """The head of Avazu's train.csv split like `split -l`: part 1 with the header line,
    part 2 a header-less continuation. Returns the clicks in file order."""
    rng = np.random.default_rng(0)
    rows, clicks = [], []
    for i in range(n):
        site = int(rng.integers(0, 8))
        click = int(rng.random() < (0.8 if site < 3 else 0.1))
        cells = [str(10_000_000_000 + i), str(click), str(14102100 + i // 50)]
        for c in AVAZU_COLS[3:]:
            v = site if c == "site_id" else int(rng.integers(0, 5))
            cells.append(f"{c.lower()}{v:x}")
        rows.append(",".join(cells))
        clicks.append(click)
    (root / "avazu").mkdir(parents=True)
    (root / "avazu" / "train_part1.csv").write_text(
        ",".join(AVAZU_COLS) + "\n" + "\n".join(rows[:first]) + "\n"
    )
    (root / "avazu" / "train_part2.csv").write_text("\n".join(rows[first:]) + "\n")
    return np.array(clicks, np.float32)


GENRES = (
    "unknown,Action,Adventure,Animation,Children,Comedy,Crime,Documentary,Drama,Fantasy,"
    "Film-Noir,Horror,Musical,Mystery,Romance,Sci-Fi,Thriller,War,Western"
).split(",")


def _movielens(root: pathlib.Path, n=400, users=30, items=40, lost_user=7):
    """MovieLens 100K's shape: u.data (user, item, rating, time; tabs), u.user and u.item
    ("|"; u.item with 19 genre 0/1 columns). `lost_user` is missing from u.user."""
    rng = np.random.default_rng(1)
    d = root / "ml-100k"
    d.mkdir(parents=True)
    genres = (rng.random((items + 1, len(GENRES))) < 0.15).astype(int)
    user = rng.integers(1, users + 1, n)
    item = rng.integers(1, items + 1, n)
    rating = np.where(genres[item, 1] == 1, 5, rng.integers(1, 6, n))
    time = np.sort(rng.integers(874_724_710, 893_286_638, n))
    (d / "u.data").write_text(
        "".join(
            f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in zip(user, item, rating, time, strict=True)
        )
    )
    (d / "u.user").write_text(
        "".join(
            f"{u}|{20 + u % 40}|{'MF'[u % 2]}|job{u % 5}|{85000 + u}\n"
            for u in range(1, users + 1)
            if u != lost_user
        )
    )
    (d / "u.item").write_bytes(  # latin-1, as the real file (titles like "Misérables")
        "".join(
            f"{i}|Mis\xe9rables {i} (1995)|01-Jan-199{i % 4}||http://imdb/{i}|"
            + "|".join(map(str, genres[i]))
            + "\n"
            for i in range(1, items + 1)
        ).encode("latin-1")
    )
    return dict(user=user, item=item, rating=rating, time=time, genres=genres)


# ---------------------------------------------------------------------------------------
# Splits and files


def test_old_keys_path_and_train_rows_keep_working(tmp_path):
    write_criteo_like(tmp_path / "c.tsv")
    old = runner.build_data(
        _load(
            None, tmp_path, "data.kind=criteo", f"data.path={tmp_path}/c.tsv", "data.train_rows=150"
        )
    )
    new = runner.build_data(
        _load(
            None,
            tmp_path,
            "data.kind=criteo",
            f"data.train={tmp_path}/c.tsv",
            "data.split={by: rows, train: 150}",
        )
    )
    assert len(old.train_source) == len(new.train_source) == 150
    assert len(old.eval_examples) == len(new.eval_examples) == 50
    np.testing.assert_array_equal(old.train_source.labels, new.train_source.labels)
    assert old.test_batches is None


def _ratings_csv(path, n=100):
    rng = np.random.default_rng(3)
    rows = [f"{int(rng.random() < 0.5)},u{i % 7},{1000 + i}" for i in range(n)]
    path.write_text("label,user,time\n" + "\n".join(rows) + "\n")


@pytest.mark.parametrize(
    "split,sizes",
    [
        ("{by: rows, train: 60, eval: 25}", (60, 25, 15)),
        ("{by: fraction, train: 0.7}", (70, 30, None)),
        ("{by: random, train: 0.5, eval: 0.3, seed: 3}", (50, 30, 20)),
        ("{by: time, column: time, train: 1040, eval: 1090}", (40, 50, 10)),
    ],
)
def test_split_rules(tmp_path, split, sizes):
    _ratings_csv(tmp_path / "r.csv")
    cfg = _load(
        None,
        tmp_path,
        "data.kind=delimited",
        f"data.train={tmp_path}/r.csv",
        "data.schema={label: label, categorical: [user], dense: [time]}",
        f"data.split={split}",
    )
    data = runner.build_data(cfg)
    parts = [data.train_source, data.eval_examples, data.test_examples]
    assert tuple(None if p is None else len(p) for p in parts) == sizes
    times = [p.dense[:, 0] for p in parts if p is not None]
    assert sorted(np.concatenate(times).tolist()) == list(range(1000, 1000 + sum(map(len, times))))
    if "time" in split:
        assert times[0].max() < 1040 <= times[1].min() and times[1].max() < 1090 <= times[2].min()
    elif "random" in split:
        assert not np.all(np.diff(np.concatenate(times)) > 0)  # shuffled across parts
        assert all(np.all(np.diff(t) > 0) for t in times)  # each part in file order
    else:
        assert np.all(np.diff(np.concatenate(times)) > 0)  # first rows train
    assert (data.test_batches is None) == (sizes[2] is None)


def test_time_column_read_only_to_split_is_not_a_feature(tmp_path):
    _ratings_csv(tmp_path / "r.csv")
    cfg = _load(
        None,
        tmp_path,
        "data.kind=delimited",
        f"data.train={tmp_path}/r.csv",
        "data.schema={label: label, categorical: [user]}",
        "data.split={by: time, column: time, train: 1080}",
    )
    data = runner.build_data(cfg)
    assert (len(data.train_source), len(data.eval_examples)) == (80, 20)
    assert data.train_source.num_dense == 0 and data.packer.num_dense == 0


def test_eval_and_test_files_and_globs(tmp_path, monkeypatch):
    for name in ("day_1.csv", "day_2.csv", "day_3.csv", "day_4.csv"):
        _ratings_csv(tmp_path / name, n=40)
    monkeypatch.setenv(runner.DATA_DIR_ENV, str(tmp_path))
    cfg = _load(
        None,
        tmp_path,
        "data.kind=delimited",
        "data.train=day_[12].csv",
        "data.eval=[day_3.csv]",
        "data.test=day_4.csv",
        "data.schema={label: label, categorical: [user]}",
    )
    data = runner.build_data(cfg)
    assert (len(data.train_source), len(data.eval_examples), len(data.test_examples)) == (
        80,
        40,
        40,
    )
    assert "day_1.csv" in data.report and "day_4.csv" in data.report
    resolved = runner.absolute_data_paths(cfg.data)
    assert resolved.train == (str(tmp_path / "day_1.csv"), str(tmp_path / "day_2.csv"))
    assert resolved.test == str(tmp_path / "day_4.csv")


def test_a_glob_matching_no_file_names_the_key(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(runner.DATA_DIR_ENV, raising=False)
    _ratings_csv(tmp_path / "r.csv")
    cfg = _load(
        None,
        tmp_path,
        "data.kind=delimited",
        "data.train=r.csv",
        "data.eval=[r.csv, 'day_*.csv']",
        "data.schema={label: label, categorical: [user]}",
    )
    with pytest.raises(ConfigError) as e:
        runner.build_data(cfg)
    msg = str(e.value)
    assert msg.startswith("data.eval[1]='day_*.csv': the glob matches no file")
    assert "\n" not in msg and "SPARSEJAX_DATA_DIR is not set" in msg


# ---------------------------------------------------------------------------------------
# The Must-reach families, from the shipped configs


def test_csv_split_over_a_headed_and_a_headerless_file(tmp_path, monkeypatch):
    clicks = _avazu(tmp_path)
    monkeypatch.setenv(runner.DATA_DIR_ENV, str(tmp_path))
    cfg = _load(
        "csv_example.yaml",
        tmp_path,
        "data.batch_size=64",
        "model.embedding_dim=4",
        "model.options={cross_layers: 1, hidden: [8], structure: stacked}",
    )
    data = runner.build_data(cfg)
    # every line of both files, the header line of the first only, in file order
    assert (len(data.train_source), len(data.eval_examples), len(data.test_examples)) == (
        240,
        30,
        30,
    )
    labels = [data.train_source.labels, data.eval_examples.labels, data.test_examples.labels]
    np.testing.assert_array_equal(np.concatenate(labels), clicks)
    assert "no malformed lines" in data.report and "skipped" not in data.report
    assert len(data.features) == 22 and data.test_batches
    _train(cfg, data)


def test_movielens_ratings_with_side_tables_and_a_threshold_label(tmp_path, monkeypatch):
    ml = _movielens(tmp_path)
    monkeypatch.setenv(runner.DATA_DIR_ENV, str(tmp_path))
    cfg = _load(
        "movielens_ratings.yaml",
        tmp_path,
        "data.batch_size=64",
        "model.embedding_dim=4",
        "model.options={hidden: [8]}",
    )
    data = runner.build_data(cfg)
    t = ml["time"]
    order = np.argsort(t, kind="stable")
    train_rows = order[t[order] < 888710400]
    assert len(data.train_source) == train_rows.size
    assert len(data.eval_examples) == int(((t >= 888710400) & (t < 891388800)).sum())
    assert data.test_examples is not None and len(data.test_examples) > 0
    # the threshold label: rating >= 4
    np.testing.assert_array_equal(data.train_source.labels, ml["rating"][train_rows] >= 4)
    # the joins attached the side tables' columns: age (dense), gender, occupation, zip,
    # release_date and the genres bag
    names = {f.name for f in data.features}
    assert names == {"user", "item", "gender", "occupation", "zip", "release_date", "genres"}
    assert data.train_source.num_dense == 1
    age = 20 + ml["user"][train_rows] % 40
    known = ml["user"][train_rows] != 7
    np.testing.assert_allclose(data.train_source.dense[:, 0], np.log1p(np.where(known, age, 0)))
    # the genres bag: the item's genre columns that are 1, one id each
    np.testing.assert_array_equal(
        data.train_source.sparse["genres"].lengths, ml["genres"][ml["item"][train_rows]].sum(1)
    )
    spec = {f.name: f for f in data.features}
    assert spec["genres"].combiner == "mean" and spec["genres"].max_ids <= len(GENRES)
    # user 7 is missing from u.user: its rows got the default row, counted
    lost = int((ml["user"] == 7).sum())
    assert f"join u.user: {lost:,} of 400 rows lack a key (default row)" in data.report
    assert {t.name: t.vocab_size for t in data.tables}["zip"] == 1000  # hash_buckets
    _train(cfg, data)


def test_history_shares_the_item_table_and_is_capped(tmp_path):
    """DIN's candidate item and its history read one table; a history longer than its
    `max_ids` keeps its last ids and is counted in the report."""
    rng = np.random.default_rng(4)
    rows = []
    for i in range(200):
        hist = rng.integers(0, 30, rng.integers(0, 9))
        item = int(hist[-1]) if hist.size and i % 2 else int(rng.integers(0, 30))
        rows.append(f"{i % 2},u{i % 11},i{item},{'|'.join(f'i{h}' for h in hist)}")
    (tmp_path / "b.csv").write_text("label,user,item,history\n" + "\n".join(rows) + "\n")
    cfg = _load(
        None,
        tmp_path,
        "data.kind=delimited",
        f"data.train={tmp_path}/b.csv",
        "data.schema={label: label, categorical: [user, item], sequence: [history]}",
        "data.features={history: {table: item, max_ids: 5}, user: {dim: 8}}",
        "data.batch_size=32",
        "model.name=din",
        "model.embedding_dim=4",
        "model.options={hidden: [8], attention_hidden: [4]}",
    )
    data = runner.build_data(cfg)
    assert sorted(t.name for t in data.tables) == ["item", "user"]
    assert {t.name: t.dim for t in data.tables} == {"item": 4, "user": 8}
    spec = {f.name: f for f in data.features}
    assert spec["history"].table == "item" and spec["history"].is_sequence
    assert spec["history"].max_ids == 5
    lengths = [len(r.split(",")[3].split("|")) if r.split(",")[3] else 0 for r in rows]
    long = sum(n > 5 for n in lengths)
    assert long > 0
    assert f"history: {long:,} rows longer than max_ids=5 kept their last 5" in data.report
    # the last ids stay, mapped by the item table's vocabulary
    m = data.mappings["history"]
    assert m is data.mappings["item"]
    k = next(i for i, n in enumerate(lengths) if n > 5)
    last5 = [int(x[1:]) for x in rows[k].split(",")[3].split("|")][-5:]
    got = data.train_source.take([k])[0]["history"].values
    np.testing.assert_array_equal(got, m(np.array([tf_hash(f"i{x}") for x in last5])))
    runner.build_model(cfg, data.tables, data.features)  # DIN takes the mixed dims
    # (a DIN over a shared item table with mixed dims trains in the event-log test)


def tf_hash(text):
    from sparsejax.data import stable_hash

    return stable_hash(text)


# ---------------------------------------------------------------------------------------
# Bad input


def test_side_table_missing_a_key_strict_names_file_key_and_value(tmp_path, monkeypatch):
    _movielens(tmp_path)
    monkeypatch.setenv(runner.DATA_DIR_ENV, str(tmp_path))
    text = (CONFIGS / "movielens_ratings.yaml").read_text()
    assert text.count("on_missing: default") == 1
    strict = tmp_path / "strict.yaml"
    text = text.replace("on_missing: default", "on_missing: error")
    strict.write_text(text.replace("base: base.yaml", f"base: {CONFIGS / 'base.yaml'}"))
    cfg = runner.load_config([strict])
    with pytest.raises(tf.JoinKeyError) as e:
        runner.build_data(cfg)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("data.joins: u.user has no row with user = '7' (")
    assert f"{tmp_path}/ml-100k/u.data:" in msg


def test_side_table_with_a_duplicate_key(tmp_path):
    (tmp_path / "d.csv").write_text("label,user\n1,a\n0,b\n")
    (tmp_path / "u.csv").write_text("user,age\na,3\nb,4\na,5\n")
    cfg = _load(
        None,
        tmp_path,
        "data.kind=delimited",
        f"data.train={tmp_path}/d.csv",
        "data.split={by: rows, train: 1}",
        "data.schema={label: label, categorical: [user]}",
        f"data.joins=[{{path: {tmp_path}/u.csv, key: user, schema: {{dense: [age]}}}}]",
    )
    with pytest.raises(ValueError, match=r"data.joins\[0\] .*u.csv.*on more than one row"):
        runner.build_data(cfg)


def test_unmapped_minus_one_labels_stop_the_read(tmp_path):
    (tmp_path / "l.csv").write_text("y,a\n1,x\n-1,y\n1,z\n-1,w\n")
    base = [
        "data.kind=delimited",
        f"data.train={tmp_path}/l.csv",
        "data.schema={label: y, categorical: [a]}",
        "data.split={by: rows, train: 2}",
    ]
    with pytest.raises(ValueError, match=r"l.csv: .*label -1 is not in \{0, 1\}"):
        runner.build_data(_load(None, tmp_path, *base, "data.label={check: binary}"))
    data = runner.build_data(_load(None, tmp_path, *base, "data.label={map: {-1: 0}}"))
    np.testing.assert_array_equal(data.train_source.labels, [1, 0])


def test_criteo_minus_one_labels_stop_the_read_without_a_label_rule(tmp_path):
    # without data.label a Criteo line labelled -1 must not be dropped as malformed
    # (that trains on the positives alone): the read stops naming file, line and value
    write_criteo_like(tmp_path / "c.tsv", n=20)
    lines = (tmp_path / "c.tsv").read_text().splitlines()
    lines[4] = "-1" + lines[4][1:]
    (tmp_path / "c.tsv").write_text("\n".join(lines) + "\n")
    base = ["data.kind=criteo", f"data.train={tmp_path}/c.tsv", "data.train_rows=10"]
    with pytest.raises(ValueError, match=r"c.tsv: line 5: label -1 is not in \{0, 1\}"):
        runner.build_data(_load(None, tmp_path, *base))
    data = runner.build_data(_load(None, tmp_path, *base, "data.label={map: {-1: 0}}"))
    assert len(data.train_source) == 10 and data.train_source.labels[4] == 0


@pytest.mark.parametrize(
    "override,message",
    [
        ("data.split={by: time, train: 5}", "data.split.by=time needs data.split.column"),
        ("data.split={by: fraction, train: 0.8, eval: 0.2}", "leave no test rows"),
        ("data.split={by: rows, train: 0.5}", "data.split.train must be a row count"),
        ("data.train_rows=5", "data.train_rows and data.split both split"),
        ("data.eval=x.csv", "data.split divides one source, but data.eval names eval files"),
        ("data.path=y.csv", "data.path and data.train both name the training data"),
        (
            "data.features={usr: {dim: 4}}",
            "data.features.usr: 'usr' is not a sparse column; did you mean 'user'?",
        ),
        ("data.features={user: {dims: 4}}", "unknown config key 'data.features.user.dims'"),
        (
            "data.features={user: {dim: 4}, item: {table: user, dim: 8}}",
            "user and item share table 'user' but set dim 4 and 8",
        ),
        (
            "data.schema={label: y, categorical: [user], sequense: [h]}",
            "data.schema: TableSchema: unknown key 'sequense'",
        ),
        (
            "data.joins=[{path: u.csv, key: usr, schema: {dense: [age]}}]",
            "data.joins[0].key='usr' must be a categorical column of the data",
        ),
        (
            "data.joins=[{path: u.csv, key: user, schema: {dense: [item]}}]",
            "data.joins[0]: columns ['item'] are already columns of the data",
        ),
        ("data.label={threshold: 4, chek: none}", "unknown config key 'data.label.chek'"),
        ("data.eval_batches=0", "data.eval_batches must be >= 1"),
        ("data.indicator_bags={genres: []}", "data.indicator_bags.genres: expected a non-empty"),
    ],
)
def test_config_errors_are_one_line_at_load(tmp_path, override, message):
    base = [
        "data.kind=delimited",
        "data.train=never_read.csv",
        "data.schema={label: y, categorical: [user, item]}",
        "data.split={by: fraction, train: 0.8}",
    ]
    with pytest.raises(ConfigError) as e:
        _load(None, tmp_path, *base, override)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_file_options_on_generated_data_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="data.train is for file data"):
        _load(None, tmp_path, "data.train=x.csv")


def test_stacked_models_need_one_dim(tmp_path):
    _ratings_csv(tmp_path / "r.csv")
    cfg = _load(
        None,
        tmp_path,
        "data.kind=delimited",
        f"data.train={tmp_path}/r.csv",
        "data.schema={label: label, categorical: [user], dense: [time]}",
        "data.features={user: {dim: 8}}",
        "model.embedding_dim=4",
    )
    data = runner.build_data(cfg)
    with pytest.raises(ConfigError, match="table 'user' has dim 8"):
        runner.build_model(cfg, data.tables, data.features)


# ---------------------------------------------------------------------------------------
# The transforms alone


def test_transforms_on_chunks_equal_the_whole():
    from sparsejax.data import Examples, JaggedIds

    rng = np.random.default_rng(5)
    n = 50
    lengths = rng.integers(0, 7, n)
    ex = Examples(
        labels=np.zeros(n, np.float32),
        dense=(rng.random((n, 3)) < 0.5).astype(np.float32),
        sparse={
            "k": JaggedIds(np.ones(n, np.int32), rng.integers(-1, 6, n)),
            "h": JaggedIds(lengths, rng.integers(0, 99, lengths.sum())),
        },
    )
    side_rows = Examples(
        labels=np.zeros(4, np.float32),
        dense=np.arange(4, dtype=np.float32)[:, None],
        sparse={"k": JaggedIds(np.ones(4, np.int32), np.array([3, 0, 5, 1]))},
    )
    side = tf.SideTable.build(side_rows, ["v"], "k", source="side.csv")
    make = lambda: tf.ColumnTransform(  # noqa: E731
        ["a", "b", "c"],
        indicator_bags={"bag": ["a", "c"]},
        joins=[tf.Join(side=side)],
        max_ids={"h": 3},
    )
    whole_t, chunk_t = make(), make()
    whole = whole_t(ex)
    chunks = [chunk_t(ex[i : i + 7]) for i in range(0, n, 7)]
    joined = Examples.concat(chunks)
    for name in whole.sparse:
        np.testing.assert_array_equal(joined.sparse[name].values, whole.sparse[name].values)
        np.testing.assert_array_equal(joined.sparse[name].lengths, whole.sparse[name].lengths)
    np.testing.assert_array_equal(joined.dense, whole.dense)
    assert whole_t.report == chunk_t.report and whole_t.out_dense_names == ("b", "v")
    k = ex.sparse["k"].values
    expect = np.select([k == 3, k == 0, k == 5, k == 1], [0, 1, 2, 3], 0)
    np.testing.assert_array_equal(whole.dense[:, 1], expect)
    assert whole_t.report.missing_keys["side.csv"] == int((~np.isin(k, [3, 0, 5, 1])).sum())
    assert whole_t.report.truncated["h"] == [
        int((lengths > 3).sum()),
        int(np.maximum(lengths - 3, 0).sum()),
    ]
    np.testing.assert_array_equal(whole.sparse["h"].lengths, np.minimum(lengths, 3))


def test_the_data_guide_config_loads_and_reads(tmp_path, monkeypatch):
    guide = (CONFIGS.parent / "docs" / "data.md").read_text()
    section = guide[guide.index("## Many files, bags and sequences") :]
    text = section[section.index("```yaml\n") + 8 : section.index("```\n", 20)]
    assert "base:" not in text  # a relative base works only beside it, in configs/
    (tmp_path / "my_clicks.yaml").write_text(text)
    rng = np.random.default_rng(6)
    lines = [
        f"{int(rng.random() < 0.3)},u{i % 9},i{i % 13},s{i % 5},a|b,"
        + "|".join(f"i{x}" for x in rng.integers(0, 13, rng.integers(0, 60)))
        + f",{i / 10}"
        for i in range(100)
    ]
    (tmp_path / "clicks").mkdir()
    header = "click,user,item,site,tags,history,price\n"
    (tmp_path / "clicks" / "part1.csv").write_text(header + "\n".join(lines[:60]) + "\n")
    (tmp_path / "clicks" / "part2.csv").write_text("\n".join(lines[60:]) + "\n")
    monkeypatch.setenv(runner.DATA_DIR_ENV, str(tmp_path))
    # as the guide runs it: the shipped defaults first, the config from anywhere
    cfg = runner.load_config([CONFIGS / "base.yaml", tmp_path / "my_clicks.yaml"])
    base = runner.load_config([CONFIGS / "base.yaml"])
    assert cfg.optimizer == base.optimizer and cfg.name == "my_clicks"
    data = runner.build_data(cfg)
    assert (len(data.train_source), len(data.eval_examples), len(data.test_examples)) == (
        80,
        10,
        10,
    )
    spec = {f.name: f for f in data.features}
    assert spec["history"].table == "item" and spec["history"].max_ids == 50
    assert {t.name: t.vocab_size for t in data.tables}["site"] == 100_000
    runner.build_model(cfg, data.tables, data.features)


def test_event_log_as_a_sequence_model(tmp_path, monkeypatch):
    """kind=events: the shipped config on a small log of u.data's shape; eval and test
    are candidate sets (held-out item + 100 negatives) whose rows evaluate as binary
    examples, the history reads the item table."""
    ml = _movielens(tmp_path, n=600, users=20, items=150)
    monkeypatch.setenv(runner.DATA_DIR_ENV, str(tmp_path))
    cfg = _load(
        "movielens_sequences.yaml",
        tmp_path,
        "data.batch_size=64",
        "data.events.history_length=8",
        "data.features={user: {dim: 8}}",
        "model.embedding_dim=4",
        "model.options={hidden: [8], attention_hidden: [4]}",
    )
    data = runner.build_data(cfg)
    assert {t.name: t.dim for t in data.tables} == {"item": 4, "user": 8}
    spec = {f.name: f for f in data.features}
    assert spec["history"].table == "item" and spec["history"].max_ids == 8
    sets = data.ranking["test"]
    assert sets.num_users == len(set(ml["user"].tolist())) and sets.num_candidates == 101
    assert len(data.test_examples) == sets.num_rows
    assert data.test_examples.labels.sum() == sets.num_users  # one held-out item each
    # train: each positive then its 4 negatives
    assert len(data.train_source) == 5 * (600 - 2 * sets.num_users)
    trainer, state = _train(cfg, data)
    # the paper's protocol: the held-out item ranked among its 100 sampled negatives
    m = evaluate_ranking(trainer, state, sets, data.packer, ks=(10,))
    assert 0 <= m["hr@10"] <= 1 and 0 <= m["ndcg@10"] <= m["hr@10"] and m["candidates"] == 101
    # the evals during training add the eval split's ranking metrics (early stopping on them)
    run = types.SimpleNamespace(
        cfg=dataclasses.replace(cfg, eval_ks=(5, 10)), data=data, trainer=trainer
    )
    during = runner._run.run_evaluator(run)(state)
    ranked = evaluate_ranking(trainer, state, data.ranking["eval"], data.packer, ks=(5, 10))
    assert during["auc"] == trainer.evaluate(state, data.eval_batches)["auc"]  # binary kept
    for k in ("hr@5", "hr@10", "ndcg@5", "ndcg@10", "mrr", "gauc"):
        assert during[k] == ranked[k]
    # early stopping may watch them; a cut-off not in eval_ks is refused with the fix
    run.state = state
    run.cfg = dataclasses.replace(
        run.cfg,
        early_stopping=runner._schema.EarlyStoppingConfig(metric="ndcg@20", keep_best=False),
    )
    with pytest.raises(
        ConfigError, match=r"'ndcg@20' .*add 20 to eval_ks \(eval_ks=\[5, 10, 20\]\)"
    ):
        runner._knobs.run_knobs(run, log=lambda m: None)


def _frappe(root: pathlib.Path, sizes=(240, 60, 60)):
    """libFM files of Frappe's shape (the NFM/AFM papers' CTR data): `-1`/`1` labels and
    ten `idx:1` features per line, one from each field's index range."""
    rng = np.random.default_rng(7)
    starts = np.cumsum([0, 30, 50, 3, 4, 7, 2, 3, 2, 9, 20])
    (root / "frappe").mkdir(parents=True)
    labels = {}
    for name, n in zip(("train", "validation", "test"), sizes, strict=True):
        idx = starts[:-1] + rng.integers(0, np.diff(starts), (n, 10))
        y = np.where((idx[:, 1] - starts[1]) % 2 == 0, 1, -1)
        (root / "frappe" / f"frappe.{name}.libfm").write_text(
            "".join(
                f"{a} " + " ".join(f"{i}:1" for i in row) + "\n"
                for a, row in zip(y, idx, strict=True)
            )
        )
        labels[name] = y
    return labels


def test_libfm_file_with_minus_one_labels(tmp_path, monkeypatch):
    labels = _frappe(tmp_path)
    monkeypatch.setenv(runner.DATA_DIR_ENV, str(tmp_path))
    cfg = _load(
        "libfm_example.yaml",
        tmp_path,
        "data.batch_size=64",
        "model.embedding_dim=4",
        "model.options={hidden: [8]}",
    )
    data = runner.build_data(cfg)
    # -1 -> 0, 1 stays: labels in {0, 1}, in file order
    np.testing.assert_array_equal(data.train_source.labels, labels["train"] == 1)
    np.testing.assert_array_equal(data.test_examples.labels, labels["test"] == 1)
    (feature,) = data.features  # one weighted bag of the ten indices, summed
    assert feature.name == "features" and feature.weighted and feature.combiner == "sum"
    assert feature.max_ids == 10 and np.all(data.train_source.sparse["features"].lengths == 10)
    _train(cfg, data)
    # without the label map the -1 labels stop the read, naming file, line and value
    bad = _load("libfm_example.yaml", tmp_path, "data.label=null")
    with pytest.raises(ValueError) as e:
        runner.build_data(bad)
    first = int(np.argmax(labels["train"] == -1)) + 1
    assert f"frappe.train.libfm: line {first}: label -1 is not in {{0, 1}}" in str(e.value)


def test_streamed_train_files_give_the_batches_of_the_in_memory_read(tmp_path):
    rng = np.random.default_rng(8)
    for name, n in (("train", 150), ("eval", 40)):
        rows = [
            f"{int(rng.random() < 0.4)},u{rng.integers(0, 20)},"
            + "|".join(f"t{x}" for x in rng.integers(0, 9, rng.integers(0, 6)))
            + f",{rng.random():.3f}"
            for _ in range(n)
        ]
        (tmp_path / f"{name}.csv").write_text("y,user,tags,x\n" + "\n".join(rows) + "\n")
    common = [
        "data.kind=delimited",
        f"data.train={tmp_path}/train.csv",
        f"data.eval={tmp_path}/eval.csv",
        "data.schema={label: y, categorical: [user], multi_hot: [tags], dense: [x]}",
        "data.id_mapping=hash",
        "data.hash_buckets=50",
        "data.features={tags: {max_ids: 3}}",
        "data.batch_size=32",
    ]
    memory = runner.build_data(_load(None, tmp_path, *common))
    stream = runner.build_data(_load(None, tmp_path, *common, "data.stream=true"))
    assert stream.tables == memory.tables and stream.features == memory.features
    assert isinstance(stream.train_source, sd.FileSource) and stream.steps_per_epoch is None
    with sd.Loader(stream.train_source, stream.packer, shuffle=False, epochs=1) as loader:
        streamed = list(loader)
    expect = sd.pack_examples(memory.train_source, memory.packer)
    assert len(streamed) == len(expect) == 5
    for a, b in zip(streamed, expect, strict=True):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # the cap on the streamed rows is counted as they are read
    assert stream.transform.report.truncated["tags"] == memory.transform.report.truncated["tags"]
    for bad, msg in (
        ("data.id_mapping=vocab", "data.stream needs data.id_mapping: hash"),
        ("data.eval=null", "data.stream needs data.eval files"),
    ):
        with pytest.raises(ConfigError, match=msg):
            _load(None, tmp_path, *common, "data.stream=true", bad)


def test_parquet_split_by_time(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    n = 120
    pq.write_table(
        pa.table(
            {
                "y": (np.arange(n) % 3 == 0).astype(np.int64),
                "user": [f"u{i % 7}" for i in range(n)],
                "ts": 1_600_000_000 + 3600 * np.arange(n),
            }
        ),
        tmp_path / "log.parquet",
    )
    cfg = _load(
        None,
        tmp_path,
        "data.kind=parquet",
        f"data.train={tmp_path}/log.parquet",
        "data.schema={label: y, categorical: [user]}",
        "data.split={by: time, column: ts, train: 1600288000, eval: 1600360000}",
    )
    data = runner.build_data(cfg)
    assert (len(data.train_source), len(data.eval_examples), len(data.test_examples)) == (
        80,
        20,
        20,
    )
    assert data.train_source.num_dense == 0  # ts was read only to split


def _avazu_eval_config(tmp_path, *overrides):
    return _load(
        "csv_example.yaml",
        tmp_path,
        "data.train=avazu/train_part1.csv",
        "data.eval=avazu/train_part2.csv",
        "data.split=null",
        *overrides,
    )


def test_a_headerless_eval_file_takes_the_train_files_header(tmp_path, monkeypatch):
    """Train files with a header, an eval file without: the eval file's columns are the
    train header's, by default (its line 1 is data: it does not look like a header) and
    with `data.eval_header: false`; with `true` its line 1 would be taken as a header."""
    clicks = _avazu(tmp_path)
    monkeypatch.setenv(runner.DATA_DIR_ENV, str(tmp_path))
    for extra in ([], ["data.eval_header=false"]):
        data = runner.build_data(_avazu_eval_config(tmp_path, *extra))
        assert (len(data.train_source), len(data.eval_examples)) == (150, 150)
        np.testing.assert_array_equal(data.eval_examples.labels, clicks[150:])
        assert "skipped" not in data.report
    with pytest.raises(ConfigError) as e:
        runner.build_data(_avazu_eval_config(tmp_path, "data.eval_header=true"))
    msg = str(e.value)
    assert msg.startswith("data.eval: ") and "train_part2.csv" in msg and "\n" not in msg
    assert "column 'hour' is not in the file's columns" in msg
    assert "data.eval_header=false reads it as data" in msg


def test_eval_and_test_files_with_and_without_a_header_beside_headerless_train_files(
    tmp_path, monkeypatch
):
    """Header-less train files (`schema.columns`), a headed eval file (`eval_header:
    true`: its line 1 is skipped, not a malformed row) and a header-less test file."""
    clicks = _avazu(tmp_path)
    monkeypatch.setenv(runner.DATA_DIR_ENV, str(tmp_path))
    rows = (tmp_path / "avazu" / "train_part2.csv").read_text().splitlines()
    (tmp_path / "avazu" / "t.csv").write_text("\n".join(rows[:100]) + "\n")
    (tmp_path / "avazu" / "e.csv").write_text(",".join(AVAZU_COLS) + "\n" + "\n".join(rows[100:]))
    cfg = _avazu_eval_config(
        tmp_path,
        "data.train=avazu/t.csv",
        "data.eval=avazu/e.csv",
        "data.test=avazu/t.csv",
        "data.eval_header=true",
        "data.schema.header=false",
        f"data.schema.columns={AVAZU_COLS}",
    )
    data = runner.build_data(cfg)
    assert (len(data.train_source), len(data.eval_examples), len(data.test_examples)) == (
        100,
        50,
        100,
    )
    np.testing.assert_array_equal(data.eval_examples.labels, clicks[250:])
    assert "skipped" not in data.report
    unset = runner.build_data(
        dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, eval_header=None))
    )
    assert len(unset.eval_examples) == 50 and "skipped 1" in unset.report  # its header line


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["data.kind=criteo", "data.schema=null"], "data.eval_header is for data.kind='delimited'"),
        (["data.eval=null"], "data.eval_header needs data.eval files"),
    ],
)
def test_eval_header_where_it_does_not_apply(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        _avazu_eval_config(tmp_path, "data.eval_header=false", *overrides)


def test_dlrm_without_dense_columns_says_it_ignores_bottom(tmp_path):
    """A config that sets DLRM's `bottom` on data without dense columns: one warning
    line in the log; unset, no warning (the default is unused silently)."""
    _ratings_csv(tmp_path / "r.csv")
    overrides = [
        "data.kind=delimited",
        f"data.train={tmp_path}/r.csv",
        "data.schema={label: label, categorical: [user, time]}",
        "data.batch_size=16",
        "model.embedding_dim=4",
    ]
    said = {}
    for name, extra in (("set", ["model.options={bottom: [8, 4]}"]), ("unset", [])):
        lines = []
        runner.build_run(
            _load(None, tmp_path, *overrides, *extra, f"name={name}"), log=lines.append
        )
        said[name] = [ln for ln in lines if ln.startswith("warning: ")]
    assert said["unset"] == [] and len(said["set"]) == 1
    assert said["set"][0].startswith(
        "warning: model.options.bottom=[8, 4] is ignored: the data has no dense columns"
    )
