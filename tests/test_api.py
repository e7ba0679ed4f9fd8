"""The public API imports and names what DESIGN.md promises."""

import inspect
import logging

import jax
import pytest

import sparsejax
from sparsejax import ops


def test_public_names():
    for name in [
        "embedding_bag",
        "embedding_bag_ref",
        "embedding_lookup",
        "embedding_lookup_ref",
        "segment_spmm",
        "segment_spmm_ref",
        "sparse_apply",
        "sparse_apply_ref",
        "pairwise_dots",
        "pairwise_dots_ref",
        "SGD",
        "Adagrad",
        "RowWiseAdagrad",
        "LazyAdam",
        "FTRL",
        "AdagradDecay",
        "default_implementation",
        "resolve_implementation",
        "cpu_ffi_available",
        "checks",
        "set_checks",
    ]:
        assert hasattr(ops, name), name
    assert sparsejax.__version__


@pytest.mark.parametrize(
    "fn,ref",
    [
        (ops.embedding_bag, ops.embedding_bag_ref),
        (ops.embedding_lookup, ops.embedding_lookup_ref),
        (ops.segment_spmm, ops.segment_spmm_ref),
        (ops.sparse_apply, ops.sparse_apply_ref),
        (ops.pairwise_dots, ops.pairwise_dots_ref),
    ],
)
def test_reference_shares_the_signature(fn, ref):
    assert list(inspect.signature(fn).parameters) == list(inspect.signature(ref).parameters)


def test_dispatcher_says_what_it_picks():
    expected = "cpu_ffi" if ops.cpu_ffi_available() else "xla"
    assert ops.default_implementation("cpu") == expected
    assert ops.resolve_implementation(None, "cuda") == "pallas"
    assert ops.resolve_implementation("xla", "cuda") == "xla"
    with pytest.raises(ValueError, match="runs only on CPU"):
        ops.resolve_implementation("cpu_ffi", "cuda")


def test_choice_is_logged(caplog):
    import jax.numpy as jnp

    with caplog.at_level(logging.DEBUG, logger="sparsejax"):
        jax.jit(
            lambda t: ops.embedding_bag(t, jnp.array([0]), jnp.array([0]), 1, implementation="xla")
        )(jnp.ones((3, 7)))
    assert any("segment_spmm on cpu: requested xla -> xla" in r.message for r in caplog.records)
