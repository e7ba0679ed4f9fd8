"""Refusing a table sharded across devices under plain `jit` with Auto mesh axes.

With `jax.sharding.AxisType.Explicit` axes a traced table's sharding is in its type, and
`_checks.check_unsharded` refuses it at trace time. With Auto axes (a plain
`jax.sharding.Mesh`, or `jax.make_mesh(..., axis_types=Auto)`) it is not: the sharding
is only known once XLA's partitioner has propagated the input shardings, after
tracing. So the ops pass a traced table through `table_check_p`, an identity:

- lowered for one device, for `jax.export`, inside `jax.shard_map`, or without a
  mesh in the lowering context, it is nothing at all (the operand itself);
- lowered for a multi-device mesh, it is a `custom_partitioning` identity whose
  partition callback sees the table's propagated sharding: sharded along a dimension
  the op reads, it raises (compilation fails with the same message as the eager check,
  as a `jax.errors.JaxRuntimeError`); replicated, it partitions to nothing, so the
  compiled program is the one without the check.

Only the table's value passes through the check: its tangent and cotangent do not
(they may be sharded as the partitioner likes).
"""

from __future__ import annotations

import functools

from jax._src import dispatch as _dispatch
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

__all__ = ["refusal_message", "table_check_p"]


def refusal_message(op: str, name: str, spec) -> str:
    return (
        f"sparsejax.ops.{op}: table {name!r} is sharded across devices ({spec}); the "
        "kernels need the whole table on each device: use a sharded table store / "
        "shard_map (ids split over devices, table replicated) instead of jit on a "
        "sharded table"
    )


table_check_p = Primitive("sparsejax_table_check")
table_check_p.def_impl(lambda table, **_: table)
table_check_p.def_abstract_eval(lambda table, **_: table)


def _jvp(primals, tangents, **params):
    return table_check_p.bind(*primals, **params), tangents[0]


def _batch(args, dims, *, op, name, leading):
    (table,), (d,) = args, dims
    table = batching.bdim_at_front(table, d, table.shape[d])
    return table_check_p.bind(table, op=op, name=name, leading=leading + 1), 0


ad.primitive_jvps[table_check_p] = _jvp
batching.primitive_batchers[table_check_p] = _batch


def _lowering(ctx, table, *, op, name, leading):
    from jax._src.sharding_impls import ShardingContext

    axis = ctx.module_context.axis_context
    if (
        not isinstance(axis, ShardingContext)  # shard_map: the table is the local block
        or axis.num_devices <= 1
        or axis.device_assignment is None
        or axis.abstract_mesh is None
        or axis.abstract_mesh.empty
        or ctx.module_context.lowering_parameters.for_export
    ):
        return [table]
    check = _refusing_identity(op, name, leading, ctx.avals_in[0].ndim)
    return mlir.lower_fun(check, multiple_results=False)(ctx, table)


mlir.register_lowering(table_check_p, _lowering)
# The lowering needs the devices (custom_partitioning's does).
_dispatch.prim_requires_devices_during_lowering.add(table_check_p)


@functools.cache
def _refusing_identity(op: str, name: str, leading: int, ndim: int):
    from jax.experimental.custom_partitioning import custom_partitioning

    @custom_partitioning
    def identity(table):
        return table

    def sharding(arg_shapes):
        return arg_shapes[0].sharding

    def partition(mesh, arg_shapes, result_shape):
        del result_shape
        shape, sharding = arg_shapes[0].shape, arg_shapes[0].sharding
        local = sharding.shard_shape(shape)
        if tuple(local[leading:]) != tuple(shape[leading:]):
            raise ValueError(refusal_message(op, name, getattr(sharding, "spec", sharding)))
        return mesh, lambda t: t, sharding, (sharding,)

    factors = " ".join(f"d{i}" for i in range(ndim))
    identity.def_partition(
        partition=partition,
        infer_sharding_from_operands=lambda mesh, arg_shapes, result_shape: sharding(arg_shapes),
        sharding_rule=f"{factors} -> {factors}",
    )
    return identity


def checked_table(op: str, name: str, table):
    """`table` through the partition-time check (a traced table only)."""
    return table_check_p.bind(table, op=op, name=name, leading=0)
