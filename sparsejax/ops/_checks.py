"""Validation, twice: shapes and dtypes at trace time; values (ids out of range,
unsorted segments, non-finite weights) on concrete arrays.

Value checks run on every eager call (concrete inputs) and, inside `jit`, only when
checked mode is on (`set_checks(True)`, `with checks():` or `SPARSEJAX_CHECKS=1`),
through a host callback. The fast kernels never read out of bounds either way: an
id outside `[0, vocab)` contributes nothing. Checked mode turns that into an error
that names the table, the position and the id.

An error raised in a host callback reaches the caller of the jitted function as a
`jax.errors.JaxRuntimeError` whose message is the callback's whole traceback. The
callback records the error it raised; `surface_check_errors()` (which `checks()` and
the trainer's steps apply) re-raises such a runtime error as the recorded one-line
`IndexError` / `ValueError`. In a program that spans several devices the callback
must not raise (it would end one device's part of the program, and the others would
wait for it in their next collective forever): there the check is deferred
(`check_lookups(..., defer=True)`): the callback records the error, the program runs
on (such an id looks up nothing, as without checks) and `surface_check_errors()`
raises the error when it exits.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np

from . import _sharding

_CHECKS = os.environ.get("SPARSEJAX_CHECKS", "0") not in ("", "0", "false", "False")


def set_checks(enabled: bool) -> None:
    """Turn value checks inside `jit` on or off (eager calls are always checked)."""
    global _CHECKS
    _CHECKS = bool(enabled)


def checks_enabled() -> bool:
    return _CHECKS


@contextlib.contextmanager
def checks(enabled: bool = True):
    """Context manager form of `set_checks`; applies to functions traced inside it.

    A value check that fails in a jitted call made inside it is raised as the check's
    one-line `IndexError` / `ValueError` (`surface_check_errors`)."""
    global _CHECKS
    previous, _CHECKS = _CHECKS, bool(enabled)
    try:
        with surface_check_errors():
            yield
    finally:
        _CHECKS = previous


# (type, message) of the errors the checked-mode callbacks raised lately (callbacks may
# run on XLA's threads; no traceback kept, so no frame and its arrays stays alive)
_FAILED: collections.deque[tuple[type, str]] = collections.deque(maxlen=16)
_PENDING: list[tuple[type, str]] = []  # the deferred ones not raised yet
_FAILED_LOCK = threading.Lock()


def check_error(error: BaseException) -> Exception | None:
    """The failed value check `error` (a `JaxRuntimeError`) carries, as a fresh one-line
    exception of the check's type; None if it carries none."""
    if not isinstance(error, jax.errors.JaxRuntimeError):
        return None
    text = str(error)
    with _FAILED_LOCK:
        for kind, message in reversed(_FAILED):
            if message in text:
                return kind(message)
    return None


@contextlib.contextmanager
def surface_check_errors():
    """Context manager (or decorator): a value check of checked mode that fails inside
    a jitted call comes out as the check's one-line `IndexError` / `ValueError` (naming
    the table, id and position), not as the `jax.errors.JaxRuntimeError` holding the
    host callback's traceback. Other errors pass unchanged.

    A deferred check (`check_lookups(..., defer=True)`, in programs that span several
    devices) that failed is raised when it exits (the first one, once).

    Example::

        with sparsejax.ops.surface_check_errors():
            out = jax.block_until_ready(step(state, batch))
    """
    try:
        yield
    except jax.errors.JaxRuntimeError as e:
        found = check_error(e)
        if found is None:
            raise
        raise found from None
    with _FAILED_LOCK:
        pending = _PENDING[:1]
        _PENDING.clear()
    if pending:
        kind, message = pending[0]
        raise kind(message)


def require(cond: bool, op: str, message: str) -> None:
    if not cond:
        raise ValueError(f"sparsejax.ops.{op}: {message}")


def check_array(op: str, name: str, x, *, ndim: int | None = None, kind: str | None = None):
    """Trace-time check of one argument's rank and dtype kind ('int' or 'float')."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"sparsejax.ops.{op}: `{name}` must be an array, got {type(x).__name__}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(
            f"sparsejax.ops.{op}: `{name}` must have rank {ndim}, got shape {tuple(x.shape)}"
        )
    if kind == "int" and not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"sparsejax.ops.{op}: `{name}` must be an integer array, got {x.dtype}")
    if kind == "float" and not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"sparsejax.ops.{op}: `{name}` must be a float array, got {x.dtype}")


def check_same_length(op: str, **arrays) -> None:
    lengths = {name: a.shape[0] for name, a in arrays.items() if a is not None}
    if len(set(lengths.values())) > 1:
        shown = ", ".join(f"`{n}` has {n_} entries" for n, n_ in lengths.items())
        raise ValueError(f"sparsejax.ops.{op}: lookups must line up: {shown}")


def _is_concrete(*xs) -> bool:
    return not any(isinstance(x, jax.core.Tracer) for x in xs if x is not None)


def _addressable(*xs) -> bool:
    """Whether this process can read every array whole (a global array of many processes
    is checked inside the jitted step, on each process's shards)."""
    return all(x.is_fully_addressable for x in xs if x is not None and isinstance(x, jax.Array))


def host_check_lookups(op, table_name, vocab, num_segments, ids, segment_ids, weights) -> None:
    """Raise IndexError / ValueError naming the first bad entry (numpy, on the host)."""
    ids = np.asarray(ids).reshape(-1)
    where = f"sparsejax.ops.{op} (table {table_name!r}, vocab {vocab})"
    too_big = np.nonzero(ids >= vocab)[0]
    if too_big.size:
        k = int(too_big[0])
        raise IndexError(
            f"{where}: id {int(ids[k])} at position {k} is out of range; ids must be < {vocab} "
            f"({too_big.size} such ids; negative ids are padding)"
        )
    if segment_ids is None:
        return
    seg = np.asarray(segment_ids).reshape(-1)
    valid = ids >= 0
    bad = np.nonzero(valid & ((seg < 0) | (seg >= num_segments)))[0]
    if bad.size:
        k = int(bad[0])
        raise IndexError(
            f"{where}: segment id {int(seg[k])} at position {k} is outside [0, {num_segments})"
        )
    vseg = seg[valid]
    down = np.nonzero(np.diff(vseg) < 0)[0]
    if down.size:
        k = int(np.nonzero(valid)[0][down[0] + 1])
        raise ValueError(
            f"{where}: segment_ids must be non-decreasing over non-padding entries "
            f"(CSR order); position {k} has {int(seg[k])} after {int(vseg[down[0]])}"
        )
    if weights is not None:
        w = np.asarray(weights, dtype=np.float32).reshape(-1)
        nonfinite = np.nonzero(valid & ~np.isfinite(w))[0]
        if nonfinite.size:
            k = int(nonfinite[0])
            raise ValueError(f"{where}: weight at position {k} is {w[k]}")


def check_lookups(
    op, table_name, vocab, num_segments, ids, segment_ids=None, weights=None, *, defer=False
):
    """Value checks: now if the inputs are concrete, in a host callback in checked mode.

    `defer`: in checked mode inside `jit`, the callback records a failed check instead
    of raising it, and `surface_check_errors()` raises it when it exits. For programs
    that span several devices, where a raising callback would hang the others."""
    if _is_concrete(ids, segment_ids, weights):
        if _addressable(ids, segment_ids, weights):  # else no one host sees them whole:
            host_check_lookups(op, table_name, vocab, num_segments, ids, segment_ids, weights)
    elif _CHECKS:
        jax.debug.callback(
            functools.partial(
                _recorded, defer, host_check_lookups, op, table_name, vocab, num_segments
            ),
            ids,
            segment_ids,
            weights,
        )


def _recorded(defer: bool, check, *args) -> None:
    """`check(*args)` in a host callback. The error it raises is recorded, for
    `surface_check_errors` to raise in place of the runtime error that carries it;
    then raised, or, deferred, left pending for `surface_check_errors`."""
    try:
        check(*args)
    except (IndexError, ValueError) as e:
        with _FAILED_LOCK:
            _FAILED.append((type(e), str(e)))
            if defer and len(_PENDING) < 16:
                _PENDING.append((type(e), str(e)))
        if not defer:
            raise


def check_unsharded(op: str, name: str, table):
    """Refuse a table sharded across devices; returns the table to use.

    The kernels need every row of the table on the device that runs them: handed a
    row-sharded table, `jit` would all-gather the whole table onto every device. Seen
    at trace time: a concrete array's sharding (eager calls) and the sharding in a
    traced array's type (`jax.sharding.AxisType.Explicit` mesh axes, the default of
    `jax.make_mesh`). Under Auto axes the sharding is known only to XLA's partitioner:
    the returned table carries a check that refuses it when a multi-device `jit` is
    compiled (`_sharding.py`), and is nothing otherwise. Inside `jax.shard_map` the
    table is the local block: allowed.
    """
    if isinstance(table, jax.core.Tracer):
        sharding = jax.typeof(table).sharding
        mesh = sharding.mesh
        if not mesh.empty and mesh.are_all_axes_manual:
            return table
        spec = [p for p in sharding.spec if p is not None]
        if spec:
            raise ValueError(_sharding.refusal_message(op, name, sharding.spec))
        return _sharding.checked_table(op, name, table)
    sharding = getattr(table, "sharding", None)
    if sharding is not None and not sharding.is_fully_replicated:
        raise ValueError(_sharding.refusal_message(op, name, getattr(sharding, "spec", sharding)))
    return table
