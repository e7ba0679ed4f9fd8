"""The `sparsejax` command line (`python -m sparsejax` is the same).

    sparsejax train [--restart] [CONFIG.yaml ...] [key=value ...]
        train, or resume the run directory's run (default: synthetic data)
    sparsejax eval RUN_DIR [--split eval|test] [--step N|last|best] [--k 10,20]
                   [--predictions FILE.parquet|FILE.csv] [key=value ...]
        evaluate a run's checkpoint on a split (with HR@k/NDCG@k for candidate sets),
        optionally writing per-example scores
    sparsejax config [--schema] [CONFIG.yaml ...] [key=value ...]
        print the resolved config, or (--schema) the reference of every key
    sparsejax info
        versions, devices, kernels

Configs layer left to right, then the overrides, e.g.
    sparsejax train configs/dlrm_criteo.yaml steps=500 optimizer.dense_learning_rate=3e-4
`key!=value` replaces a mapping instead of merging into it (docs/config.md).

A user error (a config, data, checkpoint or run-directory problem, a NaN loss) prints
one line and exits with status 2; the traceback goes to the run's log (RUN/run.log).
SPARSEJAX_TRACEBACK=1 shows it on the terminal instead.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback


def _split(items: list[str]) -> tuple[list[str], list[str]]:
    files = [a for a in items if "=" not in a]
    return files, [a for a in items if "=" in a]


def _train(args: argparse.Namespace) -> int:
    from . import runner

    files, overrides = _split(args.config)
    cfg = runner.load_config(files, overrides)
    summary = runner.train(cfg, restart=args.restart)
    print({k: v for k, v in summary.items() if k not in ("run_dir", "tables")})
    return 0


def _step(text: str) -> int | str:
    if text in ("last", "best"):
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a step number, last or best, got {text!r}"
        ) from None


def _ks(text: str) -> tuple[int, ...]:
    try:
        ks = tuple(int(k) for k in text.split(","))
    except ValueError:
        ks = ()
    if not ks or min(ks) < 1:
        raise argparse.ArgumentTypeError(f"expected k values >= 1 like 10 or 5,10,20, got {text!r}")
    return ks


def _eval(args: argparse.Namespace) -> int:
    from . import runner

    bad = [a for a in args.overrides if "=" not in a]
    if bad:
        from .runner import ConfigError

        raise ConfigError(f"eval takes one run directory and key=value overrides, got {bad[0]!r}")
    runner.evaluate_run(
        args.run_dir,
        step=args.step,
        split=args.split,
        predictions=args.predictions,
        ks=args.k,
        overrides=args.overrides,
    )
    return 0


def _config(args: argparse.Namespace) -> int:
    from . import runner

    if args.schema:
        if args.config:
            from .runner import ConfigError

            raise ConfigError("--schema takes no config files or overrides")
        print(runner.config_reference(), end="")
        return 0
    import yaml

    from .runner._config import to_dict

    files, overrides = _split(args.config)
    cfg = runner.load_config(files, overrides)
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
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


def _parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
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
    train.add_argument(
        "--restart",
        action="store_true",
        help="start the run over: the run directory's previous run (checkpoints, metrics, "
        "config) is moved to RUN.replaced-<time>",
    )
    train.set_defaults(fn=_train)
    ev = sub.add_parser("eval", help="evaluate a run directory's checkpoint")
    ev.add_argument("run_dir")
    ev.add_argument(
        "--step",
        type=_step,
        default=None,
        help="checkpoint step, last (default: the newest readable) or best (early_stopping)",
    )
    ev.add_argument("--split", choices=("eval", "test"), default="eval", help="default: eval")
    ev.add_argument(
        "--predictions",
        metavar="FILE",
        default=None,
        help="write row, label and score per example (.parquet needs pyarrow; .csv, .tsv)",
    )
    ev.add_argument(
        "--k",
        type=_ks,
        default=(10,),
        help="k of HR@k and NDCG@k for data with candidate sets, e.g. 5,10,20 (default 10)",
    )
    ev.add_argument("overrides", nargs="*", metavar="key=value")
    ev.set_defaults(fn=_eval)
    cf = sub.add_parser("config", help="print a resolved config or the schema reference")
    cf.add_argument("config", nargs="*", metavar="CONFIG.yaml | key=value")
    cf.add_argument("--schema", action="store_true", help="print the reference of every config key")
    cf.set_defaults(fn=_config)
    info = sub.add_parser("info", help="versions, devices and kernel availability")
    info.set_defaults(fn=_info)
    return parser, sub.choices


def _is_user_error(e: BaseException) -> bool:
    """Errors a user fixes (config, data, checkpoint, run directory, NaN loss) as
    opposed to bugs: the `ValueError` family (`ConfigError`, `RunLockedError`, parse
    errors naming file:line), `CheckpointError`, `FloatingPointError` (the NaN stop),
    `HostStorageFullError` (a tiered table's disk tier is full)."""
    from .checkpoint import CheckpointError
    from .embedding._host_rows import HostStorageFullError

    return isinstance(e, (ValueError, CheckpointError, FloatingPointError, HostStorageFullError))


def _log_traceback(e: BaseException, run_dir: str | None) -> str | None:
    """Append the traceback to RUN/run.log (unless the run already did); its path."""
    where = getattr(e, "run_log", None)
    if where is None and run_dir and os.path.isdir(run_dir):
        where = os.path.join(run_dir, "run.log")
        try:
            with open(where, "a") as f:
                f.write("".join(traceback.format_exception(e)))
        except OSError:
            return None
    return where


def main(argv: list[str] | None = None) -> int:
    parser, commands = _parsers()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in commands:  # intermixed: options anywhere among positionals
        args = commands[argv[0]].parse_intermixed_args(argv[1:])
    else:
        args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        print("sparsejax: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if not _is_user_error(e) or os.environ.get("SPARSEJAX_TRACEBACK") == "1":
            raise
        from .runner import ConfigError

        kind = "config error" if type(e) is ConfigError else "error"
        where = _log_traceback(e, getattr(args, "run_dir", None))
        detail = f" (traceback in {where})" if where else ""
        print(f"sparsejax: {kind}: {' '.join(str(e).split())}{detail}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
