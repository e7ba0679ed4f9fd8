"""The `sparsejax` command line (`python -m sparsejax` is the same).

    sparsejax train [--restart] [CONFIG.yaml ...] [key=value ...]
        train, or resume the run directory's run (default: synthetic data)
    sparsejax eval RUN_DIR [--split eval|test] [--step N|last|best] [--k 10,20]
                   [--predictions FILE.parquet|FILE.csv] [key=value ...]
        evaluate a run's checkpoint on a split (with HR@k/NDCG@k for candidate sets),
        optionally writing per-example scores
    sparsejax config [--schema] [CONFIG.yaml ...] [key=value ...]
        print the resolved config, or (--schema) the reference of every key
    sparsejax data [CONFIG.yaml ...] [key=value ...] --out DIR [--rows N]
        write the config's data once as table rows (memory-mapped columns); train from
        it with data.kind=prepared data.path=DIR, the fastest input
    sparsejax profile [CONFIG.yaml ...] [key=value ...] [--steps 20] [--warmup 5]
        where a training step's time goes; writes RUN/profile/ (trace, summary)
    sparsejax info
        versions, devices, kernels
    sparsejax launch -n N [--devices-per-process K] [--timeout S] [--restart]
                     [CONFIG.yaml ...] [key=value ...]
        train in N local processes (jax.distributed on loopback, one run directory);
        process 0's output here, the others' in RUN/launch/p<i>.log
    sparsejax plan [CONFIG.yaml ...] [key=value ...] [--devices N | --hosts H
                   --devices-per-host D] [--device-memory 80GB]
        print each table's placement, memory per device and bytes per step
    sparsejax export RUN_DIR --out MODEL_DIR [--quantize fp32|fp16|bf16|int8|int4]
                     [--step N|last|best] [--buckets 1,4,16,64,256] [--kernels xla|native]
        write a self-contained model dir for serving (tables, id maps, preprocessing);
        an unreadable newest checkpoint is refused unless --step names the one to export
    sparsejax serve MODEL_DIR [--host 127.0.0.1] [--port 8000] [--max-batch N]
                    [--max-wait-ms 2] [--max-body-bytes N] [--poll-seconds 2] [--name NAME]
                    [--grpc-port 8001] [--workers N|auto]
        serve it over HTTP: /v1/predict, /v1/retrieve, /healthz, /metrics, and the
        v2 (KServe) API over HTTP (/v2/...) and gRPC (--grpc-port)

Configs layer left to right, then the overrides, e.g.
    sparsejax train configs/dlrm_criteo.yaml steps=500 optimizer.dense_learning_rate=3e-4
`key!=value` replaces a mapping instead of merging into it (docs/config.md).

A user error (a config, data, checkpoint or run-directory problem, a NaN loss, a full
disk, a table too large for memory) prints one line and exits with status 2; the
traceback goes to the run's log (RUN/run.log; eval and export: RUN/eval.log,
RUN/export.log, never the log of a run another process trains), and so do the error
logs of orbax (absl) and asyncio. SPARSEJAX_TRACEBACK=1 shows them on the terminal.
"""

from __future__ import annotations

import argparse
import collections
import errno
import logging
import os
import sys
import time
import traceback


def _split(items: list[str]) -> tuple[list[str], list[str]]:
    files = [a for a in items if "=" not in a]
    return files, [a for a in items if "=" in a]


def _train(args: argparse.Namespace) -> int:
    from .sharding import initialize_from_env

    initialize_from_env()  # one of several processes: join them before any JAX work
    from . import runner

    files, overrides = _split(args.config)
    cfg = runner.load_config(files, overrides)
    summary = runner.train(cfg, restart=args.restart)
    if _process_of_many() in (None, 0):  # the others' output is their log
        args.log_file = os.path.join(summary["run_dir"], "run.log")
    print({k: v for k, v in summary.items() if k not in ("run_dir", "tables")})
    return 0


def _data(args: argparse.Namespace) -> int:
    from . import runner

    files, overrides = _split(args.config)
    cfg = runner.load_config(files, overrides)
    runner.prepare_data(cfg, args.out, rows=args.rows)
    return 0


def _profile(args: argparse.Namespace) -> int:
    # On a GPU, XLA runs a step's kernels as CUDA graphs, which the trace shows as one
    # op; without them every kernel is seen (and timed) with its own HLO op.
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_enable_command_buffer" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_enable_command_buffer=".strip()
    from . import runner

    files, overrides = _split(args.config)
    cfg = runner.load_config(files, overrides)
    runner.profile(cfg, steps=args.steps, warmup=args.warmup)
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


def _export(args: argparse.Namespace) -> int:
    from .sharding import initialize_from_env

    initialize_from_env()  # one of several processes (sparsejax launch ... export): join them
    from .runner import export_run

    bad = [a for a in args.overrides if "=" not in a]
    if bad:
        from .runner import ConfigError

        raise ConfigError(f"export takes one run directory and key=value overrides, got {bad[0]!r}")
    export_run(
        args.run_dir,
        args.out,
        step=args.step,
        quantize=args.quantize,
        buckets=args.buckets,
        kernels=args.kernels,
        overrides=args.overrides,
        overwrite=args.overwrite,
    )
    return 0


def _workers_arg(text: str) -> str:
    if text == "auto" or (text.isdigit() and int(text) >= 1):
        return text
    raise argparse.ArgumentTypeError(f"expected a number >= 1 or auto, got {text!r}")


def _cores_arg(text: str) -> list[int]:
    try:
        cores = [int(c) for c in text.split(",")]
    except ValueError:
        cores = []
    if not cores or min(cores) < 0:
        raise argparse.ArgumentTypeError(f"expected core numbers like 0,1, got {text!r}")
    return cores


def _serve(args: argparse.Namespace) -> int:
    try:
        from .serving import serve
    except ImportError as e:
        from .runner import ConfigError

        raise ConfigError(
            f"sparsejax serve needs the [serve] extra ({e.name} is missing): "
            f"pip install 'sparsejax[serve]'"
        ) from None
    from .serving import serve_workers, usable_cores, worker_label

    workers = usable_cores() if args.workers == "auto" else int(args.workers)
    if workers > 1:
        rest = ["--max-wait-ms", str(args.max_wait_ms), "--max-body-bytes",
                str(args.max_body_bytes), "--poll-seconds", str(args.poll_seconds)]  # fmt: skip
        for flag, value in (("--max-batch", args.max_batch), ("--name", args.name)):
            if value is not None:
                rest += [flag, str(value)]
        return serve_workers(
            args.model_dir,
            workers,
            host=args.host,
            port=args.port,
            worker_args=rest,
            run_worker=main,
            grpc_port=args.grpc_port,
            pin_cores=args.pin_cores,
        )
    log = print
    label = worker_label()
    if label is not None:

        def log(line: str) -> None:
            print(f"[{label}] {line}", flush=True)

    return serve(
        args.model_dir,
        host=args.host,
        port=args.port,
        max_batch=args.max_batch,
        max_wait_ms=args.max_wait_ms,
        max_body_bytes=args.max_body_bytes,
        poll_seconds=args.poll_seconds,
        model_name=args.name,
        grpc_port=args.grpc_port,
        reuse_port=args.reuse_port,
        model_cores=args.model_cores,
        log=log,
    )


def _config(args: argparse.Namespace) -> int:
    from . import runner

    if args.schema:
        if args.config:
            from .runner import ConfigError

            raise ConfigError("--schema takes no config files or overrides")
        print(runner.config_reference(), end="")
        return 0
    import yaml

    files, overrides = _split(args.config)
    cfg = runner.load_config(files, overrides)
    print(yaml.safe_dump(runner.to_dict(cfg), sort_keys=False), end="")
    return 0


def _info(args: argparse.Namespace) -> int:
    import jax

    from . import __version__, ops

    print(
        f"sparsejax {__version__}, jax {jax.__version__}, backend {jax.default_backend()}, "
        f"devices {jax.devices()}"
    )
    print(
        f"default implementation: {ops.default_implementation()}"
        + (
            ""
            if ops.cpu_ffi_available()
            else f" (C++ kernels unavailable: {ops.cpu_ffi_unavailable_reason()})"
        )
    )
    return 0


def _launch(args: argparse.Namespace) -> int:
    from . import runner
    from .sharding import LOG_DIR, launch

    if getattr(args, "export", None) is not None:  # launch -n N export RUN --out OUT ...
        if args.restart:
            raise runner.ConfigError("launch ... export: --restart is an option of train")
        return launch(
            args.n,
            args.config,
            command="export",
            log_dir=os.path.join(args.export.run_dir, LOG_DIR),
            devices_per_process=args.devices_per_process,
            timeout=args.timeout,
        )
    files, overrides = _split(args.config)
    cfg = runner.load_config(files, overrides)  # a config error before any process starts
    return launch(
        args.n,
        [*args.config, *(["--restart"] if args.restart else [])],
        log_dir=os.path.join(cfg.run_dir, LOG_DIR),
        devices_per_process=args.devices_per_process,
        timeout=args.timeout,
    )


def _plan(args: argparse.Namespace) -> int:
    from .runner import ConfigError

    if args.devices is not None and (args.hosts is not None or args.devices_per_host is not None):
        raise ConfigError(
            "plan: give --devices N, or --hosts H with --devices-per-host D, not both"
        )
    if (args.hosts is None) != (args.devices_per_host is None):
        raise ConfigError("plan: --hosts and --devices-per-host go together")
    from .runner import plan_command

    files, overrides = _split(args.config)
    out = plan_command(
        files,
        overrides,
        devices=args.devices,
        hosts=args.hosts,
        devices_per_host=args.devices_per_host,
        device_memory=args.device_memory,
    )
    if isinstance(out, str):
        print(out, end="" if out.endswith("\n") else "\n")
    return out if isinstance(out, int) and not isinstance(out, bool) else 0


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return n


def _seconds(text: str) -> float:
    try:
        s = float(text)
    except ValueError:
        s = 0.0
    if not s > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return s


def _parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    from .serving import DEFAULT_BUCKETS, KERNELS, QUANTIZE_CHOICES

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
    da = sub.add_parser(
        "data",
        help="write a config's data once as table rows in memory-mapped columns",
        description="Read the config's data as `train` would (parse, split, map ids into "
        "the tables) and write its train, eval and test splits to a new directory OUT; "
        "a run with `data.kind=prepared data.path=OUT` then trains from it with nothing "
        "to parse (the fastest input). Generated data writes --rows train rows (default: "
        "the run's steps x batch size).",
    )
    da.add_argument("config", nargs="*", metavar="CONFIG.yaml | key=value")
    da.add_argument("--out", required=True, help="the directory to write (must not exist)")
    da.add_argument("--rows", type=_positive, default=None, help="train rows of generated data")
    da.set_defaults(fn=_data)
    pr = sub.add_parser(
        "profile",
        help="where a training step's time goes (input, host, lookup, dense, update, ...)",
        description="Build the config's run as `train` does, train a few steps to compile, "
        "then time --steps steps untraced and under jax.profiler: the step's time split "
        "into input pipeline, host work, embedding lookup, dense forward/backward, sparse "
        "update, dense optimizer, collectives, with the embedding parts' GB/s against a "
        "device copy and the dense part's GFLOP/s. Writes RUN/profile/ (trace for "
        "TensorBoard or Perfetto, summary.txt, summary.json, summary.png); saves no "
        "checkpoint.",
    )
    pr.add_argument("config", nargs="*", metavar="CONFIG.yaml | key=value")
    pr.add_argument("--steps", type=_positive, default=20, help="profiled steps (default 20)")
    pr.add_argument("--warmup", type=_positive, default=5, help="steps before (default 5)")
    pr.set_defaults(fn=_profile)
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
    la = sub.add_parser(
        "launch",
        help="train in N local processes (jax.distributed on loopback), one run directory",
        description="Start N processes of `sparsejax train` on this machine, joined by "
        "jax.distributed (CPU collectives through gloo). data.batch_size stays the global "
        "batch; each process feeds its share. Process 0 writes the run directory and its "
        "output is shown here; the output of process i > 0 goes to RUN/launch/p<i>.log. "
        "When a process fails, the others are stopped and the launcher exits non-zero "
        "naming it.",
    )
    la.add_argument("-n", "--processes", dest="n", type=_positive, required=True)
    la.add_argument(
        "config",
        nargs="*",
        metavar="CONFIG.yaml | key=value",
        help="as for sparsejax train",
    )
    la.add_argument(
        "--devices-per-process",
        type=_positive,
        default=None,
        metavar="K",
        help="CPU devices per process (jax_num_cpu_devices), e.g. -n 2 with 4: a 2x4 mesh",
    )
    la.add_argument(
        "--timeout",
        type=_seconds,
        default=None,
        metavar="S",
        help="stop every process after S seconds (exit 124); default: no limit",
    )
    la.add_argument("--restart", action="store_true", help="as for sparsejax train")
    la.set_defaults(fn=_launch)
    pl = sub.add_parser(
        "plan",
        help="print the sharding plan: placement, memory per device, bytes per step",
    )
    pl.add_argument("config", nargs="*", metavar="CONFIG.yaml | key=value")
    pl.add_argument("--devices", type=_positive, default=None, metavar="N", help="N devices")
    pl.add_argument("--hosts", type=_positive, default=None, metavar="H", help="H hosts")
    pl.add_argument(
        "--devices-per-host", type=_positive, default=None, metavar="D", help="D devices per host"
    )
    pl.add_argument(
        "--device-memory",
        default=None,
        metavar="BYTES",
        help="memory per device, e.g. 80GB or 16GiB (default: the devices' own)",
    )
    pl.set_defaults(fn=_plan)
    ex = sub.add_parser(
        "export",
        help="export a run's checkpoint as a self-contained model dir for serving",
        description="Write MODEL_DIR: the model's computation (jax.export, one per batch "
        "bucket), its tables (optionally quantized), its preprocessing and id maps, and "
        "example_request.json. A numbered subfolder of a folder that `sparsejax serve` "
        "watches (models/2) is picked up as a new version.",
    )
    ex.add_argument("run_dir")
    ex.add_argument("--out", required=True, metavar="MODEL_DIR")
    ex.add_argument(
        "--step",
        type=_step,
        default=None,
        help="checkpoint step, last (the newest readable) or best (early_stopping); default: "
        "the newest checkpoint, refused when it is unreadable",
    )
    ex.add_argument(
        "--quantize",
        choices=QUANTIZE_CHOICES,
        default="fp32",
        help="table storage: fp32 (default), fp16, bf16, or row-wise int8 / int4",
    )
    ex.add_argument(
        "--buckets",
        type=_ks,
        default=DEFAULT_BUCKETS,
        metavar="B1,B2,...",
        help="padded batch sizes, one compiled computation each (default "
        + ",".join(map(str, DEFAULT_BUCKETS))
        + ")",
    )
    ex.add_argument(
        "--kernels",
        choices=KERNELS,
        default="xla",
        help="xla: portable (runs on cpu and cuda); native: this platform's C++ kernels, "
        "checked at load",
    )
    ex.add_argument("--overwrite", action="store_true", help="replace an existing MODEL_DIR")
    ex.add_argument("overrides", nargs="*", metavar="key=value")
    ex.set_defaults(fn=_export)
    sv = sub.add_parser(
        "serve",
        help="serve a model dir over HTTP (needs the [serve] extra)",
        description="POST /v1/predict, POST /v1/retrieve, GET /healthz, GET /metrics. "
        "MODEL_DIR is a model dir, or a folder of numbered versions: the highest is "
        "served, and a newer one is loaded and swapped in without dropping requests.",
    )
    sv.add_argument("model_dir", metavar="MODEL_DIR")
    sv.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1 (loopback only)")
    sv.add_argument("--port", type=int, default=8000, help="default 8000")
    sv.add_argument(
        "--max-batch",
        type=_positive,
        default=None,
        help="examples per batch at most (default: the model's largest bucket; 1: no batching)",
    )
    sv.add_argument(
        "--max-wait-ms",
        type=float,
        default=2.0,
        help="how long a batch waits for more requests (default 2 ms)",
    )
    sv.add_argument(
        "--max-body-bytes",
        type=_positive,
        default=1 << 20,
        help="larger request bodies get 413 (default 1 MiB)",
    )
    sv.add_argument(
        "--poll-seconds",
        type=float,
        default=2.0,
        help="how often to look for a new model version or delta (default 2; 0: never)",
    )
    sv.add_argument(
        "--workers",
        default="1",
        type=_workers_arg,
        help="server processes on the one port, sharing the tables (SO_REUSEPORT; a "
        "worker that dies is restarted); auto: one per core (default 1)",
    )
    sv.add_argument(
        "--pin-cores",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --workers N > 1, run each worker's model (XLA's threads and its "
        "batcher) on its own share of the cores (default; --no-pin-cores: on every core)",
    )
    sv.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)
    sv.add_argument("--model-cores", type=_cores_arg, default=None, help=argparse.SUPPRESS)
    sv.add_argument(
        "--grpc-port",
        type=int,
        default=None,
        help="also serve the v2 (KServe) gRPC API on this port (e.g. 8001; 0: any free "
        "port; default: no gRPC)",
    )
    sv.add_argument(
        "--name",
        default=None,
        help="the model's name in the v2 (KServe) API, /v2/models/NAME (default: the "
        "model path's folder name)",
    )
    sv.set_defaults(fn=_serve)
    for name, p in sub.choices.items():  # (also when a subparser parses alone: main)
        # train, eval and export keep orbax's and asyncio's logs in a file (_LibraryLogs)
        p.set_defaults(command=name, logs_to_file=name in ("train", "eval", "export"))
    return parser, sub.choices


_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)
"""A disk that is full, over quota, over the file size limit or read-only."""


def _is_user_error(e: BaseException) -> bool:
    """Errors a user fixes (config, data, checkpoint, run directory, NaN loss, disk,
    memory) as opposed to bugs: the `ValueError` family (`ConfigError`,
    `RunLockedError`, parse errors naming file:line), `CheckpointError` (also a
    checkpoint that cannot be written), `FloatingPointError` (the NaN stop),
    `HostStorageFullError` (a tiered table's disk tier is full), an `OSError` of a full
    or read-only disk, `MemoryError` (the stores' memory check: a table too large)."""
    from .checkpoint import CheckpointError
    from .embedding.host import HostStorageFullError
    from .serving import ModelLoadError

    if isinstance(e, OSError) and e.errno in _DISK_ERRNOS:
        return True
    return isinstance(
        e,
        (
            ValueError,
            CheckpointError,
            FloatingPointError,
            HostStorageFullError,
            ModelLoadError,
            MemoryError,
        ),
    )


class _LibraryLogs(logging.Handler):
    """The records of loggers that print pages for one error (orbax logs each failed
    write with its traceback through absl; asyncio logs the unread errors of the tasks a
    failed orbax call left, when they are collected, often at exit): kept from the
    terminal and written to the command's log file (`send_to`), with the traceback of
    an error. Until a file is named they are held (the last `keep`); later ones, until
    the process ends, are appended to it."""

    LOGGERS = ("absl", "asyncio")
    _installed: _LibraryLogs | None = None  # one per process: the last command's

    def __init__(self, keep: int = 2000):
        super().__init__(logging.WARNING)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self.held: collections.deque[str] | None = collections.deque(maxlen=keep)
        self.path: str | None = None
        self.saved = [(lg, lg.propagate) for lg in map(logging.getLogger, self.LOGGERS)]

    @classmethod
    def install(cls) -> _LibraryLogs:
        """Take the loggers' records from here on (from the previous command's)."""
        if cls._installed is not None:
            cls._installed.uninstall()
        self = cls._installed = cls()
        for lg, _ in self.saved:
            lg.addHandler(self)
            lg.propagate = False  # not to the root's stderr handler
        return self

    def uninstall(self) -> None:
        for lg, propagate in self.saved:
            lg.removeHandler(self)
            lg.propagate = propagate
        if type(self)._installed is self:
            type(self)._installed = None

    def emit(self, record: logging.LogRecord) -> None:
        text = self.format(record)
        if self.held is not None:
            self.held.append(text)
        elif self.path is not None:
            _append(self.path, text)

    def send_to(self, path: str | None, *, drop: bool = False) -> None:
        """Write the held records, and append later ones, to `path`; or drop them all
        (`drop`); or (no file) give the loggers back, the held records on stderr."""
        held, self.held = list(self.held or ()), None
        if drop or (path is not None and _append(path, *held)):
            self.path = None if drop else path
            return
        self.uninstall()
        for text in held:
            print(text, file=sys.stderr)


def _append(path: str, *texts: str) -> bool:
    """Append lines to a log file; False when it cannot be written (e.g. a full disk:
    the error being reported may be that one)."""
    if not texts:
        return True
    try:
        with open(path, "a") as f:
            f.writelines(t if t.endswith("\n") else t + "\n" for t in texts)
    except OSError:
        return False
    return True


def _log_file(args: argparse.Namespace, e: BaseException | None) -> str | None:
    """This command's log file: the run's log for `train` (set once the run holds its
    directory: `e.run_log`, or `args.log_file` after it ends), `RUN/<command>.log` for
    the commands that read a run directory (eval, export: a run that another process
    trains keeps its run.log to itself)."""
    where = getattr(e, "run_log", None) or getattr(args, "log_file", None)
    run_dir = getattr(args, "run_dir", None)
    if where is None and args.command in ("eval", "export") and os.path.isdir(run_dir):
        where = os.path.join(run_dir, f"{args.command}.log")
    return where


def _log_traceback(e: BaseException, where: str | None, command: str) -> str | None:
    """Append the traceback to the command's log file `where` (unless the run already
    did: `e.run_log`); the file's path, or None when it cannot be written."""
    if where is None:
        return None
    if getattr(e, "run_log", None) == where:
        return where
    head = f"{time.strftime('%Y-%m-%d %H:%M:%S')} sparsejax {command} (pid {os.getpid()}) failed:"
    return where if _append(where, head, "".join(traceback.format_exception(e))) else None


def main(argv: list[str] | None = None) -> int:
    parser, commands = _parsers()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["launch"] and "export" in argv[1:]:  # launch [options] export ...
        i = argv.index("export", 1)
        args = commands["launch"].parse_intermixed_args(argv[1:i])
        # the export's options checked before any process starts
        args.export = commands["export"].parse_intermixed_args(argv[i + 1 :])
        args.config = argv[i + 1 :]
    elif argv and argv[0] in commands:  # intermixed: options anywhere among positionals
        args = commands[argv[0]].parse_intermixed_args(argv[1:])
    else:
        args = parser.parse_args(argv)
    if not args.logs_to_file or os.environ.get("SPARSEJAX_TRACEBACK") == "1":
        return _run_command(args)
    logs = _LibraryLogs.install()
    try:
        return _run_command(args)
    finally:
        e = getattr(args, "error", None)
        where = _log_file(args, e)
        # a user error without a log file: its one line says it all
        logs.send_to(where, drop=where is None and e is not None and _is_user_error(e))


def _run_command(args: argparse.Namespace) -> int:
    """Run the command; a user error becomes one line on stderr and status 2."""
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        _say("sparsejax: interrupted")
        return _exit_now_if_many(130)
    except Exception as e:
        args.error = e
        who = _process_of_many()
        if who is not None and _lost_peer(e) and os.environ.get("SPARSEJAX_TRACEBACK") != "1":
            where = _log_traceback(e, _log_file(args, e), args.command)
            first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
            _say(
                f"sparsejax: process {who}: error: a collective with the other processes "
                f"failed (one of them probably ended; see its output): {first.strip()}"
                + (f" (traceback in {where})" if where else "")
            )
            return _exit_now_if_many(1)
        if not _is_user_error(e) or os.environ.get("SPARSEJAX_TRACEBACK") == "1":
            if who is None:
                raise
            traceback.print_exc()
            return _exit_now_if_many(1)
        from .runner import ConfigError

        kind = "config error" if type(e) is ConfigError else "error"
        where = _log_traceback(e, _log_file(args, e), args.command)
        detail = f" (traceback in {where})" if where else ""
        who = "" if who is None else f"process {who}: "
        _say(f"sparsejax: {who}{kind}: {' '.join(str(e).split())}{detail}")
        return _exit_now_if_many(2)


def _say(line: str) -> None:
    """`line` on stderr in one write: `print` writes the text and its newline apart, and
    a library's thread writing between them (gloo's, in a launch) ends up on our line."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _lost_peer(e: BaseException) -> bool:
    """A JAX runtime error of a multi-process job (a collective or the coordination
    service failed), or a peer lost in the host exchange of dynamic tables: usually
    because another process ended."""
    import jax

    from ._peers import PeerLostError, PeerTimeoutError

    return isinstance(e, jax.errors.JaxRuntimeError | PeerLostError | PeerTimeoutError)


def _process_of_many() -> int | None:
    """This process's number when it is one of several (`jax.distributed`), else None."""
    if "sparsejax.sharding._distributed" not in sys.modules:
        return None
    from .sharding import process_of_many

    return process_of_many()


def _exit_now_if_many(status: int) -> int:
    """One of several processes that fails exits now, skipping `jax.distributed`'s
    shutdown barrier at exit: the others may be waiting for it in a collective, and the
    barrier would hold it (and them) until its timeout. `sparsejax launch` (or the
    cluster's launcher) stops the others; without one they fail within the heartbeat
    timeout (sparsejax/sharding/_distributed.py)."""
    if _process_of_many() is None:
        return status
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
