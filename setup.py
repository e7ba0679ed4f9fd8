"""Builds the optional C++ CPU kernels `sparsejax._cpu_ext` (XLA FFI handlers).

Project metadata lives in pyproject.toml; this file only declares the extension.
The extension is optional: without a C++17 compiler the install still succeeds and
sparsejax falls back to its XLA implementations (`sparsejax.ops._cpu_ffi.is_available()`
is then False).

    pip install -e .                      # or
    python setup.py build_ext --inplace   # -> sparsejax/_cpu_ext*.so
"""

from __future__ import annotations

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def _ffi_include_dirs() -> list[str]:
    try:
        import jax.ffi

        return [jax.ffi.include_dir()]
    except Exception as e:  # jax missing or too old: build without the extension
        print(
            f"sparsejax: jax.ffi.include_dir() unavailable ({e}); "
            "the C++ CPU kernels will not be built",
            file=sys.stderr,
        )
        return []


class _OptionalBuildExt(build_ext):
    """Skips the extension (with a warning) when its headers are missing."""

    def build_extension(self, ext):
        if not ext.include_dirs:
            print(f"sparsejax: skipping {ext.name}: no XLA FFI headers", file=sys.stderr)
            return
        super().build_extension(ext)


_include_dirs = _ffi_include_dirs()

ext_modules = [
    Extension(
        "sparsejax._cpu_ext",
        sources=[
            f"csrc/{name}.cc"
            for name in (
                "module",
                "common",
                "worker_pool",
                "spmm",
                "sparse_apply",
                "interaction",
                "id_map",
                "quantized_bag",
                "text",
                "http_front",
            )
        ],
        depends=[
            "csrc/common.h",
            "csrc/worker_pool.h",
            "csrc/optimizers.h",
            "csrc/py_buffer.h",
        ],
        include_dirs=_include_dirs + ["csrc"] if _include_dirs else [],
        language="c++",
        # No -march/-mavx*: the wheel must run on any x86-64 (or aarch64) machine.
        # -isystem (same dir as include_dirs) silences warnings inside the XLA headers.
        extra_compile_args=[
            "-O3",
            "-std=c++17",
            "-fvisibility=hidden",
            "-fno-math-errno",
            "-fno-trapping-math",
            "-pthread",
        ]
        + [f for d in _include_dirs for f in ("-isystem", d)],
        extra_link_args=["-pthread"],
        libraries=["pthread"],
        optional=True,
    )
]

setup(ext_modules=ext_modules, cmdclass={"build_ext": _OptionalBuildExt})
