"""Where tests find the shipped Criteo sample: `$SPARSEJAX_DATA_DIR` (as the library
looks it up), else, in tests only, the `shared/data` folder beside the repository."""

import os
from pathlib import Path

CRITEO_SAMPLE = "criteo_kaggle_head10k/train_head10k.txt"
"""The sample's path relative to the data directory (as in configs/criteo_sample.yaml)."""


def data_dir() -> Path | None:
    """The data directory holding the Criteo sample, or None."""
    env = os.environ.get("SPARSEJAX_DATA_DIR")
    candidates = [Path(env)] if env else []
    candidates.append(Path(__file__).resolve().parents[2] / "shared" / "data")
    return next((d.resolve() for d in candidates if (d / CRITEO_SAMPLE).is_file()), None)


def write_criteo_like(path: Path, n: int = 200) -> None:
    """`n` random lines of the Criteo TSV's shape (label, 13 integers, 26 ids of 8 hex
    digits out of 30 values each)."""
    import numpy as np

    rng = np.random.default_rng(2)
    lines = []
    for _ in range(n):
        dense = [str(int(x)) for x in rng.integers(0, 20, 13)]
        cats = [f"{int(x):08x}" for x in rng.integers(0, 30, 26)]
        lines.append("\t".join([str(int(rng.random() < 0.3)), *dense, *cats]))
    Path(path).write_text("\n".join(lines) + "\n")


TWO_TOWER = [
    "data.kind=behavior",
    "data.batch_size=64",
    "data.eval_batches=1",
    "data.synthetic_options={num_users: 300, num_items: 240, num_categories: 12,"
    " max_history: 6, positives_only: true}",
    "model.name=two_tower",
    "model.embedding_dim=8",
    "model.options={user_features: [user, history], item_features: [item, category],"
    " tower: [16, 8], temperature: 0.05}",
]
"""Config overrides of a small two-tower run on synthetic behavior data (240 items)."""
