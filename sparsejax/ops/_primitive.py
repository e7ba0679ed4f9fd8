"""One way to define a sparsejax primitive.

`define_primitive` takes what differs between ops (the abstract eval, one
implementation per backend, the batching, JVP and transpose rules) and does the
registration they all share:

- `def_impl` through a `jax.jit` cached per parameter set (eager calls compile once);
- one MLIR lowering per platform ("cpu", "cuda", and a default for the others) that
  resolves the `implementation` parameter with `_dispatch.resolve_implementation`,
  logs the choice, and lowers that backend's function;
- lowerings that also run inside `jax.shard_map` (the backends need no manual-axis
  annotations);
- a batching rule for every primitive (a sequential map over the batch unless the op
  gives a better one);
- the JVP and transpose rules, when given.

Every backend function takes the primitive's operands in the same order and its
parameters (all but `implementation`) as keywords; the "pallas" function also takes
`interpret=` (True off CUDA, so CPU tests run the same kernel in interpret mode).
A backend missing from `implementations` runs the "xla" one. A backend given as
"package.module:function" is imported on first lowering (Pallas costs ~0.3 s to import).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping

import jax
from jax._src import config as _jax_config
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import _dispatch

__all__ = ["define_primitive", "sequential_batch_rule"]

_PLATFORMS = ("cpu", "cuda")


def define_primitive(
    name: str,
    *,
    abstract_eval: Callable,
    implementations: Mapping[str, Callable],
    batch_rule: Callable | None = None,
    jvp: Callable | None = None,
    transpose: Callable | None = None,
    multiple_results: bool = False,
    choose: Callable | None = None,
    log_name: str | None = None,
) -> Primitive:
    """Make and register the primitive `sparsejax_<name>`.

    Args:
      name: the primitive is `sparsejax_<name>`.
      abstract_eval: `(*avals, **params) -> aval(s)`; params include `implementation`.
      implementations: backend ("xla", "cpu_ffi", "pallas") -> function of the operands
        and the params except `implementation`; "xla" is required.
      batch_rule: a `batching.primitive_batchers` rule; default `sequential_batch_rule`.
      jvp, transpose: `ad.primitive_jvps` / `ad.primitive_transposes` rules.
      multiple_results: the primitive returns a list of arrays.
      choose: optional `(impl, avals_in, **params) -> impl` that may move a resolved
        choice to another backend for inputs it does not support (e.g. a dtype).
      log_name: the op's name in the log line ("sparsejax.ops.<log_name> on cpu:
        requested ... -> ..."); default `name`.
    """
    if "xla" not in implementations:
        raise ValueError(f"define_primitive({name!r}): an 'xla' implementation is required")
    prim = Primitive(f"sparsejax_{name}")
    prim.multiple_results = multiple_results

    def lowering(platform: str):
        def rule(ctx, *args, implementation, **params):
            impl = _dispatch.resolve_implementation(implementation, platform)
            if choose is not None:
                impl = choose(impl, ctx.avals_in, **params)
            if impl not in implementations:
                impl = "xla"
            _dispatch.log_choice(log_name or name, platform, implementation, impl)
            kw = dict(params, interpret=platform != "cuda") if impl == "pallas" else params
            fn = functools.partial(_load(implementations[impl]), **kw)
            if multiple_results:
                fn = _as_list(fn)
            # Lowering comes after type checking: inside `jax.shard_map` the primitive's
            # outputs already have their types, and the backend (a Pallas interpreter
            # loop, say) sees plain local arrays, without manual-axis annotations.
            ctx = ctx.replace(
                avals_in=[_local(a) for a in ctx.avals_in],
                avals_out=[_local(a) for a in ctx.avals_out],
            )
            with _jax_config._check_vma(False):
                return mlir.lower_fun(fn, multiple_results=multiple_results)(ctx, *args)

        return rule

    @functools.cache
    def jitted(**params):
        return jax.jit(functools.partial(prim.bind, **params))

    prim.def_abstract_eval(abstract_eval)
    prim.def_impl(lambda *args, **params: jitted(**params)(*args))
    mlir.register_lowering(prim, lowering("xla_only"))
    for platform in _PLATFORMS:
        mlir.register_lowering(prim, lowering(platform), platform=platform)
    batching.primitive_batchers[prim] = batch_rule or functools.partial(sequential_batch_rule, prim)
    if jvp is not None:
        ad.primitive_jvps[prim] = jvp
    if transpose is not None:
        ad.primitive_transposes[prim] = transpose
    return prim


def _load(fn):
    if isinstance(fn, str):
        module, attr = fn.split(":")
        return getattr(importlib.import_module(module), attr)
    return fn


def _local(aval):
    """`aval` without the manual mesh axes it varies over (see the lowering)."""
    return aval.update(manual_axis_type=_EMPTY_MAT) if hasattr(aval, "manual_axis_type") else aval


_EMPTY_MAT = jax.sharding.ManualAxisType()


def _as_list(fn):
    return lambda *args: list(fn(*args))


def sequential_batch_rule(prim: Primitive, args, dims, **params):
    """vmap as a loop (`lax.map`) over the batch: correct for any primitive."""
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    mapped = [i for i, d in enumerate(dims) if d is not None]
    xs = [batching.bdim_at_front(args[i], dims[i], size) for i in mapped]

    def one(xs_i):
        full = list(args)
        for i, x in zip(mapped, xs_i, strict=True):
            full[i] = x
        return prim.bind(*full, **params)

    out = jax.lax.map(one, xs)
    return out, ([0] * len(out) if prim.multiple_results else 0)
