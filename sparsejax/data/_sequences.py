"""Sequence examples from an event log: per-user histories, leave-last-out or time splits,
negative sampling, and the candidate sets a ranking evaluation scores.

From `(user, item[, time])` events (numpy arrays, or a delimited file read by
`read_events`; without times, the log's order is the time), `build_sequences` sorts each
user's events by time (ties: log order), giving `items[0..n-1]`, and makes:

* `train`: `Examples` with features `user` (one id), `item` (the candidate, one id),
  `history` (the user's last `history_length` items before the event, oldest first, a
  sequence over the SAME item table as `item`), and labels: each train event is a positive
  followed by `negatives` sampled negatives with the positive's user and history.
* `valid` / `test`: `CandidateSets`, one held-out event per user: the held-out item plus
  `eval_negatives` sampled items (the common "1 + 100 candidates" protocol), with the
  user's history before the held-out event.

The leave-last-out protocol (SASRec's): train targets are `items[0..n-3]`, each with the
items before it; the validation target is `items[n-2]` with history `items[:n-2]`; the
test target is `items[n-1]` with history `items[:n-1]`, the validation item included
(each history cut to its last `history_length` items). The validation and test items are
never train targets nor in a train history, and the train is the same for both (the
validation event is not trained on before testing). Train negatives are drawn once (the
same every epoch), per positive, from `sampler`, never the positive and (with
`exclude_seen`) none of the user's train items; they may be the user's held-out items,
since excluding those would tell the model what is held out. Evaluation negatives are
`eval_negatives` distinct items from `eval_sampler`, never the held-out item and (with
`exclude_seen`) none of the user's items in the whole log. The catalog is the items of
the events kept (after `min_rating` and `min_user_events`); popularity counts come from
train events only. docs/sequences.md says the same for users of a run config.

Everything is vectorized with numpy (no per-event Python loop) and reproducible by
`seed`. Users and items are renumbered to rows `0..U-1` / `0..I-1` (sorted by raw id);
`SequenceData.user_ids` / `item_ids` map rows back to the raw ids.

Example::

    cfg = SequenceConfig(history_length=50, negatives=4, eval_negatives=100)
    log, report = read_events("events.csv", cfg)     # columns user,item,time[,rating]
    data = build_sequences(log, cfg)
    tables, features = data.specs(dim=32)            # item table shared by item/history
    model = DIN(tables=tables, features=features)    # target="item", history="history"
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence

import numpy as np

from ..embedding import FeatureSpec, TableSpec
from ._batch import JaggedIds
from ._csv import ParseReport
from ._event_config import EventLogError, SequenceConfig, as_config, time_value
from ._events import EventLog, read_events
from ._loader import Examples, HostBatch
from ._negatives import probs, sample

USER, ITEM, HISTORY = "user", "item", "history"
"""Feature names of the examples (DIN's defaults: `target="item"`, `history="history"`)."""

_TRAIN, _VALID, _TEST, _UNUSED = 0, 1, 2, 3


@dataclasses.dataclass(frozen=True, eq=False)
class CandidateSets:
    """One held-out event per evaluated user: `items[m, 0]` is the held-out item and
    `items[m, 1:]` the sampled negatives, scored against the user's history before the
    held-out event. Rows of the flat view (`rows`, `to_examples`) are user-major: row
    `m * num_candidates + c` is user m's candidate c (label 1 for c = 0)."""

    users: np.ndarray  # i64[M] user rows
    history: JaggedIds  # M histories, oldest first, at most history_length items
    items: np.ndarray  # i64[M, 1 + K]; column 0 the held-out item
    times: np.ndarray  # [M] time of the held-out event
    seen: JaggedIds
    """Per user, the distinct items of all its events before the held-out one (not cut to
    `history_length`): what full-corpus retrieval may exclude."""

    @property
    def num_users(self) -> int:
        return int(self.users.shape[0])

    @property
    def num_candidates(self) -> int:
        return int(self.items.shape[1])

    @property
    def num_rows(self) -> int:
        return self.num_users * self.num_candidates

    @property
    def positives(self) -> np.ndarray:
        return self.items[:, 0]

    def user_examples(self) -> Examples:
        """One example per user: `user`, `history`, and the held-out item as `item`
        (label 1), e.g. to embed the users of a two-tower model."""
        return _examples(self.users, self.items[:, 0], self.history, np.ones(self.num_users))

    def rows(self, start: int, stop: int, *, max_negatives: int | None = None) -> HostBatch:
        """Flat rows `[start, stop)` as host arrays of a batch (features user, item,
        history; label 1 for the held-out item): what a scorer packs, without building
        all `num_rows` histories at once."""
        c = (
            self.num_candidates
            if max_negatives is None
            else 1 + min(max_negatives, self.num_candidates - 1)
        )
        r = np.arange(start, min(stop, self.num_users * c), dtype=np.int64)
        m, j = np.divmod(r, c)
        sparse, _, _ = self._per_user.take(m)
        sparse[ITEM] = JaggedIds(np.ones(r.size, np.int64), self.items[m, j])
        return sparse, (j == 0).astype(np.float32), np.zeros((r.size, 0), np.float32)

    def to_examples(self, *, max_negatives: int | None = None) -> Examples:
        """All rows as `Examples` (labels 1 for held-out items, 0 for negatives), e.g. for
        AUC/logloss/GAUC on a validation split; `max_negatives` keeps only the first few
        negatives of each set (a cheaper validation during training)."""
        c = (
            self.num_candidates
            if max_negatives is None
            else 1 + min(max_negatives, self.num_candidates - 1)
        )
        sparse, labels, dense = self.rows(0, self.num_users * c, max_negatives=max_negatives)
        return Examples(labels=labels, dense=dense, sparse=sparse)

    def sample(self, num_users: int, *, seed: int = 0) -> CandidateSets:
        """A random `num_users` of these users (without replacement, in their order, drawn
        by `seed`) with their candidate sets: a cheaper evaluation of large logs. All users
        when `num_users` is at least their number."""
        if num_users < 1:
            raise ValueError(f"CandidateSets.sample: num_users must be >= 1, got {num_users}")
        if num_users >= self.num_users:
            return self
        m = np.sort(np.random.default_rng([seed, 0x5A]).permutation(self.num_users)[:num_users])
        jagged = Examples(
            labels=np.zeros(self.num_users, np.float32),
            dense=np.zeros((self.num_users, 0), np.float32),
            sparse={"history": self.history, "seen": self.seen},
        )
        sparse, _, _ = jagged.take(m)
        return CandidateSets(
            self.users[m], sparse["history"], self.items[m], self.times[m], sparse["seen"]
        )

    @property
    def _per_user(self) -> Examples:
        ex = self.__dict__.get("_per_user_cache")
        if ex is None:
            ex = _examples(self.users, self.items[:, 0], self.history, np.ones(self.num_users))
            object.__setattr__(self, "_per_user_cache", ex)
        return ex


@dataclasses.dataclass(frozen=True, kw_only=True)
class SequenceReport:
    """What `build_sequences` kept, dropped and sampled. `str(report)` is one line that
    names what each count counts (events, users, rows)."""

    events: int
    """Events in the log."""
    rating_filtered: int
    """Events dropped by `min_rating`."""
    users_dropped: int
    """Users with fewer than `min_user_events` events (after `min_rating`), dropped with
    all their events."""
    events_dropped: int
    """Events of those users."""
    min_user_events: int
    """The config's `min_user_events` (what the dropped users fell short of)."""
    users: int
    """Users kept."""
    items: int
    """Distinct items of the kept events."""
    train_positives: int
    """Train events (one positive example each)."""
    train_rows: int
    """Train examples: positives plus their negatives."""
    valid_users: int
    """Users with a validation event (one candidate set each)."""
    test_users: int
    """Users with a test event (one candidate set each)."""
    history_length: int
    """The config's `history_length`."""
    histories_truncated: int
    """Examples (train events and held-out events) with more prior events than
    `history_length` (their histories keep the last `history_length`)."""
    empty_histories: int
    """Held-out events with no prior event (the user's history is empty)."""
    negatives_relaxed: int
    """Rows of negatives (a train positive's, or a candidate set's) where the sampler
    could not avoid the user's seen items (the user has seen nearly every item) or
    could not draw distinct items."""

    def summary(self) -> str:
        kept = self.events - self.rating_filtered - self.events_dropped
        histories = self.train_positives + self.valid_users + self.test_users
        return (
            f"events: {self.events:,} read; {self.rating_filtered:,} events dropped because "
            f"their rating is below min_rating; {self.events_dropped:,} events of "
            f"{self.users_dropped:,} users dropped because those users have fewer than "
            f"{self.min_user_events:,} events (min_user_events); kept {kept:,} events of "
            f"{self.users:,} users, {self.items:,} items; train {self.train_positives:,} "
            f"positive events ({self.train_rows:,} rows with their negatives); valid "
            f"{self.valid_users:,} users, test {self.test_users:,} users (one held-out event "
            f"each); {self.histories_truncated:,} of {histories:,} histories truncated to the "
            f"last {self.history_length:,} items (history_length); {self.empty_histories:,} "
            f"held-out events without history; {self.negatives_relaxed:,} rows of negatives "
            f"that could not avoid seen items or repeats"
        )

    def __str__(self) -> str:
        return self.summary()


@dataclasses.dataclass(frozen=True, eq=False)
class SequenceData:
    """Train examples, validation and test candidate sets, and the id maps of one event
    log (`build_sequences`)."""

    config: SequenceConfig
    train: Examples
    valid: CandidateSets | None
    test: CandidateSets | None
    user_ids: np.ndarray
    """Raw user id of each user row."""
    item_ids: np.ndarray
    """Raw item id of each item row."""
    item_counts: np.ndarray
    """i64[num_items]: train positives per item (the popularity baseline's score)."""
    report: SequenceReport

    @property
    def num_users(self) -> int:
        return int(self.user_ids.shape[0])

    @property
    def num_items(self) -> int:
        return int(self.item_ids.shape[0])

    def specs(
        self, *, dim: int, user_feature: bool = True, **table_kwargs
    ) -> tuple[list[TableSpec], list[FeatureSpec]]:
        """Tables `user` and `item`; features `user` (one id), `item` (the candidate) and
        `history` (a sequence of `history_length` over the SAME `item` table, as DIN's
        target attention needs). `user_feature=False` leaves the user id out (and its
        table). `table_kwargs` go to every `TableSpec` (dtype, optimizer, initializer)."""
        tables = [TableSpec(name=ITEM, vocab_size=self.num_items, dim=dim, **table_kwargs)]
        features = [
            FeatureSpec(name=ITEM, table=ITEM),
            FeatureSpec(
                name=HISTORY, table=ITEM, combiner=None, max_ids=self.config.history_length
            ),
        ]
        if user_feature:
            tables.insert(
                0, TableSpec(name=USER, vocab_size=self.num_users, dim=dim, **table_kwargs)
            )
            features.insert(0, FeatureSpec(name=USER, table=USER))
        return tables, features


# ---------------------------------------------------------------------------------------
# Building


def build_sequences(log: EventLog, config: SequenceConfig | Mapping | None = None) -> SequenceData:
    """Histories, the split, negatives and candidate sets of `log` (see the module doc).

    Users with fewer than `config.min_user_events` events are dropped and counted (under
    leave_last_out a user needs a train, a validation and a test event). Train negatives
    are drawn per positive from the configured sampler, never equal to the positive and
    (with `exclude_seen`) outside the user's train items; evaluation negatives are
    distinct and outside all the user's items. Popularity counts come from train events
    only. Raises `EventLogError` when nothing is left to train on or the catalog is too
    small for the negatives asked for.
    """
    cfg = as_config(config)
    n_read = len(log)
    user, item, time = log.user, log.item, np.asarray(log.time)
    rating_filtered = 0
    if cfg.min_rating is not None:
        if log.rating is None:
            raise EventLogError("build_sequences: min_rating is set but the log has no ratings")
        keep = np.asarray(log.rating) >= cfg.min_rating
        rating_filtered = int((~keep).sum())
        user, item, time = user[keep], item[keep], time[keep]
    # users with too few events
    _, u_raw, u_count = np.unique(user, return_inverse=True, return_counts=True)
    keep = u_count[u_raw] >= cfg.min_user_events
    users_dropped = int((u_count < cfg.min_user_events).sum())
    events_dropped = int((~keep).sum())
    user, item, time = user[keep], item[keep], time[keep]
    if user.size == 0:
        raise EventLogError(
            f"build_sequences: no events left ({n_read} read, {rating_filtered} below "
            f"min_rating, {events_dropped} events of {users_dropped} users with fewer than "
            f"{cfg.min_user_events} events)"
        )
    user_ids, u = np.unique(user, return_inverse=True)
    item_ids, i = np.unique(item, return_inverse=True)
    n_users, n_items = user_ids.size, item_ids.size
    # sort by (user, time, position in the log)
    order = np.lexsort((np.arange(u.size), time, u))
    u, i, time = u[order].astype(np.int64), i[order].astype(np.int64), time[order]
    counts = np.bincount(u, minlength=n_users)
    starts = np.cumsum(counts) - counts
    pos = np.arange(u.size) - starts[u]

    role = _roles(cfg, u, pos, counts, time)
    train_idx = np.flatnonzero(role == _TRAIN)
    if train_idx.size == 0:
        raise EventLogError("build_sequences: the split leaves no train events")
    item_counts = np.bincount(i[train_idx], minlength=n_items)
    if (cfg.negatives or cfg.eval_negatives) and n_items < 2:
        raise EventLogError(
            f"build_sequences: {n_items} item(s) leave no item to sample as a negative"
        )
    if cfg.eval_negatives > n_items - 1:
        raise EventLogError(
            f"SequenceConfig.eval_negatives={cfg.eval_negatives} needs at least "
            f"{cfg.eval_negatives + 1} items; the log has {n_items}"
        )
    train_keys = _unique_sorted(u[train_idx] * n_items + i[train_idx])
    all_keys = _unique_sorted(u * n_items + i)
    relaxed = 0

    # train examples: each positive, then its negatives, with the same user and history
    hist = _histories(train_idx, pos, i, cfg.history_length)
    k = cfg.negatives
    neg, r = sample(
        np.random.default_rng([cfg.seed, 1]),
        u[train_idx],
        i[train_idx],
        k,
        n_items,
        probs(cfg.sampler, item_counts, cfg.popularity_exponent),
        train_keys if cfg.exclude_seen else None,
        distinct=False,
    )
    relaxed += r
    cand = np.concatenate([i[train_idx, None], neg], axis=1)
    labels = np.zeros(cand.shape, np.float32)
    labels[:, 0] = 1.0
    per_event = _examples(u[train_idx], i[train_idx], hist, np.ones(train_idx.size))
    sparse, _, _ = per_event.take(np.repeat(np.arange(train_idx.size), 1 + k))
    sparse[ITEM] = JaggedIds(np.ones(cand.size, np.int64), cand.reshape(-1))
    train = Examples(
        labels=labels.reshape(-1), dense=np.zeros((cand.size, 0), np.float32), sparse=sparse
    )

    eval_probs = probs(cfg.eval_sampler, item_counts, cfg.popularity_exponent)
    sets, empty = {}, 0
    for stream, which in ((2, _VALID), (3, _TEST)):
        idx = np.flatnonzero(role == which)
        if idx.size == 0:
            sets[which] = None
            continue
        neg, r = sample(
            np.random.default_rng([cfg.seed, stream]),
            u[idx],
            i[idx],
            cfg.eval_negatives,
            n_items,
            eval_probs,
            all_keys if cfg.exclude_seen else None,
            distinct=True,
        )
        relaxed += r
        empty += int((pos[idx] == 0).sum())
        sets[which] = CandidateSets(
            users=u[idx],
            history=_histories(idx, pos, i, cfg.history_length),
            items=np.concatenate([i[idx, None], neg], axis=1),
            times=time[idx],
            seen=_seen_before(idx, pos, i, n_items),
        )
    held = np.flatnonzero((role == _TRAIN) | (role == _VALID) | (role == _TEST))
    report = SequenceReport(
        events=n_read,
        rating_filtered=rating_filtered,
        users_dropped=users_dropped,
        events_dropped=events_dropped,
        min_user_events=cfg.min_user_events,
        users=n_users,
        items=n_items,
        train_positives=int(train_idx.size),
        train_rows=len(train),
        valid_users=0 if sets[_VALID] is None else sets[_VALID].num_users,
        test_users=0 if sets[_TEST] is None else sets[_TEST].num_users,
        history_length=cfg.history_length,
        histories_truncated=int((pos[held] > cfg.history_length).sum()),
        empty_histories=empty,
        negatives_relaxed=relaxed,
    )
    return SequenceData(
        config=cfg,
        train=train,
        valid=sets[_VALID],
        test=sets[_TEST],
        user_ids=user_ids,
        item_ids=item_ids,
        item_counts=item_counts,
        report=report,
    )


def load_sequences(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    config: SequenceConfig | Mapping | None = None,
    *,
    strict: bool = False,
) -> tuple[SequenceData, ParseReport]:
    """`read_events` then `build_sequences`: what a run with `data.kind: events` does."""
    cfg = as_config(config)
    log, report = read_events(paths, cfg, strict=strict)
    if len(log) == 0:
        raise EventLogError(f"no usable events: {report.summary()}")
    return build_sequences(log, cfg), report


def _roles(cfg: SequenceConfig, u, pos, counts, time) -> np.ndarray:
    """Role of each (sorted) event: train, valid, test or unused."""
    if cfg.split == "leave_last_out":
        last = counts[u] - 1
        return np.where(pos == last, _TEST, np.where(pos == last - 1, _VALID, _TRAIN)).astype(
            np.int8
        )
    t_test = time_value("test_time", cfg.test_time)
    t_valid = time_value("valid_time", cfg.valid_time)
    cut = t_test if t_valid is None else t_valid
    role = np.full(u.size, _UNUSED, np.int8)
    role[time < cut] = _TRAIN
    same_user = np.r_[False, u[1:] == u[:-1]]
    windows = [(t_test, np.inf, _TEST)]
    if t_valid is not None:
        windows.append((t_valid, t_test, _VALID))
    for lo, hi, which in windows:
        inside = (time >= lo) & (time < hi)
        # a user's events are sorted by time, so its window events are contiguous
        first = inside & ~(np.r_[False, inside[:-1]] & same_user)
        role[first] = which
    return role


def _histories(idx: np.ndarray, pos: np.ndarray, items: np.ndarray, n: int) -> JaggedIds:
    """The last `n` items before each event `idx` (sorted positions), oldest first."""
    lengths = np.minimum(pos[idx], n)
    total = int(lengths.sum())
    ends = np.cumsum(lengths)
    within = np.arange(total) - np.repeat(ends - lengths, lengths)
    src = np.repeat(idx - lengths, lengths) + within
    return JaggedIds(lengths=lengths.astype(np.int64), values=items[src])


def _seen_before(idx: np.ndarray, pos: np.ndarray, items: np.ndarray, n_items: int) -> JaggedIds:
    """Distinct items of all events before each event `idx`, sorted."""
    lengths = pos[idx]
    h = _histories(idx, pos, items, int(lengths.max(initial=0)))
    owner = np.repeat(np.arange(idx.size), lengths)
    keys = _unique_sorted(owner * n_items + h.values)
    who, what = np.divmod(keys, n_items)
    return JaggedIds(lengths=np.bincount(who, minlength=idx.size).astype(np.int64), values=what)


def _unique_sorted(a: np.ndarray) -> np.ndarray:
    """`np.unique(a)` by a sort (numpy's hash-based unique is several times slower on
    millions of int64 keys)."""
    a = np.sort(a)
    return a[np.r_[True, a[1:] != a[:-1]]] if a.size else a


def _examples(users, items, history: JaggedIds, labels) -> Examples:
    n = users.shape[0]
    one = np.ones(n, np.int64)
    return Examples(
        labels=np.asarray(labels, np.float32),
        dense=np.zeros((n, 0), np.float32),
        sparse={
            USER: JaggedIds(one, np.asarray(users, np.int64)),
            ITEM: JaggedIds(one, np.asarray(items, np.int64)),
            HISTORY: history,
        },
    )


def popularity_scores(data: SequenceData, sets: CandidateSets) -> np.ndarray:
    """`[M, 1 + K]` scores of the popularity baseline (train count of each candidate),
    to compare a model's HR/NDCG with."""
    return data.item_counts[sets.items].astype(np.float64)
