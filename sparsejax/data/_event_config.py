"""`SequenceConfig`: how an event log becomes sequence examples (`data.events` in a run
config), checked when it is made; and `EventLogError`, the one error of the event-log
readers and builders."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from ._options import options_from_dict

SPLITS = ("leave_last_out", "time")
SAMPLERS = ("uniform", "popularity")


class EventLogError(ValueError):
    """A problem with an event log or its options; the message names the file, column or
    key."""


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
                time_value("valid_time", self.valid_time),
                time_value("test_time", self.test_time),
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


def time_value(name: str, value) -> float | None:
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


def as_config(config: SequenceConfig | Mapping | None) -> SequenceConfig:
    """A `SequenceConfig` from itself, its dict, or None (the defaults)."""
    if config is None:
        return SequenceConfig()
    if isinstance(config, SequenceConfig):
        return config
    return SequenceConfig.from_dict(config)
