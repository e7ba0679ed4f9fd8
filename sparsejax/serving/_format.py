"""The model directory: what `sparsejax export` writes and `Predictor.load` reads.

```
MODEL_DIR/
  model.json             manifest: format version, versions, platforms, kernels,
                         features, preprocessing, tables, arrays (file, crc32, shape)
  exported/b<N>.jaxexport  the model's computation for batch size N (`jax.export`,
                         serialized): (params, tables, batch) -> scores
  arrays/*.npy           its arguments: dense parameters and stacked (maybe quantized)
                         tables, exactly as the exported computation takes them
  mappings/*.npy         id mappings: a vocabulary's kept raw ids, a dynamic table's keys
  example_request.json   a valid /v1/predict body built from real rows
  example_retrieve.json  a valid /v1/retrieve body (retrieval models)
```

Arguments are stored leaf by leaf as the exported function takes them (keyed by pytree
path), so loading needs no model code: a later sparsejax serves an older model as long
as the format version and the batch layout match, and says which does not.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping

import numpy as np

from .. import checkpoint

FORMAT = "sparsejax-model"
FORMAT_VERSION = 1
"""Bumped when a model dir written now could not be read correctly by older code."""
MANIFEST = "model.json"
EXAMPLE_REQUEST = "example_request.json"
EXAMPLE_RETRIEVE = "example_retrieve.json"
"""A /v1/retrieve body (retrieval models)."""


class ModelLoadError(RuntimeError):
    """A model dir that cannot be served here: missing, from an incompatible version or
    platform, or with a corrupt file. The message is one line naming the problem."""


def file_name(key: str) -> str:
    """A file-system-safe name for a pytree path or table name."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", key).strip("_") or "_"


def write_arrays(directory: str, arrays: Mapping[str, np.ndarray]) -> dict[str, dict]:
    """Each array in its own `.npy` (crc32 in the entry); `{key: entry}` for the manifest."""
    os.makedirs(directory, exist_ok=True)
    entries, used = {}, set()
    for key, a in arrays.items():
        name = file_name(key)
        while name in used:
            name += "_"
        used.add(name)
        entry = checkpoint.write_array(os.path.join(directory, name + ".npy"), np.asarray(a))
        entry["file"] = os.path.join(os.path.basename(directory), entry["file"])
        entries[key] = entry
    return entries


def read_array(model_dir: str, entry: Mapping) -> np.ndarray:
    """One array of the manifest, checked (size, crc32, shape, dtype)."""
    return checkpoint.read_array(
        os.path.join(model_dir, entry["file"]), dict(entry), error=ModelLoadError, what="model"
    )


def read_manifest(model_dir: str) -> dict:
    """The manifest of `model_dir`, its format and version checked."""
    path = os.path.join(model_dir, MANIFEST)
    if not os.path.isdir(model_dir):
        raise ModelLoadError(f"{model_dir} is not a directory")
    if not os.path.exists(path):
        raise ModelLoadError(
            f"{model_dir} is not a sparsejax model dir (no {MANIFEST}; write one with "
            f"`sparsejax export RUN_DIR --out {model_dir}`)"
        )
    try:
        with open(path) as fh:
            m = json.load(fh)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path} is unreadable: {e}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ModelLoadError(f"{path} is not a {FORMAT} manifest")
    version = m.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
        raise ModelLoadError(
            f"{model_dir}: model format version {version!r} (written by sparsejax "
            f"{m.get('sparsejax_version', '?')}); this sparsejax reads version "
            f"{FORMAT_VERSION}: export the run again with this version, or serve it with "
            f"the version that wrote it"
        )
    return m


def write_json(path: str, obj) -> None:
    """`obj` as JSON, written to a temporary file and renamed (never half a file)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1, sort_keys=False)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
