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
import difflib
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..embedding import FeatureSpec, TableSpec
from ._batch import JaggedIds
from ._csv import ParseReport, open_text
from ._loader import Examples, HostBatch
from ._options import options_from_dict

USER, ITEM, HISTORY = "user", "item", "history"
"""Feature names of the examples (DIN's defaults: `target="item"`, `history="history"`)."""
SPLITS = ("leave_last_out", "time")
SAMPLERS = ("uniform", "popularity")

_TRAIN, _VALID, _TEST, _UNUSED = 0, 1, 2, 3
_REJECTION_ROUNDS = 32


class EventLogError(ValueError):
    """A problem with an event log or its options; the message names the file, column or
    key."""


# ---------------------------------------------------------------------------------------
# Config


@dataclasses.dataclass(frozen=True, kw_only=True)
class SequenceConfig:
    """How an event log becomes sequence examples (`data.events` in a run config). Which
    events train, which are held out, what history each example has and which items
    its negatives avoid: docs/sequences.md."""

    user: str = "user"
    """Column of the user id (integers or any strings)."""
    item: str = "item"
    """Column of the item id (integers or any strings)."""
    time: str | None = "time"
    """Column of the event time: a number (e.g. Unix seconds) or an ISO date/time
    ("2024-01-31", "2024-01-31T12:30:00"). A user's events are ordered by time, ties by
    their order in the log. None: the log has no time column and its order is the time
    (a user's events in the order of their lines, files in the order given; e.g.
    SASRec's `user item` files); not with split="time". Left at "time", a log without
    that column is an error that says so."""
    rating: str | None = None
    """Optional column of a rating or strength; used by `min_rating`."""
    min_rating: float | None = None
    """Keep only events with rating >= this (explicit ratings as implicit feedback, e.g.
    4 on MovieLens); needs `rating`. Dropped events are counted in the report."""
    delimiter: str = ","
    """Field delimiter of the log file ("\\t" for TSV)."""
    header: bool = True
    """The log's first line names its columns. With several files, a later file whose
    first line equals the first file's header skips it; otherwise it is data."""
    columns: tuple[str, ...] | None = None
    """Column names in file order; required when `header` is False."""
    history_length: int = 20
    """Items kept per history (the last N before the event, oldest first); also the
    `max_ids` of the `history` feature. Longer histories are truncated and counted."""
    split: str = "leave_last_out"
    """"leave_last_out": each user's last event is the test item, the one before it the
    validation item, the rest train. "time": events before `valid_time` (or `test_time`
    when `valid_time` is unset) train; each user's first event in [valid_time,
    test_time) is its validation item, its first event at or after `test_time` its test
    item (later events only enter later histories)."""
    valid_time: float | str | None = None
    """Time split: start of the validation period (a number or an ISO date); None gives
    no validation set."""
    test_time: float | str | None = None
    """Time split: start of the test period (required for split="time")."""
    min_user_events: int = 3
    """Users with fewer events (after `min_rating`) are dropped and counted. At least 3
    under leave_last_out (one train, one validation, one test event)."""
    negatives: int = 1
    """Sampled negatives per train positive (0: positives only, e.g. for a two-tower
    model with in-batch negatives)."""
    eval_negatives: int = 100
    """Sampled negatives in each validation/test candidate set (besides the held-out
    item)."""
    sampler: str = "uniform"
    """How train negatives are drawn: "uniform" over items, or "popularity" (in
    proportion to train counts ** `popularity_exponent`)."""
    eval_sampler: str = "uniform"
    """How evaluation negatives are drawn ("uniform" is the common protocol)."""
    popularity_exponent: float = 1.0
    """Exponent of the train counts in the popularity sampler (0.75 as word2vec)."""
    exclude_seen: bool = True
    """Negatives avoid items the user interacted with (train negatives: the user's train
    events; evaluation negatives: all its events). A negative never equals its positive;
    a user who has seen nearly every item falls back to unseen-or-not (counted)."""
    seed: int = 0
    """Seed of the negative sampling (train, validation and test draw separate
    streams)."""

    def __post_init__(self):
        if self.columns is not None:
            object.__setattr__(self, "columns", tuple(self.columns))
        elif not self.header:
            raise EventLogError("SequenceConfig: `columns` is required when header=False")
        for f in ("history_length",):
            _check_int(f, getattr(self, f), 1)
        for f in ("negatives", "eval_negatives", "seed"):
            _check_int(f, getattr(self, f), 0)
        _check_int("min_user_events", self.min_user_events, 1)
        if self.split not in SPLITS:
            raise EventLogError(f"SequenceConfig.split must be one of {SPLITS}, got {self.split!r}")
        for f in ("sampler", "eval_sampler"):
            if getattr(self, f) not in SAMPLERS:
                raise EventLogError(
                    f"SequenceConfig.{f} must be one of {SAMPLERS}, got {getattr(self, f)!r}"
                )
        if self.split == "leave_last_out":
            if self.min_user_events < 3:
                raise EventLogError(
                    "SequenceConfig.min_user_events must be >= 3 under split=leave_last_out "
                    f"(train, validation and test events), got {self.min_user_events}"
                )
            if self.valid_time is not None or self.test_time is not None:
                raise EventLogError(
                    "SequenceConfig: valid_time/test_time apply to split='time' only"
                )
        else:
            if self.time is None:
                raise EventLogError(
                    "SequenceConfig: split='time' needs a time column (time is None: file order)"
                )
            if self.test_time is None:
                raise EventLogError("SequenceConfig: split='time' needs test_time")
            vt, tt = (
                _time_value("valid_time", self.valid_time),
                _time_value("test_time", self.test_time),
            )
            if vt is not None and not vt < tt:
                raise EventLogError(
                    f"SequenceConfig: valid_time {self.valid_time!r} must be before "
                    f"test_time {self.test_time!r}"
                )
        if self.min_rating is not None and self.rating is None:
            raise EventLogError("SequenceConfig: min_rating needs the `rating` column")
        if len(self.delimiter) != 1:
            raise EventLogError(
                f"SequenceConfig.delimiter must be one character, got {self.delimiter!r}"
            )
        if not (
            isinstance(self.popularity_exponent, int | float) and self.popularity_exponent >= 0
        ):
            raise EventLogError(
                f"SequenceConfig.popularity_exponent must be >= 0, got {self.popularity_exponent!r}"
            )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> SequenceConfig:
        """From a plain dict (a YAML `data.events` section); an unknown key is an error
        naming it and the closest valid key."""
        return options_from_dict(cls, d or {}, where="data.events", error=EventLogError)

    @property
    def used_columns(self) -> tuple[str, ...]:
        return tuple(c for c in (self.user, self.item, self.time, self.rating) if c is not None)


def _check_int(name: str, value, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise EventLogError(f"SequenceConfig.{name} must be an int >= {low}, got {value!r}")


def _time_value(name: str, value) -> float | None:
    """A configured time as a number: numbers as they are, ISO dates as Unix seconds."""
    if value is None or isinstance(value, int | float) and not isinstance(value, bool):
        return None if value is None else float(value)
    try:
        return float(value)
    except (TypeError, ValueError):
        pass
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return float(np.datetime64(str(value), "s").astype(np.int64))
    except ValueError:
        raise EventLogError(
            f"SequenceConfig.{name}: {value!r} is neither a number nor an ISO date/time"
        ) from None


# ---------------------------------------------------------------------------------------
# The log and its reader


@dataclasses.dataclass(frozen=True, eq=False)
class EventLog:
    """Raw events as parallel arrays: user and item ids (integers or strings), times
    (numbers; `read_events` turns dates into Unix seconds) and optional ratings. Without
    times, an event's time is its position in the log (0, 1, ...): the log's order."""

    user: np.ndarray  # [n] raw user ids
    item: np.ndarray  # [n] raw item ids
    time: np.ndarray | None = None  # f64[n] (or any numeric); None: positions 0..n-1
    rating: np.ndarray | None = None  # f64[n]

    def __post_init__(self):
        n = np.shape(self.user)[0] if np.ndim(self.user) else -1
        if self.time is None:
            object.__setattr__(self, "time", np.arange(max(n, 0), dtype=np.float64))
        for name in ("user", "item", "time", "rating"):
            a = getattr(self, name)
            if a is None:
                continue
            a = np.asarray(a)
            if a.ndim != 1 or a.shape[0] != n:
                raise EventLogError(
                    f"EventLog: {name} must be 1-D with the users' length {n}, got shape {a.shape}"
                )
            object.__setattr__(self, name, a)
        if not np.issubdtype(self.time.dtype, np.number):
            raise EventLogError(f"EventLog: time must be numeric, got dtype {self.time.dtype}")

    def __len__(self) -> int:
        return int(self.user.shape[0])

    def write_csv(self, path: str | os.PathLike, *, delimiter: str = ",") -> str:
        """Write the log as a delimited file with a header `user,item,time[,rating]`
        (what `read_events` reads with the default config); `.gz` is compressed."""
        path = os.fspath(path)
        cols = {"user": self.user, "item": self.item, "time": self.time}
        if self.rating is not None:
            cols["rating"] = self.rating
        with open_text(path, "wt") as f:
            f.write(delimiter.join(cols) + "\n")
            for start in range(0, len(self), 1 << 16):
                part = [np.asarray(c[start : start + (1 << 16)]).astype(str) for c in cols.values()]
                rows = part[0]
                for c in part[1:]:
                    rows = np.char.add(np.char.add(rows, delimiter), c)
                f.write("\n".join(rows.tolist()) + "\n")
        return path


def read_events(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    config: SequenceConfig | Mapping | None = None,
    *,
    strict: bool = False,
) -> tuple[EventLog, ParseReport]:
    """Read a delimited event log (one file or several, e.g. a headed part and a
    header-less continuation; gzip read transparently) into an `EventLog`.

    A column the config names but the file lacks is an `EventLogError` naming the file and
    the column. Malformed lines (wrong field count, empty id, a time or rating that does
    not parse) are skipped and counted in the `ParseReport` (`strict=True`: one raises,
    naming file:line, column and value; field counts and empty ids are checked file by
    file before times and ratings). Blank lines are ignored. A file whose lines are all
    well-formed is split in one pass over its text (about 1 s per million lines).
    """
    cfg = _as_config(config)
    files = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    if not files:
        raise EventLogError("read_events: no files given")
    parts, report, header = [], None, None
    for index, path in enumerate(files):
        cols, rep, header = _read_file(str(path), index, cfg, strict, header)
        parts.append(cols)
        report = rep if report is None else report.merge(rep)
    cat = {
        k: np.concatenate([p[k] for p in parts])
        if isinstance(parts[0][k], np.ndarray)
        else [x for p in parts for x in p[k]]
        for k in parts[0]
    }

    def where(k: int) -> str:
        return f"{files[cat['file'][k]]}:{cat['line'][k]}"

    # no time column: the file order (EventLog numbers the events it is given)
    times = None if cfg.time is None else _parse_times(cat["time"], where, cfg.time, strict)
    rating = None
    ok = np.ones(len(cat["user"]), bool) if times is None else ~np.isnan(times)
    if cfg.rating:
        rating = _parse_floats(cat["rating"], where, cfg.rating, strict)
        ok &= ~np.isnan(rating)
    errors = dict(report.errors)
    first = list(report.first_errors)
    for field, values in (("time", times), ("rating", rating)):
        if values is None:
            continue
        bad = np.flatnonzero(np.isnan(values))
        if bad.size:
            errors[f"bad_{field}"] = int(bad.size)
            col = getattr(cfg, field)
            for k in bad[: max(0, ParseReport.MAX_FIRST_ERRORS - len(first))]:
                first.append((int(cat["line"][k]), f"bad_{field}", col, str(cat[field][k])))
    kept = int(ok.sum())
    report = ParseReport(
        path=report.path if len(files) == 1 else f"{files[0]} (+{len(files) - 1} files)",
        lines_read=report.lines_read,
        lines_kept=report.lines_kept - (len(ok) - kept),
        errors=errors,
        first_errors=tuple(first),
    )
    log = EventLog(
        user=_ids(cat["user"])[ok],
        item=_ids(cat["item"])[ok],
        time=None if times is None else times[ok],
        rating=None if rating is None else rating[ok],
    )
    return log, report


def _as_config(config) -> SequenceConfig:
    if config is None:
        return SequenceConfig()
    if isinstance(config, SequenceConfig):
        return config
    return SequenceConfig.from_dict(config)


def _read_file(path: str, file_index: int, cfg: SequenceConfig, strict: bool, first_header):
    try:
        with open_text(path, "rt") as f:
            text = f.read()
    except FileNotFoundError:
        raise EventLogError(f"{path}: no such event log file") from None
    if "\r" in text:
        text = text.replace("\r\n", "\n")
    end = text.find("\n")
    line1 = text if end < 0 else text[:end]
    body, start = text, 0
    header = first_header
    if cfg.header:
        if first_header is None:
            if not text:
                raise EventLogError(f"{path}: empty file, expected a header line")
            header = line1.split(cfg.delimiter)
            body, start = ("" if end < 0 else text[end + 1 :]), 1
        elif text and line1.split(cfg.delimiter) == first_header:
            body, start = ("" if end < 0 else text[end + 1 :]), 1
    names = list(cfg.columns) if cfg.columns is not None else header
    for field in ("user", "item", "time", "rating"):
        col = getattr(cfg, field)
        if col is not None and col not in names:
            close = difflib.get_close_matches(col, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            if field == "time" and not close:
                hint = "; set time: null to order each user's events by the file order"
            raise EventLogError(
                f"{path}: the event log has no column {col!r} (data.events.{field}); "
                f"its columns are {names}{hint}"
            )
    n_fields = len(names)
    pos = {c: i for i, c in enumerate(names)}
    fields = [f for f in ("user", "item", "time", "rating") if getattr(cfg, f) is not None]
    wanted = [pos[getattr(cfg, f)] for f in fields]
    errors, first = {}, []
    fast = _split_columns(body, cfg.delimiter, n_fields, wanted)
    if fast is not None:  # every line well-formed: one split of the whole text
        n_lines = len(fast[0])
        line_no = np.arange(start + 1, start + 1 + n_lines)
        n_read = n_lines
        keep = np.arange(n_lines)
        cols = dict(zip(fields, fast, strict=True))
    else:
        rows = [line.split(cfg.delimiter) for line in body.splitlines()]
        line_no = np.arange(start + 1, start + 1 + len(rows))
        nonblank = np.fromiter((bool(r[0]) or len(r) > 1 for r in rows), bool, len(rows))
        counts = np.fromiter(map(len, rows), np.int64, len(rows))
        good = nonblank & (counts == n_fields)
        n_read = int(nonblank.sum())
        bad = np.flatnonzero(nonblank & ~good)
        if bad.size:
            k = bad[0]
            if strict:
                raise EventLogError(
                    f"{path}:{line_no[k]}: {counts[k]} fields, expected {n_fields} ({names})"
                )
            errors["field_count"] = int(bad.size)
            first = [
                (int(line_no[k]), "field_count", "(line)", f"{counts[k]} fields")
                for k in bad[: ParseReport.MAX_FIRST_ERRORS]
            ]
        keep = np.flatnonzero(good)
        cols = {f: [rows[k][j] for k in keep] for f, j in zip(fields, wanted, strict=True)}
    # an empty id is malformed
    empty = np.zeros(keep.size, bool)
    for field in ("user", "item"):
        if "" not in cols[field]:
            continue
        e = np.fromiter((x == "" for x in cols[field]), bool, keep.size)
        k = int(np.flatnonzero(e)[0])
        if strict:
            raise EventLogError(f"{path}:{line_no[keep[k]]}: empty {getattr(cfg, field)!r}")
        errors[f"empty_{field}"] = int(e.sum())
        room = ParseReport.MAX_FIRST_ERRORS - len(first)
        first += [
            (int(line_no[keep[k]]), f"empty_{field}", getattr(cfg, field), "")
            for k in np.flatnonzero(e)[: max(room, 0)]
        ]
        empty |= e
    if empty.any():
        good = np.flatnonzero(~empty)
        keep, cols = keep[good], {f: [c[k] for k in good] for f, c in cols.items()}
    cols["line"] = line_no[keep]
    cols["file"] = np.full(keep.size, file_index, np.int32)
    report = ParseReport(
        path=path,
        lines_read=n_read,
        lines_kept=int(keep.size),
        errors=errors,
        first_errors=tuple(first),
    )
    return cols, report, header


def _split_columns(body: str, delimiter: str, n_fields: int, wanted: list[int]):
    """The `wanted` columns of `body` (lists of strings) with one `str.split` of the whole
    text when every line has exactly `n_fields` fields (checked with numpy over the
    bytes); None when some line does not (or the delimiter is not ASCII), for the
    line-by-line path that reports each bad line."""
    if not body:
        return [[] for _ in wanted]
    if not delimiter.isascii():
        return None
    if not body.endswith("\n"):
        body += "\n"
    raw = np.frombuffer(body.encode(), np.uint8)
    newlines = np.flatnonzero(raw == 10)
    delims = np.flatnonzero(raw == ord(delimiter))
    per_line = np.diff(np.searchsorted(delims, newlines), prepend=0)
    if (per_line != n_fields - 1).any():
        return None
    flat = body[:-1].replace("\n", delimiter).split(delimiter)
    return [flat[j::n_fields] for j in wanted]


def _ids(raw: list[str]) -> np.ndarray:
    """Integer ids as int64 when every value is a decimal integer, else the strings."""
    try:
        return np.fromiter(map(int, raw), np.int64, len(raw))
    except ValueError:
        return np.array(raw, dtype=str)


def _first_unparsable(raw: np.ndarray, parse) -> np.ndarray:
    """bool mask of the values `parse` rejects, trying each distinct value once."""
    uniq, inv = np.unique(raw, return_inverse=True)
    bad = np.zeros(uniq.size, bool)
    for k, v in enumerate(uniq):
        try:
            parse(v)
        except ValueError:
            bad[k] = True
    return bad[inv]


def _parse_floats(raw: list[str], where, col: str, strict: bool) -> np.ndarray:
    try:
        out = np.fromiter(map(float, raw), np.float64, len(raw))
    except ValueError:
        arr = np.array(raw, dtype=str)
        bad = _first_unparsable(arr, float)
        out = np.full(arr.shape, np.nan)
        out[~bad] = arr[~bad].astype(np.float64)
    bad = ~np.isfinite(out)
    if bad.any() and strict:
        k = int(np.flatnonzero(bad)[0])
        raise EventLogError(f"{where(k)}: column {col!r}: value {raw[k]!r} is not a finite number")
    out[bad] = np.nan
    return out


def _parse_times(raw: list[str], where, col: str, strict: bool) -> np.ndarray:
    """Numbers as they are, or (when the first value is not a number) ISO dates/times as
    Unix seconds; values that do not parse are NaN (counted by the caller)."""
    if not raw:
        return np.zeros(0)
    try:
        float(raw[0])
        numeric = True
    except ValueError:
        numeric = False
    if numeric:
        return _parse_floats(raw, where, col, strict)

    def as_date(a):
        with warnings.catch_warnings():  # "...Z" (UTC) warns that numpy has no time zones
            warnings.simplefilter("ignore", UserWarning)
            return np.asarray(a).astype("datetime64[s]").astype(np.int64).astype(np.float64)

    arr = np.array(raw, dtype=str)
    try:
        return as_date(arr)
    except ValueError:
        pass
    bad = _first_unparsable(arr, as_date)
    if strict:
        k = int(np.flatnonzero(bad)[0])
        raise EventLogError(
            f"{where(k)}: column {col!r}: value {raw[k]!r} is not an ISO date/time like the "
            f"column's first value {raw[0]!r}"
        )
    out = np.full(arr.shape, np.nan)
    out[~bad] = as_date(arr[~bad])
    return out


# ---------------------------------------------------------------------------------------
# Candidate sets and the result


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
    cfg = _as_config(config)
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
    neg, r = _sample(
        np.random.default_rng([cfg.seed, 1]),
        u[train_idx],
        i[train_idx],
        k,
        n_items,
        _probs(cfg.sampler, item_counts, cfg.popularity_exponent),
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

    eval_probs = _probs(cfg.eval_sampler, item_counts, cfg.popularity_exponent)
    sets, empty = {}, 0
    for stream, which in ((2, _VALID), (3, _TEST)):
        idx = np.flatnonzero(role == which)
        if idx.size == 0:
            sets[which] = None
            continue
        neg, r = _sample(
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
    cfg = _as_config(config)
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
    t_test = _time_value("test_time", cfg.test_time)
    t_valid = _time_value("valid_time", cfg.valid_time)
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


# ---------------------------------------------------------------------------------------
# Negative sampling


def _probs(sampler: str, counts: np.ndarray, exponent: float) -> np.ndarray | None:
    """Cumulative sampling distribution over items, or None for uniform."""
    if sampler == "uniform":
        return None
    w = counts.astype(np.float64) ** exponent
    w[counts == 0] = 0.0
    total = w.sum()
    if total <= 0:
        return None
    cdf = np.cumsum(w / total)
    cdf[-1] = 1.0
    return cdf


def _draw(rng: np.random.Generator, shape, n_items: int, cdf: np.ndarray | None) -> np.ndarray:
    if cdf is None:
        return rng.integers(0, n_items, shape, dtype=np.int64)
    return np.minimum(np.searchsorted(cdf, rng.random(shape), side="right"), n_items - 1)


def _is_seen(keys: np.ndarray | None, users: np.ndarray, items: np.ndarray, n_items: int):
    if keys is None or keys.size == 0:
        return np.zeros(items.shape, bool)
    q = users * n_items + items
    at = np.minimum(np.searchsorted(keys, q), keys.size - 1)
    return keys[at] == q


def _duplicates(neg: np.ndarray) -> np.ndarray:
    """bool mask of entries equal to an earlier-sorted entry of the same row."""
    order = np.argsort(neg, axis=1, kind="stable")
    s = np.take_along_axis(neg, order, axis=1)
    dup_sorted = np.zeros(neg.shape, bool)
    dup_sorted[:, 1:] = s[:, 1:] == s[:, :-1]
    out = np.zeros(neg.shape, bool)
    np.put_along_axis(out, order, dup_sorted, axis=1)
    return out


def _sample(
    rng: np.random.Generator,
    users: np.ndarray,
    positives: np.ndarray,
    k: int,
    n_items: int,
    cdf: np.ndarray | None,
    seen_keys: np.ndarray | None,
    *,
    distinct: bool,
) -> tuple[np.ndarray, int]:
    """`[n, k]` negatives: never the positive, outside `seen_keys` (user * n_items + item)
    and (if `distinct`) distinct within a row, by vectorized rejection; the few rows that
    rejection cannot fill (users who saw nearly every item) are filled exactly, relaxing
    the seen rule, then the sampler. Returns (negatives, rows relaxed)."""
    n = users.shape[0]
    if k == 0 or n == 0:
        return np.zeros((n, k), np.int64), 0
    neg = _draw(rng, (n, k), n_items, cdf)

    def bad_of(rows):
        nb = neg[rows]
        bad = (nb == positives[rows, None]) | _is_seen(seen_keys, users[rows, None], nb, n_items)
        if distinct and k > 1:
            bad |= _duplicates(nb)
        return bad

    rows = np.arange(n)
    for _ in range(_REJECTION_ROUNDS):
        bad = bad_of(rows)
        hit = bad.any(axis=1)
        rows, bad = rows[hit], bad[hit]
        if rows.size == 0:
            return neg, 0
        sub = neg[rows]
        sub[bad] = _draw(rng, int(bad.sum()), n_items, cdf)
        neg[rows] = sub
    rows = rows[bad_of(rows).any(axis=1)]
    relaxed = 0
    for row in rows:  # rare: a user who has seen (nearly) every item, or a skewed sampler
        relaxed += _fill_row(
            rng, neg, row, users[row], positives[row], k, n_items, seen_keys, distinct
        )
    return neg, relaxed


def _fill_row(rng, neg, row, user, positive, k, n_items, seen_keys, distinct) -> int:
    """Fill one row exactly (uniform over what is allowed); 1 if a rule had to give."""
    allowed = np.ones(n_items, bool)
    allowed[positive] = False
    if seen_keys is not None:
        lo, hi = np.searchsorted(seen_keys, [user * n_items, (user + 1) * n_items])
        allowed[seen_keys[lo:hi] - user * n_items] = False
    pool = np.flatnonzero(allowed)
    relaxed = False
    if pool.size < (k if distinct else 1):
        relaxed = True  # not enough unseen items: any item but the positive
        pool = np.delete(np.arange(n_items), positive)
    repeat = not distinct or pool.size < k
    neg[row] = rng.choice(pool, k, replace=repeat)
    return int(relaxed or (distinct and repeat))


def synthetic_events(
    *,
    num_users: int = 1000,
    num_items: int = 500,
    num_categories: int = 20,
    preferred: int = 3,
    events_per_user: tuple[int, int] = (10, 40),
    stickiness: float = 0.7,
    noise: float = 0.1,
    popularity_skew: float = 1.0,
    seed: int = 0,
) -> EventLog:
    """A generated implicit-feedback log with learnable structure: item `i` has category
    `i % num_categories`; each user prefers `preferred` categories and moves between
    them (staying in its current category with probability `stickiness`; a uniformly
    random category with probability `noise`); within a category items are drawn with
    Zipf(`popularity_skew`) popularity. So the next item depends on the recent history
    (what target attention can use) and on popularity (what a popularity baseline uses).
    Users are numbered 0.., times are seconds from 1.7e9, one event per user and second.
    """
    rng = np.random.default_rng([seed, 0xE7])
    lo, hi = events_per_user
    lengths = rng.integers(lo, hi + 1, num_users)
    prefs = np.stack(
        [rng.choice(num_categories, preferred, replace=False) for _ in range(num_users)]
    )
    steps = int(lengths.max())
    # the category path of every user, one step at a time over users (vectorized)
    cat = np.empty((num_users, steps), np.int64)
    cur = prefs[np.arange(num_users), rng.integers(0, preferred, num_users)]
    for t in range(steps):
        move = rng.random(num_users) >= stickiness
        cur = np.where(
            move, prefs[np.arange(num_users), rng.integers(0, preferred, num_users)], cur
        )
        noisy = rng.random(num_users) < noise
        cat[:, t] = np.where(noisy, rng.integers(0, num_categories, num_users), cur)
    per_cat = num_items // num_categories
    w = 1.0 / np.arange(1, per_cat + 1) ** popularity_skew
    rank = rng.choice(per_cat, cat.shape, p=w / w.sum())
    item = rank * num_categories + cat
    keep = np.arange(steps)[None, :] < lengths[:, None]
    user = np.broadcast_to(np.arange(num_users)[:, None], cat.shape)[keep]
    time = 1.7e9 + np.broadcast_to(np.arange(steps)[None, :], cat.shape)[keep]
    return EventLog(user=user, item=item[keep], time=time.astype(np.float64))


def popularity_scores(data: SequenceData, sets: CandidateSets) -> np.ndarray:
    """`[M, 1 + K]` scores of the popularity baseline (train count of each candidate),
    to compare a model's HR/NDCG with."""
    return data.item_counts[sets.items].astype(np.float64)


__all__ = [
    "CandidateSets",
    "EventLog",
    "EventLogError",
    "SequenceConfig",
    "SequenceData",
    "SequenceReport",
    "build_sequences",
    "load_sequences",
    "popularity_scores",
    "read_events",
    "synthetic_events",
]
