"""The event log: `EventLog` (raw `(user, item[, time[, rating]])` events as arrays),
`read_events` (one delimited file or several, split block by block by the package's
delimited reader, `delimited_fields`; ids, times and ratings converted here, since a log
keeps raw ids and dates), and `synthetic_events` (a generated log with learnable
structure). `build_sequences` (`_sequences.py`) makes examples of a log."""

from __future__ import annotations

import dataclasses
import difflib
import os
import warnings
from collections.abc import Mapping, Sequence

import numpy as np

from ._csv import ParseErrors, ParseReport, delimited_fields, open_text
from ._event_config import EventLogError, SequenceConfig, as_config
from ._files import first_line, iter_line_blocks, line1_bytes, open_file
from ._text import TextFields


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
    file before times and ratings). Blank lines are ignored. Files are split by the
    package's delimited reader, block by block (about 1 s per million lines).
    """
    cfg = as_config(config)
    files = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    if not files:
        raise EventLogError("read_events: no files given")
    parts, file_of, report, header = [], [], None, None
    for index, path in enumerate(files):
        fields, rep, header = _read_file(str(path), cfg, strict, header)
        parts.append(fields)
        file_of.append(np.full(len(fields), index, np.int32))
        report = rep if report is None else report.merge(rep)
    columns = [f for f in ("user", "item", "time", "rating") if getattr(cfg, f) is not None]
    cat = TextFields.concat(parts, len(columns))
    file_of = np.concatenate(file_of)
    j = {f: columns.index(f) for f in columns}

    def where(k: int) -> str:
        return f"{files[file_of[k]]}:{cat.lines[k]}"

    # no time column: the file order (EventLog numbers the events it is given)
    times = None if cfg.time is None else _parse_times(cat, j["time"], where, cfg.time, strict)
    rating = None
    ok = np.ones(len(cat), bool) if times is None else ~np.isnan(times)
    if cfg.rating:
        rating = _parse_floats(cat, j["rating"], where, cfg.rating, strict)
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
                first.append((int(cat.lines[k]), f"bad_{field}", col, cat.value(k, j[field])))
    kept = int(ok.sum())
    report = ParseReport(
        path=report.path if len(files) == 1 else f"{files[0]} (+{len(files) - 1} files)",
        lines_read=report.lines_read,
        lines_kept=report.lines_kept - (len(ok) - kept),
        errors=errors,
        first_errors=tuple(first),
    )
    log = EventLog(
        user=_ids(cat, j["user"])[ok],
        item=_ids(cat, j["item"])[ok],
        time=None if times is None else times[ok],
        rating=None if rating is None else rating[ok],
    )
    return log, report


def _read_file(path: str, cfg: SequenceConfig, strict: bool, first_header):
    """One file's columns (user, item[, time][, rating]) as `TextFields`, its
    `ParseReport` and the header: split block by block by the delimited reader
    (`delimited_fields`); field counts, then empty ids, are checked here."""
    try:
        line1 = first_line(path)
    except FileNotFoundError:
        raise EventLogError(f"{path}: no such event log file") from None
    header, skip = first_header, 0
    if cfg.header:
        head = line1.decode(errors="replace").split(cfg.delimiter)
        if first_header is None:
            if not line1 and _is_empty(path):
                raise EventLogError(f"{path}: empty file, expected a header line")
            header, skip = head, line1_bytes(path)
        elif line1 and head == first_header:
            skip = line1_bytes(path)
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
    wanted = [names.index(c) for c in cfg.used_columns]
    errs = ParseErrors(path, strict=False)  # strict: this reader raises its own message
    parts, n_read = [], 0
    for block in iter_line_blocks(path, start_offset=skip, start_line=1 + (skip > 0)):
        fields, n = delimited_fields(
            block.data, cfg.delimiter, len(names), wanted, first_line=block.first_line, errs=errs
        )
        parts.append(fields)
        n_read += n
    if strict and errs.first:
        line, _, _, value = errs.first[0]
        raise EventLogError(f"{path}:{line}: {value}, expected {len(names)} ({names})")
    fields = TextFields.concat(parts, len(wanted))
    # an empty id is malformed
    empty = np.zeros(len(fields), bool)
    for j, field in enumerate(("user", "item")):
        e = fields.length[:, j] == 0
        if not e.any():
            continue
        bad = fields.lines[e]
        if strict:
            raise EventLogError(f"{path}:{bad[0]}: empty {getattr(cfg, field)!r}")
        errs.add_many(bad, f"empty_{field}", getattr(cfg, field), [""] * bad.size)
        empty |= e
    fields = fields.take(np.flatnonzero(~empty))
    return fields, errs.report(n_read, len(fields)), header


def _is_empty(path: str) -> bool:
    with open_file(path) as f:
        return not f.read(1)


def _ids(fields: TextFields, j: int) -> np.ndarray:
    """Integer ids as int64 when every value is a decimal integer, else the strings."""
    ints = fields.ints(j)
    return fields.strings(j) if ints is None else ints


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


def _parse_floats(fields: TextFields, j: int, where, col: str, strict: bool) -> np.ndarray:
    out = fields.floats(j)
    bad = ~np.isfinite(out)
    if bad.any() and strict:
        k = int(np.flatnonzero(bad)[0])
        raise EventLogError(
            f"{where(k)}: column {col!r}: value {fields.value(k, j)!r} is not a finite number"
        )
    out[bad] = np.nan
    return out


def _parse_times(fields: TextFields, j: int, where, col: str, strict: bool) -> np.ndarray:
    """Numbers as they are, or (when the first value is not a number) ISO dates/times as
    Unix seconds; values that do not parse are NaN (counted by the caller)."""
    if len(fields) == 0:
        return np.zeros(0)
    try:
        float(fields.value(0, j))
        numeric = True
    except ValueError:
        numeric = False
    if numeric:
        return _parse_floats(fields, j, where, col, strict)

    def as_date(a):
        with warnings.catch_warnings():  # "...Z" (UTC) warns that numpy has no time zones
            warnings.simplefilter("ignore", UserWarning)
            return np.asarray(a).astype("datetime64[s]").astype(np.int64).astype(np.float64)

    arr = fields.strings(j)
    try:
        return as_date(arr)
    except ValueError:
        pass
    bad = _first_unparsable(arr, as_date)
    if strict:
        k = int(np.flatnonzero(bad)[0])
        raise EventLogError(
            f"{where(k)}: column {col!r}: value {str(arr[k])!r} is not an ISO date/time like "
            f"the column's first value {str(arr[0])!r}"
        )
    out = np.full(arr.shape, np.nan)
    out[~bad] = as_date(arr[~bad])
    return out


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
