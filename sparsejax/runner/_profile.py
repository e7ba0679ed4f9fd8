"""`sparsejax profile CONFIG`: where a training step's time goes, for a config's run.

The run is built as `sparsejax train` builds it (resuming its checkpoint, if any, and
holding its run directory's lock) and profiled by `sparsejax.train.profile_training`
(step timing, trace attribution, the byte model: see there), which writes
`RUN/profile/`. Nothing else is saved.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from ..train import StepProfile, profile_training
from ._lock import RunLock
from ._run import Run, build_run, train_loader
from ._run_dir import resolved_config


def profile_run(
    run: Run,
    *,
    steps: int = 20,
    warmup: int = 5,
    out_dir: str | None = None,
    log: Callable[[str], None] = print,
) -> StepProfile:
    """Profile `steps` training steps of a built `Run` (`profile_training`), writing
    `out_dir` (default `RUN/profile`); the run's state goes on from the profiled steps."""
    on_host = {t.name for t in run.model.tables if t.placement == "host"}
    result, run.state = profile_training(
        run.trainer,
        run.state,
        train_loader(run, epochs=None),
        tables=run.data.tables,
        features=run.data.features,
        host_placed=on_host,
        out_dir=out_dir or os.path.join(run.cfg.run_dir, "profile"),
        steps=steps,
        warmup=warmup,
        log=log,
    )
    return result


def profile(
    cfg,
    *,
    steps: int = 20,
    warmup: int = 5,
    log: Callable[[str], None] = print,
) -> StepProfile:
    """`sparsejax profile`: build the run of `cfg` (holding its run directory's lock, as
    `train` does) and profile it; nothing is saved but `RUN/profile/`."""
    cfg = resolved_config(cfg)
    with RunLock(cfg.run_dir, log=log):
        run = build_run(cfg, log=log)
        try:
            result = profile_run(run, steps=steps, warmup=warmup, log=log)
        finally:
            run.checkpointer.close()
    log(result.table())
    return result
