"""Sequence examples from an event log: histories against a per-user Python reference,
both splits, no leakage, negatives, reproducibility, the CSV reader and its errors, and
that the examples fit DIN and the two-tower model as they are."""

import gzip
import inspect
import re

import jax
import numpy as np
import pytest

from sparsejax import data as sd
from sparsejax import nn as snn
from sparsejax.data import EventLog, EventLogError, SequenceConfig, build_sequences


def _random_log(seed=0, n_users=40, n_items=30, n_events=400, time_range=50):
    rng = np.random.default_rng(seed)
    user = rng.integers(0, n_users, n_events) * 10 + 5  # raw ids that are not rows
    item = rng.integers(0, n_items, n_events) + 100
    time = rng.integers(0, time_range, n_events)  # many ties: order by log position
    return EventLog(user=user, item=item, time=time)


def _per_user(log):
    """{raw user: [(time, log position, raw item)] in event order} (the reference)."""
    out = {}
    for k in range(len(log)):
        out.setdefault(log.user[k], []).append((log.time[k], k, log.item[k]))
    return {u: sorted(v) for u, v in out.items()}


def _rows(data, ex):
    """(raw user, raw item, raw history tuple, label) of each example."""
    sparse, labels, _ = ex.take(np.arange(len(ex)))
    hist = np.split(sparse["history"].values, np.cumsum(sparse["history"].lengths)[:-1])
    return [
        (
            data.user_ids[u],
            data.item_ids[i],
            tuple(data.item_ids[h]),
            float(y),
        )
        for u, i, h, y in zip(
            sparse["user"].values, sparse["item"].values, hist, labels, strict=True
        )
    ]


def _held(data, sets):
    """(raw user, raw held-out item, raw history) of each candidate set."""
    hist = np.split(sets.history.values, np.cumsum(sets.history.lengths)[:-1])
    return sorted(
        (data.user_ids[u], data.item_ids[i], tuple(data.item_ids[h]))
        for u, i, h in zip(sets.users, sets.positives, hist, strict=True)
    )


def test_leave_last_out_matches_a_per_user_reference():
    log = _random_log()
    n_hist = 4
    data = build_sequences(
        log, SequenceConfig(history_length=n_hist, negatives=2, eval_negatives=20)
    )
    want_train, want_valid, want_test, dropped = [], [], [], 0
    for u, events in _per_user(log).items():
        if len(events) < 3:
            dropped += 1
            continue
        items = [e[2] for e in events]
        for j in range(len(items) - 2):
            want_train.append((u, items[j], tuple(items[max(0, j - n_hist) : j])))
        want_valid.append((u, items[-2], tuple(items[-n_hist - 2 : -2])))
        want_test.append((u, items[-1], tuple(items[-n_hist - 1 : -1])))
    rows = _rows(data, data.train)
    assert sorted(r[:3] for r in rows if r[3] == 1.0) == sorted(want_train)
    assert _held(data, data.valid) == sorted(want_valid)
    assert _held(data, data.test) == sorted(want_test)
    # each positive is followed by its 2 negatives, same user and history
    assert [r[3] for r in rows] == [1.0, 0.0, 0.0] * len(want_train)
    for k in range(0, len(rows), 3):
        assert rows[k][0] == rows[k + 1][0] == rows[k + 2][0]
        assert rows[k][2] == rows[k + 1][2] == rows[k + 2][2]
    rep = data.report
    assert rep.users_dropped == dropped and rep.train_positives == len(want_train)
    assert rep.users == len(want_test) == data.test.num_users
    assert data.test.num_candidates == 21  # 1 + eval_negatives


def test_leave_last_out_protocol_on_a_tiny_log():
    """SASRec's protocol, exactly: train targets are items[:n-2], each with the items
    before it; the validation target items[n-2] with items[:n-2]; the test target
    items[n-1] with items[:n-1], the validation item included. Neither held-out item is a
    train target or in a train history; the evaluation negatives avoid all the user's
    items, the train negatives only its train items (they know nothing held out)."""
    events = [("a", 10), ("a", 11), ("a", 12), ("a", 13), ("a", 14), ("b", 20), ("b", 21)]
    events += [("b", 22)] + [("c", x) for x in range(30, 40)]
    order = np.random.default_rng(0).permutation(len(events))  # the times give the order
    user = [events[k][0] for k in order]
    item = [events[k][1] for k in order]
    log = EventLog(user=user, item=item, time=order.astype(float))
    data = build_sequences(log, SequenceConfig(history_length=3, negatives=5, eval_negatives=8))
    pos = [r[:3] for r in _rows(data, data.train) if r[3] == 1.0]
    assert sorted(pos) == sorted(
        [("a", 10, ()), ("a", 11, (10,)), ("a", 12, (10, 11)), ("b", 20, ())]
        + [("c", 30 + j, tuple(range(max(30, 27 + j), 30 + j))) for j in range(8)]
    )
    assert _held(data, data.valid)[:2] == [("a", 13, (10, 11, 12)), ("b", 21, (20,))]
    assert _held(data, data.test)[:2] == [("a", 14, (11, 12, 13)), ("b", 22, (20, 21))]
    seen = np.split(data.test.seen.values, np.cumsum(data.test.seen.lengths)[:-1])
    a = list(data.user_ids[data.test.users]).index("a")
    assert list(data.item_ids[seen[a]]) == [10, 11, 12, 13]  # all before the test event
    mine = {u: {i for v, i in events if v == u} for u in "abc"}
    for sets in (data.valid, data.test):
        for u, cands in zip(data.user_ids[sets.users], data.item_ids[sets.items], strict=True):
            assert not set(cands[1:]) & mine[u]
    train_items = {u: {i for v, i, _ in pos if v == u} for u in "abc"}
    for u, i, _, y in _rows(data, data.train):
        assert y == 1.0 or i not in train_items[u]


def test_time_split_matches_a_per_user_reference():
    log = _random_log(seed=1)
    cfg = SequenceConfig(
        split="time",
        valid_time=30,
        test_time=40,
        min_user_events=1,
        history_length=3,
        eval_negatives=20,
    )
    data = build_sequences(log, cfg)
    want_train, want_valid, want_test = [], [], []
    for u, events in _per_user(log).items():
        items = [e[2] for e in events]
        times = [e[0] for e in events]
        for j, t in enumerate(times):
            if t < 30:
                want_train.append((u, items[j], tuple(items[max(0, j - 3) : j])))
        for lo, hi, out in ((30, 40, want_valid), (40, np.inf, want_test)):
            inside = [j for j, t in enumerate(times) if lo <= t < hi]
            if inside:
                j = inside[0]
                out.append((u, items[j], tuple(items[max(0, j - 3) : j])))
    assert sorted(r[:3] for r in _rows(data, data.train) if r[3] == 1.0) == sorted(want_train)
    assert _held(data, data.valid) == sorted(want_valid)
    assert _held(data, data.test) == sorted(want_test)
    # dates work as split times too
    dated = EventLog(
        user=log.user, item=log.item, time=log.time * 86400.0 + 1.7e9
    )  # 2023-11-14 + days
    cfg_dates = SequenceConfig(
        split="time", test_time="2023-12-24", min_user_events=1, eval_negatives=5
    )
    assert build_sequences(dated, cfg_dates).test.num_users > 0


def test_no_leakage_into_train_histories():
    # every event a distinct item, so an item identifies its event
    rng = np.random.default_rng(3)
    n = 500
    log = EventLog(
        user=rng.integers(0, 30, n), item=rng.permutation(n), time=rng.integers(0, 100, n)
    )
    for cfg in (
        SequenceConfig(history_length=50),
        SequenceConfig(split="time", valid_time=60, test_time=80, min_user_events=1),
    ):
        data = build_sequences(log, cfg)
        held = set(data.item_ids[data.test.positives]) | set(data.item_ids[data.valid.positives])
        time_of = dict(zip(log.item, log.time, strict=True))
        for _user, item, hist, label in _rows(data, data.train):
            if label:
                assert not held & set(hist)
                assert all(time_of[h] <= time_of[item] for h in hist)
        for sets in (data.valid, data.test):
            seen = np.split(sets.seen.values, np.cumsum(sets.seen.lengths)[:-1])
            for t, pos, s in zip(sets.times, sets.positives, seen, strict=True):
                assert pos not in s
                assert all(time_of[data.item_ids[i]] <= t for i in s)


def test_negatives_avoid_the_positive_and_seen_items():
    log = _random_log(seed=2, n_items=60)
    for sampler in ("uniform", "popularity"):
        data = build_sequences(
            log,
            SequenceConfig(negatives=3, eval_negatives=20, sampler=sampler, eval_sampler=sampler),
        )
        rows = _rows(data, data.train)
        train_items = {}
        for u, i, _, y in rows:
            if y:
                train_items.setdefault(u, set()).add(i)
        for k in range(0, len(rows), 4):
            pos = rows[k][1]
            for r in rows[k + 1 : k + 4]:
                assert r[1] != pos and r[1] not in train_items[r[0]]
        if sampler == "popularity":  # never an item without a train positive
            neg_items = {r[1] for r in rows if not r[3]}
            assert neg_items <= {i for s in train_items.values() for i in s}
        all_items = {u: {e[2] for e in ev} for u, ev in _per_user(log).items()}
        for sets in (data.valid, data.test):
            assert (sets.items[:, 1:] != sets.items[:, :1]).all()
            for u, cands in zip(sets.users, sets.items, strict=True):
                assert len(set(cands)) == len(cands)  # distinct
                assert not set(data.item_ids[cands[1:]]) & all_items[data.user_ids[u]]
        assert data.report.negatives_relaxed == 0


def test_a_user_who_saw_every_item_still_gets_negatives():
    # 3 items, 4 eval negatives impossible; 2 allowed: user 0 saw all 3 items
    log = EventLog(user=[0, 0, 0, 1, 1, 1], item=[0, 1, 2, 0, 0, 1], time=[1, 2, 3, 1, 2, 3])
    with pytest.raises(EventLogError, match="eval_negatives=4 needs at least 5 items"):
        build_sequences(log, SequenceConfig(eval_negatives=4))
    data = build_sequences(log, SequenceConfig(negatives=2, eval_negatives=2))
    assert data.report.negatives_relaxed > 0
    for sets in (data.valid, data.test):
        assert (sets.items[:, 1:] != sets.items[:, :1]).all()


def test_reproducible_by_seed():
    log = _random_log(seed=4)
    a, b = (
        build_sequences(log, SequenceConfig(negatives=2, seed=7, eval_negatives=5))
        for _ in range(2)
    )
    c = build_sequences(log, SequenceConfig(negatives=2, seed=8, eval_negatives=5))
    for name in ("user", "item", "history"):
        np.testing.assert_array_equal(a.train.sparse[name].values, b.train.sparse[name].values)
    np.testing.assert_array_equal(a.test.items, b.test.items)
    assert not np.array_equal(a.train.sparse["item"].values, c.train.sparse["item"].values)
    np.testing.assert_array_equal(a.test.items[:, 0], c.test.items[:, 0])  # same positives
    # more eval negatives do not change the train negatives
    d = build_sequences(log, SequenceConfig(negatives=2, seed=7, eval_negatives=10))
    np.testing.assert_array_equal(a.train.sparse["item"].values, d.train.sparse["item"].values)


def test_users_with_too_few_events_are_dropped_and_counted():
    log = EventLog(
        user=["a", "b", "b", "c", "c", "c", "c"],
        item=[1, 1, 2, 1, 2, 3, 4],
        time=[0, 0, 1, 0, 1, 2, 3],
    )
    data = build_sequences(log, SequenceConfig(eval_negatives=1))
    assert list(data.user_ids) == ["c"]
    rep = data.report
    assert (rep.users_dropped, rep.events_dropped, rep.train_positives) == (2, 3, 2)
    assert "3 events of 2 users dropped because those users have fewer than 3" in str(rep)
    with pytest.raises(EventLogError, match="min_user_events must be >= 3"):
        SequenceConfig(min_user_events=1)
    with pytest.raises(
        EventLogError,
        match=r"no events left \(7 read, 0 below min_rating, 7 events of 3 users with fewer "
        r"than 5 events\)",
    ):
        build_sequences(log, SequenceConfig(min_user_events=5))


def test_the_report_says_what_each_count_counts():
    # a: 1 event, b: 2, e: 1 left after min_rating (users dropped); c: 4, d: 3 left (kept)
    rows = [("a", 6, 5), ("b", 7, 5), ("b", 8, 5), ("e", 9, 5), ("e", 10, 1), ("e", 11, 1)]
    rows += [("c", 1, 5), ("c", 2, 5), ("c", 3, 5), ("c", 4, 5)]
    rows += [("d", 1, 5), ("d", 5, 1), ("d", 2, 5), ("d", 3, 5)]
    user, item, rating = zip(*rows, strict=True)
    log = EventLog(user=user, item=item, rating=rating)
    cfg = SequenceConfig(
        rating="rating", min_rating=4, history_length=1, negatives=1, eval_negatives=0
    )
    rep = build_sequences(log, cfg).report
    fields = (rep.events, rep.rating_filtered, rep.events_dropped, rep.users_dropped)
    assert fields == (14, 3, 4, 3)
    assert (rep.users, rep.items, rep.train_positives, rep.train_rows) == (2, 4, 3, 6)
    assert (rep.valid_users, rep.test_users, rep.histories_truncated) == (2, 2, 3)
    assert (rep.empty_histories, rep.negatives_relaxed) == (0, 0)
    assert str(rep) == (
        "events: 14 read; 3 events dropped because their rating is below min_rating; "
        "4 events of 3 users dropped because those users have fewer than 3 events "
        "(min_user_events); kept 7 events of 2 users, 4 items; train 3 positive events "
        "(6 rows with their negatives); valid 2 users, test 2 users (one held-out event "
        "each); 3 of 7 histories truncated to the last 1 items (history_length); "
        "0 held-out events without history; 0 rows of negatives that could not avoid "
        "seen items or repeats"
    )


def test_config_from_dict_names_unknown_keys():
    cfg = SequenceConfig.from_dict({"history_length": 7, "sampler": "popularity"})
    assert cfg.history_length == 7 and cfg.sampler == "popularity"
    with pytest.raises(EventLogError, match="unknown key 'negative'; did you mean 'negatives'"):
        SequenceConfig.from_dict({"negative": 4})
    with pytest.raises(EventLogError, match="split='time' needs test_time"):
        SequenceConfig(split="time")
    with pytest.raises(EventLogError, match="sampler must be one of"):
        SequenceConfig(sampler="zipf")
    with pytest.raises(EventLogError, match="valid_time .* must be before"):
        SequenceConfig(split="time", valid_time="2024-02-01", test_time="2024-01-01")
    source = inspect.getsource(SequenceConfig)
    for field in SequenceConfig.__dataclass_fields__:  # every field has a docstring
        assert re.search(rf'\n    {field}: [^\n]*\n    """', source), field


def test_read_csv_log_with_ratings_and_a_headerless_continuation(tmp_path):
    head = tmp_path / "events-0.csv"
    head.write_text(
        "user,item,rating,time\n"
        "u1,apple,5,2024-01-01\n"
        "u1,pear,2,2024-01-02\n"
        "u1,plum,4,2024-01-03\n"
        "u2,apple,4,2024-01-01\n"
        "\n"
        "u2,pear,5,2024-01-05,extra\n"
    )
    tail = tmp_path / "events-1.csv.gz"
    with gzip.open(tail, "wt") as f:
        f.write(
            "u2,plum,4,2024-01-06\nu2,fig,5,2024-01-07\nu1,fig,5,bad-date\nu1,kiwi,4,2024-01-04\nu2,,4,2024-01-08\n"
        )
    cfg = SequenceConfig(rating="rating", min_rating=4, eval_negatives=1)
    log, report = sd.read_events([head, tail], cfg)
    assert len(log) == 7 and report.lines_read == 10 and report.lines_kept == 7
    assert report.errors == {"field_count": 1, "bad_time": 1, "empty_item": 1}
    assert log.time[0] == np.datetime64("2024-01-01", "s").astype(np.int64)
    data, _ = sd.load_sequences([head, tail], cfg)
    assert data.report.rating_filtered == 1  # u1's pear
    assert sorted(data.user_ids) == ["u1", "u2"]
    test = sorted(
        zip(data.user_ids[data.test.users], data.item_ids[data.test.positives], strict=True)
    )
    assert test == [("u1", "kiwi"), ("u2", "fig")]
    with pytest.raises(EventLogError, match=r"events-0.csv:7: 5 fields, expected 4"):
        sd.read_events([head, tail], cfg, strict=True)
    headless = SequenceConfig(header=False, columns=("user", "item", "rating", "time"))
    with pytest.raises(EventLogError, match=r"events-1.csv.gz:5: empty 'item'"):
        sd.read_events(tail, headless, strict=True)
    (tmp_path / "dates.csv").write_text("u1,fig,5,2024-01-01T00:00:00Z\nu1,fig,5,bad-date\n")
    with pytest.raises(EventLogError, match=r"dates.csv:2: column 'time'.*'bad-date'"):
        sd.read_events(tmp_path / "dates.csv", headless, strict=True)
    utc, _ = sd.read_events(tmp_path / "dates.csv", headless)  # "Z": UTC, no warning
    assert list(utc.time) == [np.datetime64("2024-01-01", "s").astype(np.int64)]


def test_missing_column_names_the_file_and_the_column(tmp_path):
    path = tmp_path / "log.tsv"
    path.write_text("user\titem\ttimestamp\n1\t2\t3\n")
    with pytest.raises(
        EventLogError,
        match=r"log.tsv: .*no column 'time' \(data.events.time\).*"
        r"did you mean 'timestamp'",
    ):
        sd.read_events(path, SequenceConfig(delimiter="\t"))
    log, _ = sd.read_events(path, SequenceConfig(delimiter="\t", time="timestamp"))
    assert log.user.dtype == np.int64 and list(log.item) == [2]
    with pytest.raises(EventLogError, match="no such event log file"):
        sd.read_events(tmp_path / "nope.csv")


def test_reader_takes_crlf_blank_lines_a_non_ascii_delimiter_and_long_ids(tmp_path):
    path = tmp_path / "log.csv"
    path.write_bytes("user¦item¦time\r\n7¦+3¦5\r\n\r\n99999999999999999999¦4¦6\r\n".encode())
    log, report = sd.read_events(path, SequenceConfig(delimiter="¦"))
    assert report.lines_read == 2 and report.lines_kept == 2
    assert list(log.user) == ["7", "99999999999999999999"]  # too long for int64: strings
    assert log.item.dtype == np.int64 and list(log.item) == [3, 4]  # as int("+3")
    assert list(log.time) == [5.0, 6.0]


def test_examples_fit_din_and_two_tower():
    data = build_sequences(_random_log(seed=5), SequenceConfig(history_length=5, eval_negatives=20))
    tables, features = data.specs(dim=8)
    by_name = {f.name: f for f in features}
    assert by_name["item"].table == by_name["history"].table == "item"  # one table
    assert by_name["history"].is_sequence and by_name["history"].max_ids == 5
    packer = sd.BatchPacker(tables, features, batch_size=32)
    batch = packer.pack(*data.train.take(np.arange(32))[:1], labels=data.train.labels[:32])
    sparse, labels, _ = data.test.rows(0, 32)
    eval_batch = packer.pack(sparse, labels=labels)
    for model in (
        snn.DIN(tables=tables, features=features),
        snn.TwoTower(
            tables=tables,
            features=features,
            user_features=("user", "history"),
            item_features=("item",),
        ),
    ):
        variables = jax.eval_shape(lambda m=model: m.init(jax.random.key(0), batch))
        out = jax.eval_shape(lambda v, m=model: m.apply(v, eval_batch), variables)
        assert out.shape in ((32,), (32, 32))
    # the candidate rows: user-major, label 1 on each set's first row
    assert list(labels[:22]) == [1.0] + [0.0] * 20 + [1.0]


def test_synthetic_log_round_trips_through_csv(tmp_path):
    log = sd.synthetic_events(num_users=50, num_items=60, num_categories=6, seed=3)
    assert len(log) >= 50 * 10 and (log.item % 6 < 6).all()
    back, report = sd.read_events(log.write_csv(tmp_path / "events.csv.gz"))
    assert report.lines_kept == len(log)
    for name in ("user", "item", "time"):
        np.testing.assert_array_equal(getattr(back, name), getattr(log, name))
    again = sd.synthetic_events(num_users=50, num_items=60, num_categories=6, seed=3)
    np.testing.assert_array_equal(again.item, log.item)
    data = build_sequences(back, SequenceConfig(eval_negatives=20))
    assert data.test.num_users == 50


def _sasrec_file(path, sep=" "):
    """A SASRec-style log: `user item` per line, no header, each user's events in order;
    users interleaved and item ids not in event order, so only the file order is right."""
    events = [(1, 30), (2, 7), (1, 10), (1, 20), (2, 9), (2, 8), (1, 40), (2, 6), (1, 5)]
    path.write_text("".join(f"{u}{sep}{i}\n" for u, i in events))
    by_user = {}
    for u, i in events:
        by_user.setdefault(u, []).append(i)
    return by_user


@pytest.mark.parametrize("sep", [" ", "\t"])
def test_a_log_without_a_time_column_keeps_the_file_order(tmp_path, sep):
    by_user = _sasrec_file(tmp_path / "seq.txt", sep)
    cfg = SequenceConfig(
        header=False, columns=("user", "item"), delimiter=sep, time=None, eval_negatives=2
    )
    data, _ = sd.load_sequences(tmp_path / "seq.txt", cfg)
    want = {u: (items[-1], tuple(items[:-1])) for u, items in by_user.items()}
    assert {u: (i, h) for u, i, h in _held(data, data.test)} == want
    # the API: an EventLog without times is in its order (time = position in the log)
    log = EventLog(user=[1, 2, 1, 2, 1, 2], item=[9, 3, 2, 1, 7, 8])
    assert list(log.time) == [0, 1, 2, 3, 4, 5]
    data = build_sequences(log, SequenceConfig(time=None, eval_negatives=1))
    assert _held(data, data.test) == [(1, 7, (9, 2)), (2, 8, (3, 1))]
    # a time split needs times
    with pytest.raises(EventLogError, match="split='time' needs a time column"):
        SequenceConfig(time=None, split="time", test_time=5)


def test_a_log_without_a_time_column_from_a_run_config(tmp_path, monkeypatch):
    from sparsejax import runner

    by_user = _sasrec_file(tmp_path / "seq.txt")
    monkeypatch.setenv(runner.DATA_DIR_ENV, str(tmp_path))
    (tmp_path / "run.yaml").write_text(
        "data:\n  kind: events\n  train: seq.txt\n  events:\n"
        "    delimiter: ' '\n    header: false\n    columns: [user, item]\n"
        "    time: null\n    eval_negatives: 2\n"
    )
    cfg = runner.load_config([tmp_path / "run.yaml"], [f"out_dir={tmp_path / 'runs'}"])
    assert cfg.data.events.time is None
    data = runner.build_data(cfg)
    seq = data.sequences
    want = {u: (items[-1], tuple(items[:-1])) for u, items in by_user.items()}
    assert {u: (i, h) for u, i, h in _held(seq, seq.test)} == want
    # left at its default, the missing `time` column says how to use the file order
    (tmp_path / "run.yaml").write_text(
        (tmp_path / "run.yaml").read_text().replace("    time: null\n", "")
    )
    cfg = runner.load_config([tmp_path / "run.yaml"], [f"out_dir={tmp_path / 'runs'}"])
    with pytest.raises(EventLogError, match=r"no column 'time'.*time: null.*file order"):
        runner.build_data(cfg)
