"""The `sparsejax` command line (`python -m sparsejax` is the same).

    sparsejax train [--steps N ...]   short sparse training run on synthetic data
    sparsejax info                    versions, devices and which kernels run here
"""

from __future__ import annotations

import argparse
import sys


def _train(args: argparse.Namespace) -> int:
    from ._synthetic import SyntheticRunConfig, run_synthetic

    cfg = SyntheticRunConfig(steps=args.steps, batch_size=args.batch_size, vocab=args.vocab,
                             features=args.features, dim=args.dim, seed=args.seed,
                             learning_rate=args.learning_rate,
                             implementation=args.implementation)
    result = run_synthetic(cfg, log=print)
    if result["final_loss"] >= result["first_loss"]:
        print("warning: loss did not decrease", file=sys.stderr)
    return 0


def _info(args: argparse.Namespace) -> int:
    import jax

    from . import __version__, ops
    from .ops import _cpu_ffi

    print(f"sparsejax {__version__}, jax {jax.__version__}, backend {jax.default_backend()}, "
          f"devices {jax.devices()}")
    print(f"default implementation: {ops.default_implementation()}"
          + ("" if ops.cpu_ffi_available() else
             f" (C++ kernels unavailable: {_cpu_ffi.unavailable_reason()})"))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sparsejax", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="short sparse training run on synthetic data")
    train.add_argument("--steps", type=int, default=300)
    train.add_argument("--batch-size", type=int, default=1024)
    train.add_argument("--vocab", type=int, default=1_000_000, help="rows per table")
    train.add_argument("--features", type=int, default=8, help="tables, one id each")
    train.add_argument("--dim", type=int, default=16)
    train.add_argument("--learning-rate", type=float, default=0.05)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--implementation", default=None,
                       choices=["xla", "cpu_ffi", "pallas"], help="default: best for platform")
    train.set_defaults(fn=_train)
    info = sub.add_parser("info", help="versions, devices and kernel availability")
    info.set_defaults(fn=_info)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
