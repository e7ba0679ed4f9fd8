"""A run's reporting: `metrics.jsonl` (one JSON object per logged step or eval), the
same metrics as TensorBoard event files (`tensorboard/`, with tensorboardX), the console
or progress bar, `curves.png` and `summary.json`. The first three are
`sparsejax.train.Hook`s of the training loop."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Mapping

import jax
import numpy as np

from ..train import Hook


def plain(d: Mapping) -> dict:
    """Metrics as JSON-able Python floats."""
    return {
        k: (
            float(v)
            if isinstance(v, (np.floating, float, np.ndarray, jax.Array)) and not isinstance(v, int)
            else v
        )
        for k, v in d.items()
    }


_COUNTS = ("users", "candidates")  # counts among the metrics (evaluate_ranking)


def format_metrics(result: Mapping) -> str:
    return ", ".join(
        f"{k} {int(v)}" if k in _COUNTS else f"{k} {v:.4f}"
        for k, v in result.items()
        if k != "examples"
    )


class MetricsLog(Hook):
    """Appends train and eval records to `metrics.jsonl`; on resume first drops the
    records past the restored step (so the log continues without duplicates)."""

    def __init__(self, path: str, resume_step: int):
        self.path = path
        kept = []
        if resume_step and os.path.exists(path):
            with open(path) as f:
                kept = [line for line in f if json.loads(line).get("step", 0) <= resume_step]
        with open(path, "w") as f:
            f.writelines(kept)

    def _write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def on_log(self, step: int, record: Mapping) -> None:
        self._write({"kind": "train", **plain(record)})

    def on_eval(self, step: int, result: Mapping) -> None:
        self._write({"kind": "eval", "step": step, **plain(result)})


TENSORBOARD_DIR = "tensorboard"
"""Where a run's TensorBoard event files go, beside metrics.jsonl
(`tensorboard --logdir RUN/tensorboard`)."""


class TensorBoardLog(Hook):
    """The records of `MetricsLog` as TensorBoard scalars at their step: `train/<key>`
    (loss, samples_per_s) and `eval/<metric>`. Written through tensorboardX's
    `SummaryWriter` (a background thread; flushed after each eval and at `close`). On
    resume the new event file tells TensorBoard to drop the earlier files' events past the
    restored step (`purge_step`), as `MetricsLog` drops its records. Each start writes its
    own file, named by its start time to the nanosecond (tensorboardX's name has only the
    second, and a second writer in the same second would truncate the first's file)."""

    def __init__(self, logdir: str, resume_step: int):
        self.writer = _summary_writer()(
            logdir=logdir,
            purge_step=resume_step + 1 if resume_step else None,
            filename_suffix=f".{time.time_ns()}",
        )

    def _scalars(self, prefix: str, step: int, record: Mapping) -> None:
        for k, v in plain(record).items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                self.writer.add_scalar(f"{prefix}/{k}", v, step)

    def on_log(self, step: int, record: Mapping) -> None:
        self._scalars("train", step, record)

    def on_eval(self, step: int, result: Mapping) -> None:
        self._scalars("eval", step, result)
        self.writer.flush()

    def on_end(self, step, state) -> None:
        self.close()

    def close(self) -> None:
        self.writer.close()  # idempotent


def _summary_writer():
    """tensorboardX's `SummaryWriter` class, imported without PyTorch: tensorboardX
    imports torch where it is installed (2 s of a run's start) for image and graph
    summaries a run never writes; its scalars need only numpy. A torch this process
    imported already is used as is, and `import torch` works again afterwards."""
    if "tensorboardX.writer" in sys.modules or "torch" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # `import torch` raises ImportError meanwhile
    try:
        from tensorboardX import SummaryWriter
    finally:
        if sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
    return SummaryWriter


def tensorboard_log(
    run_dir: str, resume_step: int, log: Callable[[str], None]
) -> TensorBoardLog | None:
    """A `TensorBoardLog` writing to `RUN/tensorboard/`; without tensorboardX, None and one
    log line saying how to install it (the run goes on without event files)."""
    try:
        return TensorBoardLog(os.path.join(run_dir, TENSORBOARD_DIR), resume_step)
    except ImportError:
        log(
            "tensorboard: no event files (tensorboardX is not installed; pip install "
            "tensorboardX, or sparsejax[tensorboard]); metrics.jsonl has the same metrics"
        )
        return None


class Console(Hook):
    """Progress on the terminal: a tqdm bar (loss and samples/s as its postfix) or, with
    `progress=False`, one line per logged step; one line per eval either way."""

    def __init__(self, log: Callable[[str], None], *, progress: bool, total: int, start: int):
        self.log = log
        self.bar = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

    def after_step(self, step, state, metrics) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def on_end(self, step, state) -> None:
        self.close()

    def on_log(self, step: int, record: Mapping) -> None:
        loss, rate = record["loss"], record["samples_per_s"]
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{rate:,.0f}")
            if self.bar.n >= self.bar.total:
                self.close()  # the final eval prints below a finished bar
        else:
            self.log(f"step {step}: loss {loss:.4f}, {rate:,.0f} samples/s")

    def on_eval(self, step: int, result: Mapping) -> None:
        if self.bar is not None:
            self.bar.clear()
        self.log(f"eval @ {step}: {format_metrics(result)}")
        if self.bar is not None:
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def plot_curves(metrics_path: str, png_path: str) -> None:
    """Training loss and eval metrics against step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(metrics_path) as f:
        records = [json.loads(line) for line in f]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    if evals:
        axes[0].plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-", label="eval")
    axes[0].set(xlabel="step", ylabel="loss", title="loss")
    axes[0].legend()
    key = next((k for k in ("auc", "recall@10", "recall@1") if evals and k in evals[0]), None)
    if key:
        axes[1].plot([r["step"] for r in evals], [r[key] for r in evals], "o-")
        axes[1].set(xlabel="step", ylabel=key, title=f"eval {key}")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


def write_summary(path: str, summary: Mapping) -> None:
    with open(path, "w") as f:
        json.dump(summary, f, indent=2)
