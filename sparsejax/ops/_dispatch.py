"""Choosing an implementation for a primitive on a platform.

`implementation=None` means "best for the platform": the C++ kernel on CPU when the
extension is built (else XLA), the Pallas-Triton kernel on CUDA, XLA elsewhere. An
explicit choice that cannot run on a platform is an error, never a silent fallback.
The choice is logged at DEBUG level on the `sparsejax` logger each time an op is
compiled, and `resolve_implementation` tells it without running anything.
"""

from __future__ import annotations

import logging

IMPLEMENTATIONS = ("xla", "cpu_ffi", "pallas")

logger = logging.getLogger("sparsejax")


def check_implementation(implementation: str | None) -> None:
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation={implementation!r} is not one of {IMPLEMENTATIONS} or None"
        )


def resolve_implementation(implementation: str | None, platform: str) -> str:
    """The implementation that runs for `implementation` on `platform` ("cpu", "cuda", ...).

    Raises:
      ValueError: the requested implementation cannot run on that platform.
    """
    from . import _cpu_ffi

    check_implementation(implementation)
    if implementation is None:
        if platform == "cpu":
            return "cpu_ffi" if _cpu_ffi.is_available() else "xla"
        if platform in ("cuda", "rocm"):
            return "pallas" if platform == "cuda" else "xla"
        return "xla"
    if implementation == "cpu_ffi":
        if platform != "cpu":
            raise ValueError(f"implementation='cpu_ffi' runs only on CPU, not on {platform!r}")
        if not _cpu_ffi.is_available():
            raise ValueError(
                "implementation='cpu_ffi' requested but the C++ extension is not built: "
                f"{_cpu_ffi.unavailable_reason()}. Reinstall with a C++ compiler "
                "(`pip install .`) or use implementation='xla'."
            )
    if implementation == "pallas" and platform not in ("cpu", "cuda"):
        raise ValueError(f"implementation='pallas' has no kernel for platform {platform!r}")
    return implementation


def log_choice(op: str, platform: str, requested: str | None, chosen: str) -> None:
    logger.debug("sparsejax.ops.%s on %s: requested %s -> %s", op, platform, requested, chosen)


def cpu_ffi_available() -> bool:
    """True if the C++ CPU kernels are built and registered (see `sparsejax info`)."""
    from . import _cpu_ffi

    return _cpu_ffi.is_available()


def cpu_ffi_unavailable_reason() -> str | None:
    """Why `cpu_ffi_available()` is False (the extension's build or load error), else None."""
    from . import _cpu_ffi

    return _cpu_ffi.unavailable_reason()


def default_implementation(platform: str | None = None) -> str:
    """What `implementation=None` picks on `platform` (default: jax's default backend)."""
    import jax

    return resolve_implementation(None, platform or jax.default_backend())
