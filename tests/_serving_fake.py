"""A tiny deterministic stand-in for `sparsejax.serving.Predictor`, for the server and
batcher tests and the load benchmark's test.

A binary model's score of an example is `offset + sum of its feature values`; features
are "a", "b", "c" (numbers). An unknown feature or a value that is not a number is a
`RequestError` naming the example and feature, as the real predictor's are. A model dir
for `load` is a folder with a model.json: {"version": ..., "offset": ..., "task": ...,
"delay": seconds per score call, "broken": true to fail the load}.
"""

from __future__ import annotations

import json
import os
import threading
import time

import numpy as np

from sparsejax.serving._predictor import ModelLoadError, RequestError

FEATURES = ("a", "b", "c")


class FakeParsed:
    __slots__ = ("values",)

    def __init__(self, values: np.ndarray):
        self.values = values

    def __len__(self) -> int:
        return len(self.values)


class FakePredictor:
    def __init__(
        self,
        version: str = "1",
        *,
        offset: float = 0.0,
        task: str = "binary",
        buckets: tuple[int, ...] = (1, 8, 64),
        delay: float = 0.0,
        fail_score: bool = False,
    ):
        self.version = version
        self.offset = offset
        self.task = task
        self.buckets = buckets
        self.delay = delay
        self.fail_score = fail_score
        self.calls: list[list[int]] = []  # per score call: the examples of each input
        self.parses: list[int] = []  # per parse call: its examples
        self.plain_errors = False  # True: errors that name no example index
        self._lock = threading.Lock()
        self.info = {"path": None, "version": version, "format": "fake", "task": task}
        self.example_request = {"examples": [{"a": 1.0, "b": 2.0, "c": 3}, {"a": 0.5}]}

    def parse(self, examples) -> FakeParsed:
        with self._lock:
            self.parses.append(len(examples))
        values = []
        for i, ex in enumerate(examples):
            total = 0.0
            for name, value in ex.items():
                where = "" if self.plain_errors else f"example {i}: "
                if name not in FEATURES:
                    raise RequestError(f"{where}unknown feature {name!r}")
                if type(value) not in (int, float):
                    raise RequestError(f"{where}feature {name!r} must be a number, got {value!r}")
                total += value
            values.append(total)
        return FakeParsed(np.asarray(values, np.float64))

    def score(self, parsed) -> list[np.ndarray]:
        with self._lock:
            self.calls.append([len(p) for p in parsed])
        if self.delay:
            time.sleep(self.delay)
        if self.fail_score:
            raise RuntimeError("the model fell over")
        return [(p.values + self.offset).astype(np.float32) for p in parsed]

    def predict(self, examples) -> np.ndarray:
        return self.score([self.parse(examples)])[0]

    def retrieve(self, user, k: int):
        if self.task != "retrieval":
            raise RuntimeError("not a retrieval model")
        (u,) = self.parse([user]).values
        items = np.arange(100, 110, dtype=np.int64)  # raw item ids 100..109
        scores = (u * (items - 104.5) + self.offset).astype(np.float32)
        top = np.argsort(-scores, kind="stable")[:k]
        return [int(i) for i in items[top]], scores[top]


def write_model(path, *, version: str, offset: float = 0.0, **kw) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "model.json"), "w") as f:
        json.dump({"version": version, "offset": offset, **kw}, f)
    return str(path)


def load(model_dir: str) -> FakePredictor:
    """The fake `Predictor.load`."""
    try:
        with open(os.path.join(model_dir, "model.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{model_dir}: cannot read model.json ({e})") from None
    if meta.get("broken"):
        raise ModelLoadError(f"{model_dir}: table file emb_0.npy is corrupt")
    return FakePredictor(
        meta["version"],
        offset=meta.get("offset", 0.0),
        task=meta.get("task", "binary"),
        delay=meta.get("delay", 0.0),
    )
