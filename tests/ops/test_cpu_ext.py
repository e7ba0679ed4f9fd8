"""The C++ extension module `sparsejax._cpu_ext` and its loader: targets, and the optimizer
codes and slot counts that must agree with sparsejax/ops/optimizers.py."""

import os
import subprocess
import sys
import textwrap

import pytest

from sparsejax.ops import _cpu_ffi, optimizers

if not _cpu_ffi.is_available():
    pytest.skip(
        f"C++ CPU kernels not built: {_cpu_ffi.unavailable_reason()}", allow_module_level=True
    )

from sparsejax import _cpu_ext  # noqa: E402

OPTIMIZER_CLASSES = [
    optimizers.SGD,
    optimizers.Adagrad,
    optimizers.RowWiseAdagrad,
    optimizers.LazyAdam,
    optimizers.FTRL,
    optimizers.AdagradDecay,
]


def test_registrations_are_the_loader_targets():
    targets = {
        _cpu_ffi.SPMM_TARGET,
        _cpu_ffi.SEGMENT_MAX_TARGET,
        _cpu_ffi.SPARSE_APPLY_TARGET,
        _cpu_ffi.PAIRWISE_DOTS_TARGET,
        _cpu_ffi.PAIRWISE_DOTS_BWD_TARGET,
        _cpu_ffi.QUANTIZED_BAG_TARGET,
    }
    assert set(_cpu_ext.registrations()) == targets


def test_extension_optimizers_match_python():
    built = _cpu_ext.optimizers()
    assert {cls.code: cls.__name__ for cls in OPTIMIZER_CLASSES} == {
        code: name for code, (name, _) in built.items()
    }
    assert {code: slots for code, (_, slots) in built.items()} == _cpu_ffi.NUM_SLOTS
    assert _cpu_ffi.optimizer_mismatch(built) is None


def test_optimizer_mismatch_names_the_code_and_both_counts():
    built = dict(_cpu_ext.optimizers())
    built[3] = ("LazyAdam", 1)
    built[9] = ("Extra", 2)
    reason = _cpu_ffi.optimizer_mismatch(built)
    assert "code 3 (LazyAdam): optimizers.py 2 slots, C++ 1" in reason
    assert "code 9 (Extra): optimizers.py no slots, C++ 2" in reason
    assert "code 1" not in reason  # agreeing codes are not listed
    del built[9], built[3]
    reason = _cpu_ffi.optimizer_mismatch(built)
    assert "code 3: optimizers.py 2 slots, C++ no" in reason


def test_loader_refuses_an_extension_whose_optimizers_disagree():
    # A fresh process: registration happens once, when the loader is first imported.
    code = textwrap.dedent("""
        from sparsejax import _cpu_ext
        _cpu_ext.optimizers = lambda: {0: ("SGD", 0), 1: ("Adagrad", 2)}
        from sparsejax.ops import _cpu_ffi
        print(_cpu_ffi.is_available())
        print(_cpu_ffi.unavailable_reason())
    """)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    ).stdout.splitlines()
    assert out[0] == "False"
    assert "code 1 (Adagrad): optimizers.py 1 slots, C++ 2" in out[1]
    assert "code 2: optimizers.py 1 slots, C++ no" in out[1]
    assert "rebuild" in out[1]
