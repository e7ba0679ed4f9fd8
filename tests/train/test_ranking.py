"""Ranking metrics against brute-force references (ties, masks, k at or above the number
of candidates), candidate scoring of any model in fixed-shape batches, full-corpus
retrieval through a two-tower model's towers, and saved predictions."""

import dataclasses
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

from sparsejax import data as sd
from sparsejax import nn as snn
from sparsejax import train
from sparsejax.data import EventLog, SequenceConfig, build_sequences

# ---------------------------------------------------------------------------------------
# Metrics


def _brute_auc(y, s):
    pos, neg = s[y == 1], s[y == 0]
    return (pos[:, None] > neg[None]).mean() + 0.5 * (pos[:, None] == neg[None]).mean()


def test_gauc_against_brute_force():
    rng = np.random.default_rng(0)
    n = 400
    users = rng.integers(0, 40, n) * 3
    y = (rng.random(n) < 0.3).astype(np.float32)
    s = rng.integers(0, 6, n).astype(np.float32)  # many ties
    mask = (rng.random(n) < 0.8).astype(np.float32)
    keep = mask > 0
    num = den = 0.0
    for u in np.unique(users[keep]):
        sel = keep & (users == u)
        if 0 < y[sel].sum() < sel.sum():
            num += sel.sum() * _brute_auc(y[sel], s[sel])
            den += sel.sum()
    assert train.gauc(y, s, users, mask) == pytest.approx(num / den, abs=1e-12)
    # one user only: GAUC is its AUC; one-class users only: NaN
    assert train.gauc(y, s, np.zeros(n)) == pytest.approx(train.auc(y, s), abs=1e-12)
    assert np.isnan(train.gauc(np.ones(5), np.arange(5.0), np.arange(5)))


def _brute_rank_metrics(scores, k, ties):
    """Mean HR@k, NDCG@k, MRR by enumerating every order of the tied candidates
    (average) or ranking the positive after all ties (pessimistic)."""
    hr, ndcg, mrr = [], [], []
    for row in scores:
        c = len(row)
        if ties == "pessimistic":
            ranks = [int((row[1:] >= row[0]).sum())]
        else:
            ranks = []
            for perm in itertools.permutations(range(c)):  # tie-break order
                order = sorted(range(c), key=lambda j, p=perm: (-row[j], p[j]))
                ranks.append(order.index(0))
        hr.append(np.mean([r < k for r in ranks]))
        ndcg.append(np.mean([1 / np.log2(r + 2) if r < k else 0.0 for r in ranks]))
        mrr.append(np.mean([1 / (r + 1) for r in ranks]))
    return np.mean(hr), np.mean(ndcg), np.mean(mrr)


@pytest.mark.parametrize("ties", ["average", "pessimistic"])
def test_hit_rate_ndcg_mrr_against_brute_force(ties):
    rng = np.random.default_rng(1)
    scores = rng.integers(0, 3, (30, 5)).astype(np.float64)  # 1 + 4 candidates, ties
    scores[0] = 1.0  # all tied
    for k in (1, 2, 5, 9):  # k at and above the number of candidates
        hr, ndcg, mrr = _brute_rank_metrics(scores, k, ties)
        got = train.ranking_metrics(scores, (k,), ties=ties)
        assert got[f"hr@{k}"] == pytest.approx(hr, abs=1e-12)
        assert got[f"ndcg@{k}"] == pytest.approx(ndcg, abs=1e-12)
        assert got["mrr"] == pytest.approx(mrr, abs=1e-12)
        assert train.hit_rate_at_k(scores, k, ties=ties) == got[f"hr@{k}"]
        assert train.ndcg_at_k(scores, k, ties=ties) == got[f"ndcg@{k}"]
    # a constant model is exactly random under "average" ties
    assert train.hit_rate_at_k(np.zeros((3, 101)), 10) == pytest.approx(10 / 101)
    assert train.hit_rate_at_k(np.zeros((3, 101)), 10, ties="pessimistic") == 0.0
    mask = np.r_[np.ones(10), np.zeros(20)]
    assert train.ranking_metrics(scores, 2, mask=mask) == train.ranking_metrics(scores[:10], 2)
    with pytest.raises(ValueError, match="NaN"):
        train.hit_rate_at_k(np.full((2, 3), np.nan), 1)
    with pytest.raises(ValueError, match="k must be a positive int"):
        train.ranking_metrics(scores, (0,))
    with pytest.raises(ValueError, match="ties must be one of"):
        train.ranking_metrics(scores, 1, ties="optimistic")


def test_ranking_report_auc_and_gauc_are_those_of_the_rows():
    """Counted from the one positive per user, they equal AUC and GAUC of the flat rows
    (label 1 in column 0), ties included."""
    rng = np.random.default_rng(6)
    scores = rng.integers(0, 7, (40, 9)).astype(np.float32)  # many ties
    labels = np.zeros(scores.shape)
    labels[:, 0] = 1
    users = np.repeat(np.arange(40), 9)
    got = train.ranking_report(scores)
    assert got["auc"] == pytest.approx(train.auc(labels, scores), abs=1e-12)
    assert got["gauc"] == pytest.approx(
        train.gauc(labels.reshape(-1), scores.reshape(-1), users), abs=1e-12
    )
    assert np.isnan(train.ranking_report(scores[:, :1])["auc"])


def _brute_corpus(user_emb, item_emb, targets, exclude, k):
    hr, ndcg = [], []
    for m, (u, t) in enumerate(zip(user_emb, targets, strict=True)):
        s = item_emb @ u
        others = [i for i in range(len(item_emb)) if i != t and i not in exclude[m]]
        g, e = int((s[others] > s[t]).sum()), int((s[others] == s[t]).sum())
        ranks = range(g, g + e + 1)  # equally likely under random tie-breaking
        hr.append(np.mean([r < k for r in ranks]))
        ndcg.append(np.mean([1 / np.log2(r + 2) if r < k else 0.0 for r in ranks]))
    return np.mean(hr), np.mean(ndcg)


def test_full_corpus_recall_against_brute_force():
    rng = np.random.default_rng(2)
    n_users, n_items = 23, 37
    user_emb = rng.integers(-2, 3, (n_users, 3)).astype(np.float32)  # exact: ties happen
    item_emb = rng.integers(-2, 3, (n_items, 3)).astype(np.float32)
    targets = rng.integers(0, n_items, n_users)
    exclude = [set(rng.choice(n_items, rng.integers(0, 6), replace=False)) for _ in range(n_users)]
    exclude[0].add(int(targets[0]))  # the target itself is never excluded
    lengths = np.array([len(e) for e in exclude])
    values = np.array([i for e in exclude for i in sorted(e)], np.int64)
    ks = (1, 5, n_items, n_items + 3)  # k at and above the corpus size
    got = train.full_corpus_recall(
        user_emb, item_emb, targets, ks, exclude=(lengths, values), user_chunk=5, item_chunk=8
    )
    for k in ks:
        hr, ndcg = _brute_corpus(user_emb, item_emb, targets, exclude, k)
        assert got[f"recall@{k}"] == pytest.approx(hr, abs=1e-12)
        assert got[f"ndcg@{k}"] == pytest.approx(ndcg, abs=1e-12)
    assert got[f"recall@{n_items}"] == 1.0
    no_excl = train.full_corpus_recall(user_emb, item_emb, targets, 5, user_chunk=5, item_chunk=8)
    hr, _ = _brute_corpus(user_emb, item_emb, targets, [set()] * n_users, 5)
    assert no_excl["recall@5"] == pytest.approx(hr, abs=1e-12)


# ---------------------------------------------------------------------------------------
# Scoring models


def _log(seed=0, n_users=30, n_items=40):
    rng = np.random.default_rng(seed)
    lens = rng.integers(3, 12, n_users)
    user = np.repeat(np.arange(n_users), lens)
    return EventLog(
        user=user + 1000, item=rng.integers(0, n_items, user.size), time=rng.random(user.size)
    )


@pytest.fixture(scope="module")
def events():
    return build_sequences(_log(), SequenceConfig(history_length=4, eval_negatives=9))


class _ItemPlusUser(nn.Module):
    """score = item row[0] + user row[0]: a model whose scores are known exactly."""

    tables: Sequence
    features: Sequence
    task: ClassVar[str] = "binary"

    @nn.compact
    def __call__(self, batch, *, train: bool = False):
        emb = snn.EmbeddingBagCollection(self.tables, self.features, name="embedding")(
            batch.features, batch.batch_size
        )
        return emb["item"][:, 0] + emb["user"][:, 0]


def _item_plus_user(events):
    """`_ItemPlusUser` over the events' tables, initialized, with a packer of batch 64:
    (tables, features, trainer, packer, state)."""
    tables, features = events.specs(dim=4)
    trainer = train.Trainer(_ItemPlusUser(tables, features), optax.sgd(0.1))
    packer = sd.BatchPacker(tables, features, batch_size=64)
    sparse, labels, _ = events.test.rows(0, 64)
    state = trainer.init(jax.random.key(0), packer.pack(sparse, labels=labels))
    return tables, features, trainer, packer, state


def test_score_candidates_of_any_model_in_fixed_batches(events, tmp_path):
    # batches of 64 over the 300 candidate rows: the last is padded
    tables, features, trainer, packer, state = _item_plus_user(events)
    (weights,) = trainer.tables_by_name(state).values()  # the model's one layer
    sets = events.test
    want = (
        np.asarray(weights["item"]["weights"])[sets.items, 0]
        + np.asarray(weights["user"]["weights"])[sets.users, 0][:, None]
    )
    got = train.score_candidates(trainer, state, sets, packer)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert len([k for k in trainer._steps if k[0] == "eval"]) == 1  # one compile
    report = train.evaluate_ranking(trainer, state, sets, packer, ks=(1, 10))
    assert report == pytest.approx(train.ranking_report(want, ks=(1, 10)), rel=1e-6)
    assert report["users"] == 30 and report["candidates"] == 10 and report["hr@10"] == 1.0
    few = train.score_candidates(trainer, state, sets, packer, max_negatives=2)
    np.testing.assert_allclose(few, want[:, :3], rtol=1e-6)
    # popularity baseline on the same sets
    pop = train.ranking_report(sd.popularity_scores(events, sets), ks=(10,))
    assert 0 <= pop["ndcg@10"] <= pop["hr@10"] == 1.0
    # predictions with the log's raw ids, written and read back
    cols = train.candidate_predictions(
        sets, got, user_ids=events.user_ids, item_ids=events.item_ids
    )
    assert list(cols) == ["user", "item", "score", "label"] and cols["label"].sum() == 30
    assert set(cols["user"]) == set(events.user_ids)
    path = train.write_predictions(tmp_path / "pred.csv", cols)
    lines = Path(path).read_text().splitlines()
    assert lines[0] == "user,item,score,label" and len(lines) == 301
    u, i, s, y = lines[1].split(",")
    assert (int(u), int(i), float(s), int(y)) == (
        cols["user"][0],
        cols["item"][0],
        pytest.approx(float(cols["score"][0])),
        1,
    )
    pq = pytest.importorskip("pyarrow.parquet")
    table = pq.read_table(train.write_predictions(tmp_path / "pred.parquet", cols))
    np.testing.assert_array_equal(table.column("item").to_numpy(), cols["item"])
    with pytest.raises(ValueError, match=r"pred.json: predictions are written as"):
        train.write_predictions(tmp_path / "pred.json", cols)


def test_two_tower_full_corpus_retrieval_through_its_towers(events):
    tables, features = events.specs(dim=8)
    model = snn.TwoTower(
        tables=tables,
        features=features,
        user_features=("user", "history"),
        item_features=("item",),
        tower=(8,),
    )
    trainer = train.Trainer(model, optax.sgd(0.1))
    packer = sd.BatchPacker(tables, features, batch_size=32)
    sparse, labels, _ = events.test.rows(0, 32)
    state = trainer.init(jax.random.key(1), packer.pack(sparse, labels=labels))
    sets = events.test
    user_emb, _ = train.tower_embeddings(trainer, state, sets.user_examples(), packer)
    corpus = sd.Examples(
        labels=np.zeros(events.num_items),
        dense=np.zeros((events.num_items, 0)),
        sparse={
            "user": sd.JaggedIds(np.ones(events.num_items, np.int64), np.zeros(events.num_items)),
            "item": sd.JaggedIds(np.ones(events.num_items, np.int64), np.arange(events.num_items)),
            "history": sd.JaggedIds(np.zeros(events.num_items, np.int64), np.zeros(0)),
        },
    )
    _, item_emb = train.tower_embeddings(trainer, state, corpus, packer)
    assert user_emb.shape == (30, 8) and item_emb.shape == (events.num_items, 8)
    # the towers agree with the model's own scores of the candidate rows (its diagonal)
    scores = train.score_candidates(trainer, state, sets, packer)
    want = np.einsum("md,mcd->mc", user_emb, item_emb[sets.items]) / model.temperature
    np.testing.assert_allclose(scores, want, rtol=1e-4, atol=1e-4)
    got = train.evaluate_retrieval(trainer, state, sets, packer, ks=(5, 10))
    ref = train.full_corpus_recall(
        user_emb, item_emb, sets.positives, (5, 10), exclude=(sets.seen.lengths, sets.seen.values)
    )
    assert got == pytest.approx({**ref, "users": 30, "items": events.num_items})
    with pytest.raises(ValueError, match="full-corpus retrieval needs a two-tower model"):
        din = train.Trainer(snn.DIN(tables=tables, features=features), optax.sgd(0.1))
        train.evaluate_retrieval(din, state, sets, packer)


def _trained(model, data, steps=15):
    tables, features = data.specs(dim=8)
    trainer = train.Trainer(model(tables, features), optax.adam(1e-2))
    packer = sd.BatchPacker(tables, features, batch_size=128)
    sparse, labels, dense = data.train.take(np.arange(128))
    batch = packer.pack(sparse, labels=labels, dense=dense)
    state = trainer.init(jax.random.key(0), batch)
    for _ in range(steps):
        state, _ = trainer.train_step(state, batch)
    return trainer, state, packer


_FACTORED = {
    "two_tower": lambda tables, features: snn.TwoTower(
        tables=tables,
        features=features,
        user_features=("user", "history"),
        item_features=("item",),
        tower=(16, 8),
    ),
    "din": lambda tables, features: snn.DIN(
        tables=tables, features=features, hidden=(16,), attention_hidden=(8,)
    ),
}


@pytest.mark.parametrize("name", sorted(_FACTORED))
def test_factored_scoring_gives_the_scores_of_one_row_per_candidate(name):
    """Each user and each distinct candidate encoded once (two-tower: the towers; DIN:
    the history looked up once per user) scores as every (user, candidate) packed as its
    own row did: same scores up to float rounding, identical HR@10 / NDCG@10."""
    log = sd.synthetic_events(num_users=150, num_items=120, events_per_user=(4, 12), seed=3)
    data = build_sequences(log, SequenceConfig(history_length=6, eval_negatives=30))
    trainer, state, _ = _trained(_FACTORED[name], data)
    tables, features = data.specs(dim=8)
    packer = sd.BatchPacker(tables, features, batch_size=100)  # DIN: 3 users a step
    sets = data.test
    rows = train.score_candidates(trainer, state, sets, packer, method="rows")
    assert len([k for k in trainer._steps if k[0] == "eval"]) == 1
    trainer._steps = {k: v for k, v in trainer._steps.items() if k[0] != "eval"}
    factored = train.score_candidates(trainer, state, sets, packer, method="factored")
    assert not [k for k in trainer._steps if k[0] == "eval"]  # no per-row eval step
    np.testing.assert_allclose(factored, rows, rtol=1e-5, atol=1e-5)
    assert np.abs(rows).max() > 1e-2  # not all zeros
    auto = train.score_candidates(trainer, state, sets, packer)
    np.testing.assert_array_equal(auto, factored)
    got = {
        m: train.evaluate_ranking(trainer, state, sets, packer, method=m)
        for m in ("rows", "factored")
    }
    for key in ("hr@10", "ndcg@10"):
        assert got["factored"][key] == got["rows"][key]
    few = train.score_candidates(trainer, state, sets, packer, max_negatives=4)
    np.testing.assert_allclose(few, rows[:, :5], rtol=1e-5, atol=1e-5)


def test_models_that_cannot_be_factored_score_row_by_row(events):
    tables, features, trainer, packer, state = _item_plus_user(events)
    with pytest.raises(ValueError, match="_ItemPlusUser cannot be scored factored"):
        train.score_candidates(trainer, state, events.test, packer, method="factored")
    with pytest.raises(ValueError, match="method must be one of"):
        train.score_candidates(trainer, state, events.test, packer, method="fast")
    # a DIN whose item table is projected to the model's dim: rows (auto) as well
    projected = [dataclasses.replace(t, dim=6) if t.name == "item" else t for t in tables]
    din = snn.DIN(tables=projected, features=features, embedding_dim=4, hidden=(8,))
    assert train._ranking._factored_scorer(train.Trainer(din, optax.sgd(0.1))) is None


def test_ranking_on_a_sample_of_users(events):
    tables, features, trainer, packer, state = _item_plus_user(events)
    sets = events.test
    sample = sets.sample(12, seed=5)
    assert (
        sample.num_users == 12 and sets.sample(12, seed=5).users.tolist() == sample.users.tolist()
    )
    assert sets.sample(12, seed=6).users.tolist() != sample.users.tolist()
    assert sets.sample(30) is sets and sets.sample(99) is sets
    m = np.searchsorted(sets.users, sample.users)  # users are in their order, distinct
    np.testing.assert_array_equal(sample.items, sets.items[m])
    for a, b in ((sample.history, sets.history), (sample.seen, sets.seen)):
        offsets = np.r_[0, np.cumsum(b.lengths)]
        want = [b.values[offsets[i] : offsets[i + 1]].tolist() for i in m]
        got = np.split(a.values, np.cumsum(a.lengths)[:-1])
        assert [g.tolist() for g in got] == want
    all_scores = train.score_candidates(trainer, state, sets, packer)
    report = train.evaluate_ranking(trainer, state, sets, packer, max_users=12, seed=5)
    assert report == pytest.approx(train.ranking_report(all_scores[m]))
    assert report["users"] == 12
    with pytest.raises(ValueError, match="num_users must be >= 1"):
        sets.sample(0)


@pytest.mark.parametrize("model", ["two_tower", "din"])
def test_runner_evals_on_candidate_sets_report_what_means_something(tmp_path, model):
    """kind=events: an eval on sampled candidates reports the ranking metrics and, of the
    row metrics, only those that mean something there: no calibration (the rows' positive
    rate is set by the number of negatives) and no in-batch recall@k (it takes every
    candidate row as a positive pair); a two-tower's loss is the softmax cross-entropy of
    the held-out item among its candidates. `eval_users` samples the eval users."""
    from sparsejax import runner

    log = sd.synthetic_events(num_users=60, num_items=80, events_per_user=(4, 8), seed=2)
    path = log.write_csv(tmp_path / "events.csv")
    options = (
        "{user_features: [user, history], item_features: [item], tower: [8]}"
        if model == "two_tower"
        else "{hidden: [8], attention_hidden: [4]}"
    )
    cfg = runner.load_config(
        [],
        [
            "data.kind=events",
            f"data.train={path}",
            "data.events={columns: [user, item, time], history_length: 5, eval_negatives: 20, "
            f"negatives: {0 if model == 'two_tower' else 1}}}",
            "data.batch_size=32",
            f"model.name={model}",
            f"model.options={options}",
            "model.embedding_dim=8",
            "eval_users=25",
            "steps=5",
            f"out_dir={tmp_path}",
        ],
    )
    run = runner.build_run(cfg, log=lambda *_: None)
    sets = run.data.ranking["eval"]
    assert sets.num_users == 25 and run.data.ranking["test"].num_users == 60
    assert len(run.data.eval_examples) == 25 * 21  # the eval rows are the sample's
    got = runner._run.run_evaluator(run)(run.state)
    names = train._ranking.candidate_metric_names(run.trainer.task, cfg.eval_ks)
    assert set(got) - {"examples", "users", "candidates"} == names
    assert "calibration" not in got and not any(k.startswith("recall@") for k in got)
    scores = train.score_candidates(run.trainer, run.state, sets, run.data.packer)
    assert got["hr@10"] == train.ranking_report(scores)["hr@10"] and got["users"] == 25
    if model == "two_tower":
        want = np.mean([np.log(np.exp(s - s.max()).sum()) + s.max() - s[0] for s in scores])
        assert got["loss"] == pytest.approx(want, rel=1e-6)
    else:  # the candidate rows' own loss, AUC and logloss
        rows = run.trainer.evaluate(run.state, run.data.eval_batches)
        assert {k: got[k] for k in ("loss", "auc", "logloss")} == {
            k: rows[k] for k in ("loss", "auc", "logloss")
        }
    with pytest.raises(ValueError, match="`eval_users` samples the users of candidate sets"):
        runner.load_config([], ["eval_users=10"])
    with pytest.raises(ValueError, match="`eval_users` must be >= 1, got 0"):
        runner.load_config([], ["eval_users=0"])
