"""Bad input: clear errors naming the argument / id / table; never an out-of-bounds read."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax import ops

TABLE = jnp.arange(40.0, dtype=jnp.float32).reshape(10, 4)


def test_eager_id_out_of_range_names_id_position_and_table():
    with pytest.raises(IndexError, match=r"table 'user_id'.*id 12 at position 1.*< 10"):
        ops.embedding_bag(TABLE, jnp.array([1, 12, 3]), jnp.array([0, 0, 1]), 2, name="user_id")
    with pytest.raises(IndexError, match="id 10 at position 0"):
        ops.embedding_lookup(TABLE, jnp.array([[10]]))
    with pytest.raises(IndexError, match="id 99"):
        ops.sparse_apply(
            TABLE,
            {},
            jnp.array([99]),
            jnp.array([0]),
            jnp.ones((1, 4)),
            optimizer=ops.SGD(learning_rate=1.0),
            step=1,
        )


def test_fast_path_never_reads_out_of_bounds(implementation):
    """Under jit (no checks) an id >= vocab contributes nothing, like padding."""
    ids = jnp.array([1, 10, 2**30, 3], jnp.int32)
    seg = jnp.array([0, 0, 1, 1], jnp.int32)
    f = jax.jit(lambda t, i: ops.embedding_bag(t, i, seg, 2, implementation=implementation))
    np.testing.assert_array_equal(f(TABLE, ids), np.stack([TABLE[1], TABLE[3]]))
    opt = ops.SGD(learning_rate=1.0)
    apply = jax.jit(
        lambda t, i: ops.sparse_apply(
            t, {}, i, seg, jnp.ones((2, 4)), optimizer=opt, step=1, implementation=implementation
        )
    )
    new, _ = apply(TABLE, ids)
    changed = np.nonzero(np.any(np.asarray(new) != np.asarray(TABLE), axis=1))[0]
    np.testing.assert_array_equal(changed, [1, 3])


def test_checked_mode_raises_inside_jit():
    seg = jnp.array([0, 1], jnp.int32)
    with ops.checks():
        f = jax.jit(lambda i: ops.embedding_bag(TABLE, i, seg, 2, name="item"))
        with pytest.raises(Exception, match=r"table 'item'.*id 11 at position 1"):
            jax.block_until_ready(f(jnp.array([0, 11], jnp.int32)))
    assert not ops.checks_enabled()


def test_unsorted_segments_and_bad_segment_ids_are_reported_eagerly():
    with pytest.raises(ValueError, match="non-decreasing.*position 2 has 0 after 1"):
        ops.embedding_bag(TABLE, jnp.array([1, 2, 3]), jnp.array([0, 1, 0]), 2)
    with pytest.raises(IndexError, match=r"segment id 5 at position 1 is outside \[0, 2\)"):
        ops.embedding_bag(TABLE, jnp.array([1, 2]), jnp.array([0, 5]), 2)
    # padding entries may carry any segment id
    out = ops.embedding_bag(TABLE, jnp.array([1, -1, 2]), jnp.array([1, 0, 1]), 2)
    np.testing.assert_array_equal(out, np.stack([np.zeros(4), TABLE[1] + TABLE[2]]))


def test_non_finite_weight_is_reported():
    with pytest.raises(ValueError, match="weight at position 1 is nan"):
        ops.embedding_bag(
            TABLE, jnp.array([1, 2]), jnp.array([0, 0]), 1, weights=jnp.array([1.0, jnp.nan])
        )


@pytest.mark.parametrize(
    "call,message",
    [
        (
            lambda: ops.embedding_bag(TABLE[0], jnp.array([0]), jnp.array([0]), 1),
            "`table` must have rank 2",
        ),
        (
            lambda: ops.embedding_bag(TABLE, jnp.array([0.5]), jnp.array([0]), 1),
            "`ids` must be an integer array",
        ),
        (
            lambda: ops.embedding_bag(TABLE, jnp.array([0, 1]), jnp.array([0]), 1),
            "`ids` has 2 entries, `segment_ids` has 1",
        ),
        (
            lambda: ops.embedding_bag(
                TABLE, jnp.array([0]), jnp.array([0]), 1, weights=jnp.array([1, 2])
            ),
            "`weights` must be a float array",
        ),
        (
            lambda: ops.embedding_bag(TABLE, jnp.array([0]), jnp.array([0]), 1, combiner="median"),
            "combiner='median'",
        ),
        (
            lambda: ops.embedding_bag(TABLE.astype(jnp.int32), jnp.array([0]), jnp.array([0]), 1),
            "`table` must be a float array",
        ),
        (
            lambda: ops.embedding_bag(
                TABLE, jnp.array([0]), jnp.array([0]), 1, implementation="cuda"
            ),
            "implementation='cuda'",
        ),
        (
            lambda: ops.segment_spmm(jnp.ones(2), jnp.array([0, 1]), jnp.array([0, 0]), TABLE, -1),
            "`num_segments` must be >= 0",
        ),
    ],
)
def test_trace_time_errors_name_the_argument(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call()


def test_num_segments_must_be_static():
    with pytest.raises(TypeError, match="`num_segments` must be a static Python int"):
        jax.jit(lambda n: ops.embedding_bag(TABLE, jnp.array([0]), jnp.array([0]), n))(1)
