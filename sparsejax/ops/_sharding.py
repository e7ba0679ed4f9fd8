"""Refusing a table sharded across devices under plain `jit` with Auto mesh axes.

With `jax.sharding.AxisType.Explicit` axes a traced table's sharding is in its type, and
`_checks.check_unsharded` refuses it at trace time. With Auto axes (a plain
`jax.sharding.Mesh`, or `jax.make_mesh(..., axis_types=Auto)`) it is not: the sharding
is only known once XLA's partitioner has propagated the input shardings, after
tracing. So the ops pass a traced table through `table_check_p`, an identity:

- lowered for one device, for `jax.export`, inside `jax.shard_map`, or for a platform
  this process has too few devices of (lowering on an `AbstractMesh`, e.g. for CUDA on
  a CPU-only machine), it is nothing at all (the operand itself);
- lowered for several devices, it is a `custom_partitioning` identity whose partition
  callback sees the table's propagated sharding: split along a dimension the op reads,
  it raises (compilation fails with the eager check's message, as a
  `jax.errors.JaxRuntimeError`); replicated, it partitions to nothing, so the compiled
  program is the one without the check.

Only the table's value passes through the check: its tangent and cotangent do not
(they may be sharded as the partitioner likes).
"""

from __future__ import annotations

import functools

import jax
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

    module = ctx.module_context
    axis = module.axis_context
    if (
        not isinstance(axis, ShardingContext)  # shard_map: the table is the local block
        or axis.num_devices <= 1
        or module.lowering_parameters.for_export
    ):
        return [table]
    if axis.device_assignment is None:
        # JAX lowers without devices unless a primitive asks for them (and asking would
        # break lowering on an AbstractMesh). The partitioner only reports shardings as
        # tilings of the operand, so stand-in devices of the platform serve; lowering
        # for a platform this process has not enough devices of does without the check.
        devices = _stand_in_devices(module.platforms, axis.num_devices)
        if devices is None:
            return [table]
        axis = ShardingContext(axis.num_devices, devices, axis.abstract_mesh)
        ctx = ctx.replace(module_context=module.replace(axis_context=axis))
    check = _refusing_identity(op, name, leading, ctx.avals_in[0].ndim)
    return mlir.lower_fun(check, multiple_results=False)(ctx, table)


def _stand_in_devices(platforms, n):
    if len(platforms) != 1:
        return None
    try:
        devices = jax.devices(platforms[0])
    except RuntimeError:
        return None
    return tuple(devices[:n]) if len(devices) >= n else None


mlir.register_lowering(table_check_p, _lowering)


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
            raise ValueError(refusal_message(op, name, _describe(sharding, shape, leading)))
        return mesh, lambda t: t, sharding, (sharding,)

    factors = " ".join(f"d{i}" for i in range(ndim))
    identity.def_partition(
        partition=partition,
        infer_sharding_from_operands=lambda mesh, arg_shapes, result_shape: sharding(arg_shapes),
        sharding_rule=f"{factors} -> {factors}",
    )
    return identity


def _describe(sharding, shape, leading):
    """The spec when the partitioner's sharding has one, else which dimensions split."""
    spec = getattr(sharding, "spec", None)
    if spec is not None:
        return spec
    local = sharding.shard_shape(shape)
    names = ["rows", "columns"] if len(shape) - leading == 2 else []
    split = [
        f"{names[i - leading] if names else f'dimension {i}'} split {shape[i] // local[i]} ways"
        for i in range(leading, len(shape))
        if local[i] != shape[i]
    ]
    return ", ".join(split)


def checked_table(op: str, name: str, table):
    """`table` through the partition-time check (a traced table only)."""
    return table_check_p.bind(table, op=op, name=name, leading=0)
