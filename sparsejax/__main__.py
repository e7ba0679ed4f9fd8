"""The `sparsejax` command line (`python -m sparsejax` is the same).

    sparsejax train [CONFIG.yaml ...] [key=value ...]   train (default: synthetic data)
    sparsejax eval RUN_DIR [--step N] [key=value ...]   evaluate a run's checkpoint
    sparsejax info                                      versions, devices, kernels

Configs layer left to right, then the overrides, e.g.
    sparsejax train configs/dlrm_criteo.yaml steps=500 optimizer.dense_learning_rate=3e-4
"""

from __future__ import annotations

import argparse
import sys


def _split(items: list[str]) -> tuple[list[str], list[str]]:
    files = [a for a in items if "=" not in a]
    return files, [a for a in items if "=" in a]


def _train(args: argparse.Namespace) -> int:
    from . import runner

    files, overrides = _split(args.config)
    summary = runner.train(runner.load_config(files, overrides))
    print({k: v for k, v in summary.items() if k != "run_dir"})
    return 0


def _eval(args: argparse.Namespace) -> int:
    from . import runner

    runner.evaluate_run(args.run_dir, step=args.step, overrides=args.overrides)
    return 0


def _info(args: argparse.Namespace) -> int:
    import jax

    from . import __version__, ops
    from .ops import _cpu_ffi

    print(
        f"sparsejax {__version__}, jax {jax.__version__}, backend {jax.default_backend()}, "
        f"devices {jax.devices()}"
    )
    print(
        f"default implementation: {ops.default_implementation()}"
        + (
            ""
            if ops.cpu_ffi_available()
            else f" (C++ kernels unavailable: {_cpu_ffi.unavailable_reason()})"
        )
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="sparsejax", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train from layered YAML configs and overrides")
    train.add_argument(
        "config",
        nargs="*",
        metavar="CONFIG.yaml | key=value",
        help="config files (layered left to right) and key=value overrides; "
        "none: a short run on synthetic data",
    )
    train.set_defaults(fn=_train)
    ev = sub.add_parser("eval", help="evaluate a run directory's checkpoint")
    ev.add_argument("run_dir")
    ev.add_argument("--step", type=int, default=None, help="checkpoint step (default latest)")
    ev.add_argument("overrides", nargs="*", metavar="key=value")
    ev.set_defaults(fn=_eval)
    info = sub.add_parser("info", help="versions, devices and kernel availability")
    info.set_defaults(fn=_info)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except Exception as e:
        from .runner import ConfigError

        if not isinstance(e, ConfigError):
            raise
        print(f"sparsejax: config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
