"""`Predictor`: a model dir loaded for serving; raw examples in, probabilities out.

Loading checks the manifest's format version, the platform and (for models exported
with native kernels) that this process has those kernels, verifies every array file's
checksum, deserializes one `jax.export` computation per batch bucket and compiles them
all (warm-up), so no request ever waits for a compile. `predict` parses examples with
the run's own preprocessing (`_preprocess.Preprocessor`), pads them to the smallest
bucket that holds them (larger requests run in chunks of the largest), and runs the
exported computation.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import threading
import time
import weakref
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .._version import __version__
from ..data import BatchPacker, Examples
from ..embedding import FeatureSpec, TableSpec
from ..ops import cpu_ffi_available
from ._delta import DeltaError, patched, read_delta, updated_keys
from ._export import ITEM_EMBEDDINGS, _pad_batch, _scores, batch_arrays
from ._format import EXAMPLE_REQUEST, ModelLoadError, read_argument, read_array, read_manifest
from ._preprocess import KeyMapping, Preprocessor, RequestError, key_mapping, mapping_from_entry
from ._shared import SharedArrays

__all__ = ["ModelLoadError", "Predictor", "RequestError"]


def _native_kernels_ok(m: Mapping, model_dir: str) -> None:
    calls = m.get("custom_calls") or []
    if not calls:
        return
    if not cpu_ffi_available():
        raise ModelLoadError(
            f"{model_dir} was exported with native kernels ({', '.join(calls)}) but this "
            f"sparsejax has no C++ kernels built; reinstall with a C++ compiler or export "
            f"with --kernels xla"
        )
    if m.get("sparsejax_version") != __version__:
        raise ModelLoadError(
            f"{model_dir} was exported with native kernels by sparsejax "
            f"{m.get('sparsejax_version')}; this is {__version__}, whose kernels may differ: "
            f"export it again, or with --kernels xla (portable)"
        )


def _on_device(a: np.ndarray) -> jax.Array:
    """`a` committed to the default device, as every leaf of a predictor is: on CPU
    sharing `a`'s memory when it is 64-byte aligned (a table argument read piece by piece
    is), so a table is held once, not twice. One placement for every leaf, whatever the
    alignment of its host array: the compiled computations' inputs, and so the compiles
    and their keys in JAX's compilation cache, are the same in every process and after
    a delta replaces a leaf."""
    device = jax.devices()[0]
    if device.platform == "cpu" and a.size and a.ctypes.data % 64 == 0:
        try:
            got = jnp.from_dlpack(a)
            if got.committed and got.devices() == {device}:
                return got
        except (BufferError, TypeError, ValueError, RuntimeError):  # e.g. bfloat16
            pass
    return jax.device_put(a, device)


class _JoinedCall:
    """An exported computation whose batch arrays travel as one buffer per 4-byte dtype
    (int32 ids and segments, float32 dense values, mask and weights), split again inside
    the compiled call: one host-to-device copy each instead of one per array. The
    default model's batch is 54 arrays, and the call took ~300 us; joined, ~160."""

    _JOINED = (np.dtype(np.int32), np.dtype(np.float32))

    def __init__(self, exp: jax.export.Exported, num_model_args: int):
        batch = exp.in_avals[num_model_args:]
        self._groups = [
            [i for i, a in enumerate(batch) if a.dtype == d]
            for d in self._JOINED
            if any(a.dtype == d for a in batch)
        ]
        self._alone = [i for i, a in enumerate(batch) if a.dtype not in self._JOINED]
        shapes = [tuple(a.shape) for a in batch]

        def call(model, joined, alone):
            parts: list = [None] * len(batch)
            for group, buffer in zip(self._groups, joined, strict=True):
                start = 0
                for i in group:
                    size = int(np.prod(shapes[i]))
                    parts[i] = buffer[start : start + size].reshape(shapes[i])
                    start += size
            for i, a in zip(self._alone, alone, strict=True):
                parts[i] = a
            args, _ = jax.tree_util.tree_unflatten(exp.in_tree, [*model, *parts])
            return exp.call(*args)

        self._call = jax.jit(call)

    def __call__(self, model: Sequence[jax.Array], batch: Sequence[np.ndarray]):
        joined = [np.concatenate([batch[i].ravel() for i in group]) for group in self._groups]
        return self._call(model, joined, [batch[i] for i in self._alone])


_CALLS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
"""The computations of the predictors alive, by their exported bytes: a new version of
the same model (a reload, a publish folder's next full version) takes the compiled call
of the one it replaces instead of compiling it again (4-5 s of CPU for the default
model's 5 buckets, spent beside the requests being served)."""


class Predictor:
    """A loaded model dir (use `Predictor.load`). Thread-safe: `parse` anywhere, `score`
    and `predict` from any thread (one computation runs at a time per bucket)."""

    def __init__(self, model_dir: str, manifest: dict, *, max_examples: int = 4096):
        self.path = os.path.abspath(model_dir)
        self.manifest = m = manifest
        self.task = m["task"]
        self.version = str(m.get("version") or os.path.basename(self.path))
        platform = jax.default_backend()
        if platform not in m["platforms"]:
            raise ModelLoadError(
                f"{model_dir} was exported for {'/'.join(m['platforms'])} "
                f"(kernels {m['kernels']}); this process runs on {platform}: export with "
                f"--kernels xla for a portable model"
            )
        _native_kernels_ok(m, model_dir)
        self.buckets = tuple(int(b) for b in m["buckets"])
        self.features = tuple(FeatureSpec(**f) for f in m["features"])
        tables = [
            TableSpec(name=k, vocab_size=v["rows"], dim=v["dim"]) for k, v in m["tables"].items()
        ]
        self._packers = {
            b: BatchPacker(tables, self.features, batch_size=b, num_dense=m["num_dense"])
            for b in self.buckets
        }
        self._mapping_arrays = arrays = {
            k: read_array(model_dir, e) for k, e in m["mapping_arrays"].items()
        }
        self._max_examples = max_examples
        self._keys = {  # the dynamic tables' key rows (deltas change them)
            t: key_mapping(e, arrays) for t, e in m["mappings"].items() if e["kind"] == "keys"
        }
        self.preprocessor = self._preprocessor(self._keys)
        self._shared = SharedArrays.from_env()  # a worker of `serve --workers`
        self._shared_names: dict[str, str] = {}  # argument -> its shared array's name
        self._leaves = []
        for key, e in m["arguments"].items():  # one host array at a time, read in place
            self._leaves.append(_on_device(self._argument(model_dir, key, e)))
        publish = m.get("publish") or {}
        self.model_id = publish.get("model_id")
        self.created = os.path.getmtime(os.path.join(model_dir, "model.json"))
        self.base_version = None  # the full version the applied deltas started from
        self._calls = {}
        for b in self.buckets:
            path = os.path.join(model_dir, m["exported"][str(b)])
            try:
                with open(path, "rb") as fh:
                    blob = fh.read()
                exp = jax.export.deserialize(bytearray(blob))
            except Exception as e:  # noqa: BLE001 - any failure is a corrupt file here
                raise ModelLoadError(
                    f"{path} is not a readable exported computation ({type(e).__name__}: "
                    f"{str(e).splitlines()[0] if str(e) else ''})"
                ) from None
            self._check_layout(exp, b, path)
            key = (hashlib.sha256(blob).digest(), len(self._leaves))
            self._calls[b] = _CALLS.get(key) or _CALLS.setdefault(
                key, _JoinedCall(exp, len(self._leaves))
            )
        self._locks = {b: threading.Lock() for b in self.buckets}
        r = m.get("retrieval")
        self._temperature = None if r is None else r["temperature"]
        if r is not None:
            self._items = arrays[r["item_ids"]]
            self._item_embeddings = np.asarray(arrays[r["item_embeddings"]], np.float32)
        path = os.path.join(model_dir, EXAMPLE_REQUEST)
        self.example_request = {"examples": []}
        if os.path.exists(path):
            with open(path) as fh:
                self.example_request = json.load(fh)

    def _preprocessor(self, keys: Mapping[str, KeyMapping]) -> Preprocessor:
        """The request parser, with the dynamic tables' key rows `keys`."""
        m = self.manifest
        maps = {
            t: mapping_from_entry(e, self._mapping_arrays, keys.get(t))
            for t, e in m["mappings"].items()
        }
        return Preprocessor(
            m["input"],
            {f.name: maps[f.table] for f in self.features},
            {
                f.name: m["tables"][f.table]["rows"]
                if m["mappings"][f.table]["kind"] == "identity"
                else None
                for f in self.features
            },
            {f.name: f.max_ids for f in self.features if not f.is_sequence},
            max_examples=self._max_examples,
        )

    def _argument(self, model_dir: str, key: str, e: Mapping) -> np.ndarray:
        """One exported argument; a table argument of a worker of `serve --workers`
        from the workers' shared memory (made by the first worker that reads it)."""
        if self._shared is None or "pieces" not in e:
            return read_argument(model_dir, e)
        crcs = ",".join(str(p["crc32"]) for p in e["pieces"])
        name = f"{os.path.abspath(model_dir)}|{key}|{crcs}"
        self._shared_names[key] = name
        return self._shared.get(
            name, tuple(e["shape"]), e["dtype"], lambda out: read_argument(model_dir, e, out=out)
        )

    @classmethod
    def load(cls, model_dir: str, *, warmup: bool = True, max_examples: int = 4096) -> Predictor:
        """Load and check a model dir (a `ModelLoadError` names what is wrong); with
        `warmup`, compile every bucket now."""
        p = cls(model_dir, read_manifest(model_dir), max_examples=max_examples)
        if warmup:
            p.warmup()
        return p

    def with_delta(self, path: str) -> Predictor:
        """A predictor of this model with the delta at `path` applied (`_delta`): the
        arguments it changes are new arrays, the rest (and the compiled computations) are
        shared, and this predictor is left as it was. A `DeltaError` names a delta for
        another model or base version, or one that is corrupt or does not fit."""
        m = read_delta(path)
        if self.model_id is None or m["model_id"] != self.model_id:
            raise DeltaError(
                f"delta {path} is for model {m['model_id']}, this is "
                f"{self.model_id or 'a model exported without publishing'}"
            )
        if str(m["base"]) != self.version:
            raise DeltaError(
                f"delta {path} applies to version {m['base']}, this is version {self.version}"
            )
        at = {k: i for i, k in enumerate(self.manifest["arguments"])}
        served = {k: (lambda i=i: np.asarray(self._leaves[i])) for k, i in at.items()}
        if self._temperature is not None:  # a retrieval model: its catalog's embeddings
            served[ITEM_EMBEDDINGS] = lambda: self._item_embeddings
        make, names = None, dict(self._shared_names)
        if self._shared is not None:  # made once, in the workers' shared memory

            def make(key, shape, dtype, fill):
                name = f"{os.path.abspath(path)}|{key}"
                names[key] = name
                return self._shared.get(name, shape, dtype, fill)

        keys = updated_keys(path, m, self._keys)
        new = patched(path, m, served, make)
        embeddings = new.pop(ITEM_EMBEDDINGS, None)
        leaves = list(self._leaves)
        for k, a in new.items():
            leaves[at[k]] = _on_device(a)
        out = copy.copy(self)
        out._leaves, out._shared_names = leaves, names
        if embeddings is not None:
            out._item_embeddings = embeddings
        if keys is not self._keys:
            out._keys, out.preprocessor = keys, self._preprocessor(keys)
        out.version = str(m["version"])
        out.created = float(m["created"])
        out.base_version = self.base_version or self.version
        out.manifest = {**self.manifest, "source": {**self.manifest["source"], "step": m["step"]}}
        return out

    def release_shared(self, successor: Predictor | None = None) -> None:
        """Remove the shared-memory files (`serve --workers`) of this predictor's arrays
        that `successor` does not use: the workers that map them keep their mappings,
        and one that needs them again makes them again."""
        if self._shared is None:
            return
        keep = set() if successor is None else set(successor._shared_names.values())
        for name in set(self._shared_names.values()) - keep:
            self._shared.forget(name)

    def _check_layout(self, exp, b: int, path: str) -> None:
        """The exported computation takes this version's batch layout (same leaves,
        shapes and dtypes as the packer's), or the load is refused."""
        pad = jax.tree.leaves(batch_arrays(_pad_batch(self._packers[b])))
        avals = exp.in_avals[len(self._leaves) :]
        ours = [(tuple(a.shape), str(a.dtype)) for a in pad]
        theirs = [(tuple(a.shape), str(a.dtype)) for a in avals]
        if len(exp.in_avals) != len(self._leaves) + len(pad) or ours != theirs:
            raise ModelLoadError(
                f"{path}: the exported computation takes a batch laid out as "
                f"{theirs[:3]}..., this sparsejax packs {ours[:3]}...: export the run again "
                f"with this version"
            )

    def warmup(self) -> None:
        """Compile (and run once) every bucket's computation."""
        for b in self.buckets:
            self._run(b, batch_arrays(_pad_batch(self._packers[b])))

    # ---- the work -------------------------------------------------------------------------
    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    @property
    def info(self) -> dict:
        m = self.manifest
        return {
            "path": self.path,
            "version": self.version,
            "model": m["model"],
            "task": self.task,
            "format_version": m["format_version"],
            "created": m["created"],
            "quantize": m["quantize"],
            "kernels": m["kernels"],
            "buckets": list(self.buckets),
            "features": list(self.preprocessor.fields),
            "source": m["source"],
            "model_id": self.model_id,
            "full_version": self.base_version or self.version,
            "version_created": self.created,
            "version_age_s": round(time.time() - self.created, 3),
        }

    def parse(self, examples: Sequence[Mapping]) -> Examples:
        """The examples' mapped ids and dense values (a `RequestError` if any is bad)."""
        return self.preprocessor.parse(examples)

    def _run(self, b: int, arrays: Mapping[str, np.ndarray]):
        """The bucket-`b` computation's outputs (numpy) on packed batch `arrays`."""
        with self._locks[b]:
            return jax.tree.map(np.asarray, self._calls[b](self._leaves, jax.tree.leaves(arrays)))

    def _bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        return self.buckets[-1]

    def score(self, parsed: Sequence[Examples]) -> list[np.ndarray]:
        """Probabilities for each parsed request, in order, from as few computations as
        the buckets allow (the requests are joined, then cut at the largest bucket)."""
        parsed = list(parsed)
        if not parsed:
            return []
        ex = parsed[0] if len(parsed) == 1 else Examples.concat(parsed)
        n, big, out = len(ex), self.buckets[-1], []
        for start in range(0, n, big):
            part = ex if n <= big and start == 0 else ex[start : start + big]
            k = len(part)
            b = self._bucket(k)
            batch = self._packers[b].pack(part.sparse, labels=part.labels, dense=part.dense)
            got = _scores(self._run(b, batch_arrays(batch)), self.task, self._temperature)
            out.append(got[:k].astype(np.float32))
        scores = out[0] if len(out) == 1 else np.concatenate(out)
        sizes = np.cumsum([len(p) for p in parsed])[:-1]
        return np.split(scores, sizes)

    def predict(self, examples: Sequence[Mapping]) -> np.ndarray:
        """Scores (f32[n]) of raw examples (JSON-like dicts of feature values): a binary
        model's probabilities; a retrieval model's user-item scores."""
        return self.score([self.parse(examples)])[0]

    def retrieve(self, user: Mapping, k: int = 10) -> tuple[list[int], np.ndarray]:
        """The `k` catalog items scoring highest for `user` (a retrieval model's raw user
        features), best first: (item ids, scores), exact over the whole catalog (one
        matrix product with the item tower's embeddings, made at export)."""
        r = self.manifest.get("retrieval")
        if r is None:
            raise RequestError(
                f"model {self.version} is a {self.task} model: /v1/retrieve needs a "
                f"two-tower (retrieval) model (use /v1/predict)"
            )
        if type(k) is not int or not 1 <= k <= self._items.shape[0]:
            raise RequestError(f"k must be an integer in [1, {self._items.shape[0]}], got {k!r}")
        if not isinstance(user, Mapping):
            raise RequestError(f"user: expected an object of feature values, got {user!r}")
        ex = self.parse([user])
        batch = self._packers[self.buckets[0]].pack(ex.sparse, labels=ex.labels, dense=ex.dense)
        u = self._run(self.buckets[0], batch_arrays(batch))[0][0]
        scores = self._item_embeddings @ u / r["temperature"]
        top = np.argpartition(-scores, k - 1)[:k]
        top = top[np.argsort(-scores[top], kind="stable")]
        return [int(i) for i in self._items[top]], scores[top].astype(np.float32)
