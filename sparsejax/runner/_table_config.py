"""The `tables` section of a run's config (`TableConfig` and its parts): validated at
load (`check_tables_config`), each table's options resolved over `"*"` (`resolve_table`)."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Literal

from ..embedding import BloomAdmission, CountAdmission, DynamicVocab, Eviction
from ._config import ConfigError, _number, from_dict, to_dict
from ._data_config import DataConfig, _config_table_names, _table_of, _table_options
from ._options import check_range, parse_bytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class BloomConfig:
    """A counting Bloom filter for admission (`tables.<name>.admission.bloom`): memory
    bounded by `counters` bytes whatever the ID space; a false positive admits an ID
    early, never late."""

    counters: int | None = None
    """Counters of the filter, one byte each (null: 16777216); ~10x the distinct IDs seen
    keeps false positives rare."""
    hashes: int | None = None
    """Hash functions, counters each ID touches (null: 3)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdmissionConfig:
    """When a new ID of a dynamic table gets a trainable row (`tables.<name>.admission`);
    until then it reads the default row and receives no update."""

    min_count: int | None = None
    """Times an ID must be seen before it gets a row (null: 1, every ID at first sight;
    2 with `bloom`)."""
    bloom: BloomConfig | None = None
    """Count with a counting Bloom filter (bounded memory, for very large ID spaces)
    instead of exact counts, e.g. `{counters: 16777216, hashes: 3}` (`{}`: its defaults);
    null: exact counts."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ComposeConfig:
    """A static table stored as smaller ones whose rows combine per id
    (`tables.<name>.compose`; `sparsejax.embedding.Composition`), e.g.
    `{kind: qr, fraction: 0.25}` or `{kind: multihash, hashes: 2, fraction: 0.1}`."""

    kind: Literal["qr", "multihash"]
    """"qr": quotient-remainder, row(id) = Q[id // m] (op) R[id % m], no two ids share
    both rows; "multihash": `hashes` tables indexed by independent hashes of the id
    (`hashes: 1`: the hashing trick)."""
    rows: int | None = None
    """qr: the remainder rows m; multihash: the rows of each hashed table (null: from
    `fraction`; qr without either: ceil(sqrt(V)), the fewest rows)."""
    fraction: float | None = None
    """Memory budget, a fraction of the full table's (qr: the most rows within it, or
    the fewest Q-R allows for a table too small to meet it)."""
    hashes: int | None = None
    """multihash: number of hashed tables (null: 2)."""
    op: Literal["mul", "add", "concat"] | None = None
    """How the parts' rows combine (null: "mul"; "concat" splits the dim over them)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvictionConfig:
    """Which IDs of a dynamic table lose their rows (`tables.<name>.eviction`), their rows
    and optimizer slots reused by new IDs. Runs every `every_steps` and before every
    checkpoint."""

    ttl_steps: int | None = None
    """Evict IDs not seen for this many steps (null: never by age)."""
    min_norm: float | None = None
    """Evict IDs whose row's L2 norm is below this (null: never by norm)."""
    every_steps: int | None = None
    """Steps between runs of the policy (null: 1000)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TableConfig:
    """Options of one embedding table (`tables.<name>`, the name of the table: the column's
    own, or the one `data.features.<column>.table` names), or of every table
    (`tables."*"`). A table's own entry wins key by key over `"*"` (null keeps the `"*"`
    value); options of `"*"` that do not apply to a table (dynamic options on a static
    table, cache options without a cache) are ignored for it, while a table's own entry
    that sets them is an error. Supersedes `data.features.<column>.dim` and
    `hash_buckets`, which still work (a table's own entry and its columns' options must
    agree)."""

    dim: int | None = None
    """Row width (null: the columns' `data.features.<column>.dim`, else
    `model.embedding_dim`)."""
    vocab_size: int | None = None
    """Rows of a static table: its columns' raw IDs hashed into that many buckets (row 0
    the missing value; as `data.features.<column>.hash_buckets`); null: as `data.id_mapping`
    says. File data."""
    dynamic: bool | None = None
    """Keyed by raw 64-bit IDs, with no vocabulary and no hash collisions: rows are created
    while training runs (`admission`) and reused after `eviction`. Needs a device size:
    `cache_rows` or `max_rows`. The rows start U(+-sqrt(1/n)), n the rows a vocabulary of
    the train IDs seen `data.min_count` times would have (the static table's scale;
    streams: `max_rows`, else the cache rows); `model.embedding_init` overrides it.
    Synthetic and file data (not events or behavior)."""
    cache_rows: int | float | None = None
    """Rows of the device cache: every row and optimizer slot lives in a host store
    (`ram_bytes`, `disk_dir`), the hot rows on the device. An int is a row count; a float
    in (0, 1] that fraction of the table's distinct train IDs (file data read into
    memory), at least the IDs one batch can hold (or all of them when fewer) so every
    batch fits; 0: no cache (to opt one table out of a `"*"` cache)."""
    max_rows: int | None = None
    """Dynamic: rows at most (null: unbounded, limited by host memory and disk); without a
    cache the device holds this many rows."""
    admission: AdmissionConfig | None = None
    """Dynamic: when a new ID gets a row, e.g. `{min_count: 2}` (null: at first sight)."""
    eviction: EvictionConfig | None = None
    """Dynamic: which IDs lose their rows, e.g. `{ttl_steps: 10000}` (null: none)."""
    when_full: Literal["error", "evict", "default_row"] | None = None
    """Dynamic, a new ID at `max_rows`: "error" (naming the table), "evict" the least
    frequently seen IDs not in the batch, or read the default row (null: "error")."""
    default_row: Literal["zeros", "trainable"] | None = None
    """Dynamic: what IDs without a row read: zeros (never updated) or one shared trainable
    row (null: "zeros")."""
    cache_policy: Literal["lru", "lfu"] | None = None
    """Which cached rows make room for a batch's misses (never a row the batch uses; null:
    "lru")."""
    ram_bytes: int | str | None = None
    """Host RAM for the table's rows and slots, in bytes or as "8GiB" / "500MB"; beyond it
    rows go to memory-mapped files in `disk_dir` (null: unbounded RAM)."""
    disk_dir: str | None = None
    """Directory of the disk tier (beyond `ram_bytes`), relative to the run directory
    unless absolute; each table's files go to a subdirectory of its own (null:
    `host_rows` in the run directory)."""
    placement: (
        Literal[
            "auto", "host", "replicated", "table_wise", "column_wise", "table_row_wise", "row_wise"
        ]
        | None
    ) = None
    """Where the table lives on the run's devices (`sharding`): "auto" (null) lets the
    planner choose; "host" keeps it in host memory, looked up and updated by the host's
    CPU beside the dense network on the devices (pipelined with the device's step; not
    with mesh placements or many processes); the others pin it: "replicated" (a copy
    on every device),
    "table_wise" (whole on one device of each host, i.e. one index of the "model" axis),
    "column_wise" (its columns split over "model"; the dim must divide), "table_row_wise"
    (its rows split over "model"), "row_wise" (its rows split over every device). A run
    with a pinned table shards even on one device. `sparsejax plan CONFIG` prints the
    plan."""
    compose: ComposeConfig | None = None
    """Store a static table as smaller ones (quotient-remainder or multi-hash) to cut its
    memory, e.g. `{kind: qr, fraction: 0.25}` (null: whole). Not with `dynamic` or
    `cache_rows`."""


_DYNAMIC_ONLY = ("max_rows", "admission", "eviction", "when_full", "default_row")
"""`TableConfig` fields that only a dynamic table takes."""


_CACHE_ONLY = ("cache_policy", "ram_bytes", "disk_dir")
"""`TableConfig` fields that only a table with a device cache takes."""


_HASHED_KINDS = ("criteo", "delimited", "libsvm", "parquet")
"""File data kinds whose ids the runner maps (vocabulary, hash buckets or raw keys)."""


_DYNAMIC_KINDS = ("synthetic", "prepared", *_HASHED_KINDS)
"""Data kinds whose tables may be dynamic (raw ids as keys)."""


def _cache_rows_value(value, key: str) -> int | float | None:
    """`cache_rows` keeps its YAML type: an int is rows (>= 0), a float a fraction in
    (0, 1] (so `1.0` is the whole table and `1` one row)."""
    if value is None:
        return None
    if isinstance(value, str):
        value = _number(value.strip())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(
            f"config key {key!r}: expected rows (an int) or a fraction in (0, 1] of the "
            f"table's distinct train IDs (a float), got {value!r}"
        )
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"config key {key!r} must be >= 0 rows, got {value}")
        return value
    if not 0 < value <= 1:
        raise ConfigError(
            f"config key {key!r}: a float is a fraction in (0, 1] of the table's distinct "
            f"train IDs, got {value!r} (write an int for a row count)"
        )
    return float(value)


def _table_config(opts, prefix: str) -> TableConfig:
    """One `tables` entry (a mapping) as a checked `TableConfig`; errors name the key."""
    if isinstance(opts, TableConfig):
        opts = to_dict(opts)
    if opts is None:
        opts = {}
    if not isinstance(opts, Mapping):
        raise ConfigError(f"{prefix}: expected a mapping of table options, got {opts!r}")
    opts = dict(opts)
    cache_rows = _cache_rows_value(opts.pop("cache_rows", None), f"{prefix}.cache_rows")
    tc = from_dict(TableConfig, opts, prefix=prefix + ".")
    positive = {
        "dim": (tc.dim, 1),
        "vocab_size": (tc.vocab_size, 2),
        "max_rows": (tc.max_rows, 1),
    }
    if tc.admission is not None:
        positive["admission.min_count"] = (tc.admission.min_count, 1)
        if tc.admission.bloom is not None:
            positive["admission.bloom.counters"] = (tc.admission.bloom.counters, 1)
            positive["admission.bloom.hashes"] = (tc.admission.bloom.hashes, 1)
            if (tc.admission.min_count or 0) > 255:
                raise ConfigError(
                    f"{prefix}.admission.min_count must be <= 255 with bloom (one-byte "
                    f"counters), got {tc.admission.min_count}"
                )
    if tc.eviction is not None:
        positive["eviction.ttl_steps"] = (tc.eviction.ttl_steps, 1)
        positive["eviction.every_steps"] = (tc.eviction.every_steps, 1)
        if tc.eviction.min_norm is not None and not tc.eviction.min_norm >= 0:
            raise ConfigError(
                f"{prefix}.eviction.min_norm must be >= 0, got {tc.eviction.min_norm!r}"
            )
    for k, (v, lo) in positive.items():
        if v is not None and v < lo:
            raise ConfigError(f"{prefix}.{k} must be >= {lo}, got {v}")
    if tc.compose is not None:
        for k, rule in (("rows", ">=1"), ("fraction", "(0,1]"), ("hashes", ">=1")):
            check_range(f"{prefix}.compose.{k}", getattr(tc.compose, k), rule)
    ram = None if tc.ram_bytes is None else parse_bytes(tc.ram_bytes, f"{prefix}.ram_bytes")
    return dataclasses.replace(tc, cache_rows=cache_rows, ram_bytes=ram)


def _merge_options(star, own):
    """`own` over `star`, key by key (nested sections too); None is unset."""
    if star is None or own is None:
        return own if star is None else star
    if not dataclasses.is_dataclass(own):
        return own
    out = {}
    for f in dataclasses.fields(own):
        a, b = getattr(star, f.name), getattr(own, f.name)
        out[f.name] = (
            _merge_options(a, b) if dataclasses.is_dataclass(b) else (a if b is None else b)
        )
    return type(own)(**out)


def resolve_table(tables: Mapping[str, TableConfig], name: str) -> TableConfig:
    """The options of table `name`: its own entry over `"*"`, key by key, with the `"*"`
    options that do not apply to it dropped. A table's own entry setting an option that
    does not apply (or a `"*"` entry inconsistent in itself) is a `ConfigError` naming
    the key."""
    own = tables.get(name)
    star = None if name == "*" else tables.get("*")
    tc = _merge_options(star, own) or TableConfig()

    def mine(key: str) -> bool:
        return own is not None and getattr(own, key) is not None

    def where(key: str) -> str:
        return f"tables.{name if mine(key) else '*'}.{key}"

    dynamic, cached = bool(tc.dynamic), bool(tc.cache_rows)
    drop: dict = {}
    for keys, applies, need in (
        (_DYNAMIC_ONLY, dynamic, ("a dynamic table", "dynamic: true")),
        (_CACHE_ONLY, cached, ("a table with a device cache", "cache_rows")),
    ):
        for k in keys:
            if getattr(tc, k) is None or applies:
                continue
            if mine(k):
                raise ConfigError(f"{where(k)} is for {need[0]}; set tables.{name}.{need[1]}")
            drop[k] = None
    if dynamic and tc.vocab_size is not None:
        if mine("vocab_size"):
            raise ConfigError(
                f"tables.{name}.vocab_size: table {name!r} is dynamic ({where('dynamic')}) "
                f"and has no vocabulary; bound it with max_rows, or set dynamic: false"
            )
        drop["vocab_size"] = None
    if tc.compose is not None and (dynamic or cached):
        if mine("compose"):
            raise ConfigError(
                f"tables.{name}.compose: a dynamic or host-cached table cannot be composed "
                f"(its ids are raw keys); set dynamic: false and cache_rows: 0, or drop compose"
            )
        drop["compose"] = None
    if dynamic and not cached and tc.max_rows is None:
        raise ConfigError(
            f"tables.{name}: a dynamic table needs a device size: set tables.{name}.cache_rows"
            f" (rows, or a fraction of its distinct train IDs) or tables.{name}.max_rows"
        )
    tc = dataclasses.replace(tc, **drop)
    if dynamic:
        _dynamic_vocab(tc, name)  # the spec's own checks, at load
    return tc


def _dynamic_vocab(tc: TableConfig, name: str) -> DynamicVocab:
    """The `DynamicVocab` of a resolved dynamic table's options (unset options: the
    spec's defaults); the spec's own errors name the table."""
    adm = tc.admission or AdmissionConfig()
    try:
        if adm.bloom is not None:
            kw = {"min_count": adm.min_count, **dataclasses.asdict(adm.bloom)}
            admission = BloomAdmission(**{k: v for k, v in kw.items() if v is not None})
        else:
            kw = {"min_count": adm.min_count}
            admission = CountAdmission(**{k: v for k, v in kw.items() if v is not None})
        eviction = None
        if tc.eviction is not None:
            kw = dataclasses.asdict(tc.eviction)
            eviction = Eviction(**{k: v for k, v in kw.items() if v is not None})
        kw = {"when_full": tc.when_full, "default_row": tc.default_row, "max_rows": tc.max_rows}
        return DynamicVocab(
            admission=admission,
            eviction=eviction,
            **{k: v for k, v in kw.items() if v is not None},
        )
    except (TypeError, ValueError) as e:
        raise ConfigError(f"tables.{name}: {e}") from None


def _unknown_table(name: str, names) -> ConfigError:
    close = difflib.get_close_matches(name, sorted(names), n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(
        f"config key 'tables.{name}': the run has no table {name!r}{hint} "
        f"(tables: {sorted(names)}, or '*' for every table)"
    )


def _check_id_space_tables(d: DataConfig, tables: Mapping[str, TableConfig]) -> None:
    """`data.synthetic_options.id_space` makes the ids raw keys of a huge space: every
    table must be dynamic (a `ConfigError` naming the first static one)."""
    names = sorted(_config_table_names(d), key=lambda n: (len(n), n))
    static = [n for n in names if not resolve_table(tables, n).dynamic]
    if static:
        raise ConfigError(
            f"data.synthetic_options.id_space={d.synthetic_options['id_space']}: the ids are "
            f"raw keys for dynamic tables, but table {static[0]!r} is static; set "
            f"tables.'*'.dynamic: true (with cache_rows)"
        )


def check_tables_config(tables, d: DataConfig) -> dict[str, TableConfig]:
    """The `tables` section of a run over data `d`, validated: entries become
    `TableConfig`s (`ram_bytes` in bytes); unknown keys and table names, options that do
    not apply, and what the data kind cannot give are `ConfigError`s naming the key."""
    if not isinstance(tables, Mapping):
        raise ConfigError(
            f"config key 'tables': expected a mapping {{table: options}}, got {tables!r}"
        )
    tables = {str(k): _table_config(v, f"tables.{k}") for k, v in tables.items()}
    if d.kind == "synthetic" and d.synthetic_options.get("id_space") is not None:
        _check_id_space_tables(d, tables)
    if not tables:
        return tables
    names = _config_table_names(d)
    if names is not None:
        for name in tables:
            if name != "*" and name not in names:
                raise _unknown_table(name, names)
    for name, tc in tables.items():  # what the data kind cannot give, where it is set
        if tc.dynamic and d.kind not in _DYNAMIC_KINDS:
            raise ConfigError(
                f"tables.{name}.dynamic: dynamic tables need data.kind one of "
                f"{list(_DYNAMIC_KINDS)}, not {d.kind!r}"
            )
        if tc.vocab_size is not None and d.kind not in _HASHED_KINDS:
            raise ConfigError(
                f"tables.{name}.vocab_size: hash buckets are for file data; data.kind="
                f"{d.kind!r} sets its own vocabularies"
                + (" (data.max_vocab, data.synthetic_options)" if d.kind == "synthetic" else "")
            )
        if isinstance(tc.cache_rows, float) and (
            d.kind not in (*_HASHED_KINDS, "prepared") or d.stream
        ):
            what = "data.stream" if d.stream else f"data.kind={d.kind!r}"
            raise ConfigError(
                f"tables.{name}.cache_rows={tc.cache_rows}: a fraction of the distinct train "
                f"IDs needs file data read into memory ({what}); give a row count (an int)"
            )
    check = sorted(names) if names is not None and "*" in tables else []
    check += [n for n in tables if n not in check]
    feats = _table_options(d.features) if d.kind != "events" else {}
    for name in check:
        tc = resolve_table(tables, name)
        if name == "*":
            continue  # checked in itself; every table it applies to is checked below
        own = tables.get(name) or TableConfig()
        for key, old in (("dim", "dim"), ("vocab_size", "hash_buckets")):
            a, b = getattr(own, key), feats.get(name, {}).get(old)
            if a is not None and b is not None and a != b:
                raise ConfigError(
                    f"tables.{name}.{key}={a} and data.features (table {name!r}) {old}={b} "
                    f"disagree; set it once (tables.{name}.{key})"
                )
        if tc.dynamic and feats.get(name, {}).get("hash_buckets") is not None:
            col = next(
                c
                for c, fc in d.features.items()
                if _table_of(d, c) == name and fc.hash_buckets is not None
            )
            raise ConfigError(
                f"data.features.{col}.hash_buckets: table {name!r} is dynamic (raw IDs as "
                f"keys, no hashing); remove it"
            )
    return tables
