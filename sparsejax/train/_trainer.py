"""Train state and the jitted train / eval steps of any model with sparse embeddings."""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._peers import all_gather
from ..checkpoint import Layouts, tables_by_name, tables_from_layers
from ..data import SparseBatch
from ..embedding import default_mesh
from ..embedding.host import HostSides, host_side
from ..nn import (
    EMBEDDING,
    EMBEDDING_GRADS,
    EMBEDDING_LOOKUPS,
    apply_embedding_gradients,
    tables_on,
    trace_layers,
)
from ..ops import checks_enabled, surface_check_errors
from ..sharding import AXES, exchange_bytes, padding_batch, shard_batch
from . import _metrics


@flax.struct.dataclass
class TrainState:
    """Everything a step changes; donated to the step so tables update in place."""

    step: jax.Array  # i32[], optimizer steps taken
    params: Any  # dense parameters ("params" collection)
    opt_state: Any  # optax state of `params`
    tables: Any  # "embedding" collection: stacked weights and sparse optimizer slots
    rng: jax.Array  # u32[2] key data; step k uses fold_in(rng, k) for dropout


def binary_loss(logits: jax.Array, batch) -> jax.Array:
    """Mean sigmoid cross-entropy over the real (mask 1) examples."""
    per = optax.sigmoid_binary_cross_entropy(logits, batch.labels.astype(logits.dtype))
    return (per * batch.mask).sum() / jnp.maximum(batch.mask.sum(), 1.0)


def retrieval_queries(batch) -> jax.Array:
    """f32[B], 1 for the rows that are positive pairs, the queries of in-batch retrieval:
    real (mask 1) and labelled positive (label > 0; all-positive data such as event logs
    labels every row 1). A label-0 row (an item shown and not clicked) pairs a user with
    an item they did not pick, so it is no query; its item still serves as a negative of
    the other rows, as every real row's item does."""
    positive = batch.labels.reshape(batch.mask.shape[0], -1)[:, 0] > 0
    return jnp.where(positive, batch.mask, 0.0)


def retrieval_loss(scores: jax.Array, batch) -> jax.Array:
    """In-batch softmax, mean over the queries (`retrieval_queries`): row i's positive is
    column i, the other real columns (label-0 rows' items too) its negatives; padded
    columns are not negatives."""
    scores = jnp.where(batch.mask[None, :] > 0, scores, -1e9)
    per = -jnp.diagonal(jax.nn.log_softmax(scores, axis=-1))
    queries = retrieval_queries(batch)
    return (per * queries).sum() / jnp.maximum(queries.sum(), 1.0)


LOSSES: dict[str, Callable] = {"binary": binary_loss, "retrieval": retrieval_loss}


def _host(x):
    """`x` as a host array, gathered from every process when it spans several."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def shape_batch(batch):
    """`batch` with every id as an int32 zero (padding, a negative id, as -1): the shapes
    a model's init traces with. Ids' values never matter there (tables come from each
    store's `init`, dense parameters from the key), and raw ids are no rows of the
    device yet: a dynamic table's are 64-bit keys, a host-cached table's index its full
    vocabulary, not its device cache, until the host side maps them to cache slots."""
    if not isinstance(batch, SparseBatch):
        return batch
    features = {}
    for name, f in batch.features.items():
        if isinstance(f.ids, jax.Array):  # may span processes: stays on its devices
            ids = jnp.where(f.ids >= 0, 0, -1).astype(jnp.int32)
        else:  # host arrays; 64-bit keys (device ids are 32-bit) read as int64
            ids = np.asarray(f.ids)
            ids = ids.view(np.int64) if ids.dtype.itemsize == 8 else ids
            ids = np.where(ids >= 0, 0, -1).astype(np.int32)
        features[name] = dataclasses.replace(f, ids=ids)
    return dataclasses.replace(batch, features=features)


def _bucket(n: int) -> int:
    """`n` rounded up to 1/16 of the power of two below it (at most 6.25% more), at
    least 8: a few distinct capacities, so a few compiles."""
    if n <= 8:
        return 8
    g = 1 << max(int(n).bit_length() - 5, 0)
    return -(-n // g) * g


@dataclasses.dataclass
class _ExchangeStats:
    grows: int = 0
    steps: int = 0
    sent: int = 0
    needed: int = 0
    sent_ids: int = 0
    needed_ids: int = 0
    last: tuple = (0, 0, 0, 0)

    def add(self, b: tuple) -> None:
        self.steps += 1
        self.sent += b[0]
        self.needed += b[1]
        self.sent_ids += b[2]
        self.needed_ids += b[3]
        self.last = b

    def as_dict(self, capacity) -> dict:
        n = max(self.steps, 1)
        return {
            "capacity": dict(capacity),
            "grows": self.grows,
            "steps": self.steps,
            "sent_bytes": self.sent / n,
            "needed_bytes": self.needed / n,
            "sent_id_bytes": self.sent_ids / n,
            "needed_id_bytes": self.needed_ids / n,
            "last_sent_bytes": self.last[0],
            "last_needed_bytes": self.last[1],
        }


def _checked_wait(out):
    """`out`, waited for (with its host callbacks) in checked mode, so that a failed
    value check is raised by the step that failed it (asynchronous dispatch would raise
    it later, anywhere)."""
    if checks_enabled():
        out = jax.block_until_ready(out)
        jax.effects_barrier()
    return out


class Trainer:
    """Builds the train and eval steps of `model` (a Flax module taking a `SparseBatch`;
    its `task` class attribute picks the loss: "binary" or "retrieval").

    Dense parameters are updated by `tx` (optax); every `EmbeddingBagCollection` in the
    model by its tables' sparse optimizers, on touched rows only.

    Args:
      model: the Flax model.
      tx: the optax optimizer of the dense parameters.
      mesh: the devices the state and the steps live on (default: one device). Dense
        parameters are replicated on it, tables placed as each layer's `TableStore`
        places them on this mesh (the device store replicates them; a mesh axis the
        store cannot use is an error naming it). A batch is split along the mesh's
        "data" axis when it has one and the batch size divides by it (data parallel),
        and replicated otherwise.
      sparse_schedule: multiplier of every table's learning rate as a function of the
        updates already taken (`schedule(state.step)`, e.g. a `Schedule`); traced, so
        the rate changes every step without recompiling. None: constant rates. For the
        dense parameters, give `tx` the same schedule (`optax.adam(lambda t: lr *
        schedule(t))`: optax's count equals `state.step`).
      sparse_l2: L2 regularization of the touched embedding rows: the gradient of
        `0.5 * sparse_l2 * ||row||^2` is added to each row a batch looked up, once per
        row and step, before the sparse optimizer (untouched rows are not decayed; the
        cost grows with the looked-up ids, never with the table size).
    """

    def __init__(
        self,
        model: nn.Module,
        tx: optax.GradientTransformation,
        *,
        mesh: Mesh | None = None,
        sparse_schedule: Callable[[jax.Array], jax.Array] | None = None,
        sparse_l2: float = 0.0,
        exchange_headroom: float | None = 1.05,
        route_on_host: bool = False,
    ):
        self.model = model
        self.tx = tx
        self.sparse_schedule = sparse_schedule
        if not sparse_l2 >= 0:
            raise ValueError(f"Trainer: `sparse_l2` must be >= 0, got {sparse_l2!r}")
        self.sparse_l2 = float(sparse_l2)
        self.mesh = default_mesh() if mesh is None else mesh
        self.task = getattr(model, "task", "binary")
        if self.task not in LOSSES:
            raise ValueError(f"model task {self.task!r} is not one of {sorted(LOSSES)}")
        self.loss_fn = LOSSES[self.task]
        self._layouts: Layouts | None = None
        self._steps: dict[tuple[str, int], Callable] = {}
        if exchange_headroom is not None and not exchange_headroom >= 1:
            raise ValueError(
                f"Trainer: `exchange_headroom` must be >= 1, got {exchange_headroom!r}"
            )
        self.exchange_headroom = exchange_headroom
        self.route_on_host = bool(route_on_host)
        self.exchange_capacity: dict[str, int] = {}
        """Send-buffer slots per owner of each lookup group of the placed tables (set
        from the batches; setting one smaller forces a grow, e.g. in a test)."""
        self._exchange = _ExchangeStats()
        self._placed = None  # (layouts, their placed stores on the mesh)
        self.host: HostSides = HostSides()
        """Everything the model's tables do on the host between steps (`HostSide`: tiered
        tables' id mapping and row exchanges, host-executed tables' lookups and updates),
        from `init`; empty when no table has host work."""

    # ---- placement ------------------------------------------------------------------
    def _replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def _stores(self) -> Layouts:
        """Each embedding layer's store, on the trainer's mesh."""
        return {path: store.with_mesh(self.mesh) for path, store in self.layouts.items()}

    def state_sharding(self) -> TrainState:
        """The `NamedSharding`s of the state (after `init`), as a `TrainState` prefix
        tree: dense fields replicated, tables as their stores place them."""
        r = self._replicated()
        tables = tables_from_layers(
            self.layouts, {path: store.state_shardings() for path, store in self._stores().items()}
        )
        return TrainState(step=r, params=r, opt_state=r, tables=tables, rng=r)

    def _step_sharding(self) -> TrainState:
        """`state_sharding()` as the jitted steps see it: a host-executed layer's
        `"host"` part holds its pooled rows (in) and their gradient (out), replicated."""
        sharding = self.state_sharding()
        return sharding.replace(tables=self.host.step_sharding(sharding.tables, self._replicated()))

    def put_state(self, state: TrainState) -> TrainState:
        """`state` placed with `state_sharding()` (e.g. after a restore)."""
        return jax.device_put(state, self.state_sharding())

    @property
    def shards_batch(self) -> bool:
        """Whether a layer's tables are placed on the mesh (`sparsejax.sharding`): then
        every device takes its own `B / N` examples, ids included (after `init`)."""
        return self._layouts is not None and any(
            store.shards_batch for store in self._layouts.values()
        )

    def batch_sharding(self, batch_size: int):
        """The `NamedSharding`s of a `SparseBatch` of `batch_size` rows (a prefix tree).
        Placed tables: everything split over all devices. Otherwise dense features,
        labels and mask split along "data" when it divides the batch, and the ids
        replicated (the lookup reads whole tables on every device)."""
        r = self._replicated()
        if self.shards_batch:
            every = self._every()
            return SparseBatch(features=every, dense=every, labels=every, mask=every)
        n = dict(self.mesh.shape).get("data", 1)
        d = NamedSharding(self.mesh, PartitionSpec("data")) if batch_size % n == 0 else r
        return SparseBatch(features=r, dense=d, labels=d, mask=d)

    def put_batch(self, batch):
        """`batch` placed with `batch_sharding()` (a no-op if it already is). With placed
        tables, `batch` is this process's share of the global batch (all of it in one
        process): each feature is split per device (`shard_batch`) and the processes'
        shares become one global batch."""
        if not (self.shards_batch and isinstance(batch, SparseBatch)):
            return jax.device_put(batch, self._batch_prefix(batch))
        if isinstance(batch.mask, jax.Array) and batch.mask.sharding == self._every():
            return batch  # already placed
        batch = jax.tree.map(np.asarray, batch)
        local, first = self._local_devices()
        if self._placed is None or self._placed[0] is not self._layouts:
            self._placed = (self._layouts, [s for s in self._stores().values() if s.shards_batch])
        stores = self._placed[1]
        specs = {k: f for store in stores for k, f in store.batch_features().items()}
        counts: dict[str, np.ndarray] = {}
        batch = shard_batch(
            batch,
            specs,
            local,
            global_batch=batch.batch_size * jax.process_count(),
            first_device=first,
            stores=stores,
            route_on_host=self.route_on_host,
            counts=counts if self.exchange_headroom is not None else None,
        )
        if self.exchange_headroom is not None and counts:
            batch = self._size_exchange(batch, stores, counts, specs, first)
        return self._global(batch)

    def exchange_stats(self) -> dict:
        """The placed tables' exchange so far: `capacity` per group, `grows` (batches
        that needed larger send buffers, so a new compile: the first sizing is not
        counted), `steps` sized, and the bytes this process's devices sent per step to
        other devices in the lookup's all-to-alls (`sent_bytes`: ids, bags, pooling
        coefficients and the partial bags back) against the bytes that had to move
        (`needed_bytes`: the ids that go to another owner, and the same partial bags),
        as the mean over the steps and the last step (`last_*`)."""
        return self._exchange.as_dict(self.exchange_capacity)

    def _size_exchange(self, batch, stores, counts, specs, first):
        """Capacities from `counts` (the maximum over every process), grown if needed,
        written into the batch's features (`PaddedIds.exchange`), and the step's bytes."""
        names = sorted(counts)
        need = np.array([int(counts[g].max()) for g in names], np.int64)
        if jax.process_count() > 1:  # one program on every process: agree on the maximum
            # over the host (a device all-gather would wait for the step before)
            need = all_gather(need).max(0)
        for g, k in zip(names, need.tolist(), strict=True):
            cap = self.exchange_capacity.get(g)
            if cap is None or k > cap:
                self.exchange_capacity[g] = _bucket(int(np.ceil(k * self.exchange_headroom)))
                self._exchange.grows += cap is not None
        caps = tuple((g, self.exchange_capacity[g]) for g in names)
        features = dict(batch.features)
        for k in specs:
            if k in features:
                features[k] = dataclasses.replace(features[k], exchange=caps)
        self._exchange.add(exchange_bytes(stores, counts, self.exchange_capacity, batch, first))
        return dataclasses.replace(batch, features=features)

    def _every(self) -> NamedSharding:
        """Split along every mesh axis: one slice of the batch per device."""
        return NamedSharding(self.mesh, PartitionSpec(tuple(self.mesh.axis_names)))

    def _local_devices(self) -> tuple[int, int]:
        """This process's devices on the mesh: how many, and the mesh index of the first
        (they must be consecutive in the mesh's order, as `make_mesh` orders them)."""
        flat = list(self.mesh.devices.flat)
        mine = [i for i, d in enumerate(flat) if d.process_index == jax.process_index()]
        if not mine or mine != list(range(mine[0], mine[0] + len(mine))):
            raise ValueError(
                "Trainer: this process's devices are not consecutive on the mesh; build it "
                "with sparsejax.sharding.make_mesh"
            )
        return len(mine), mine[0]

    def _global(self, batch: SparseBatch) -> SparseBatch:
        """One global array per leaf from every process's share (split over all devices)."""
        every = self._every()
        if jax.process_count() == 1:
            return jax.device_put(batch, every)
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(every, np.asarray(x)), batch
        )

    def _batch_prefix(self, batch):
        if isinstance(batch, SparseBatch):
            return self.batch_sharding(batch.batch_size)
        return self._replicated()

    def _jitted(self, kind: str, batch) -> Callable:
        size = batch.batch_size if isinstance(batch, SparseBatch) else -1
        fn = self._steps.get((kind, size))
        if fn is None:
            shardings = (self._step_sharding(), self._batch_prefix(batch))
            if kind == "train":
                fn = jax.jit(
                    self._train_step,
                    donate_argnums=0,
                    in_shardings=shardings,
                    out_shardings=(self._step_sharding(), self._replicated()),
                )
            else:
                fn = jax.jit(self._eval_step, in_shardings=shardings)
            self._steps[(kind, size)] = fn
        return fn

    # ---- steps ----------------------------------------------------------------------
    # A value check of checked mode (`sparsejax.ops.checks()`) that fails in a step is
    # raised where the step is called, as its one-line IndexError / ValueError: the
    # steps surface it (`surface_check_errors`) and, in checked mode, wait for the step.
    @surface_check_errors()
    def train_step(self, state: TrainState, batch, next_batch=None) -> tuple[TrainState, dict]:
        """One jitted step (`state` is donated): `(new state, {"loss": loss})`, between
        the host side's `prepare` and `finish` (`self.host`): e.g. tiered tables' raw ids
        mapped to cache slots and rows exchanged first (while the previous step still
        runs), host-executed tables looked up before the step and updated after it.
        `next_batch` (the batch of the next call, if known) is handed to `finish`, which
        may work on it while this step runs (`self.host.looks_ahead`)."""
        state, batch = self.prepare_train(state, batch)
        state, metrics = _checked_wait(self._jitted("train", batch)(state, batch))
        return self.finish_train(state, next_batch), metrics

    @surface_check_errors()
    def prepare_train(self, state: TrainState, batch) -> tuple[TrainState, object]:
        """The host's part of `train_step` before the jitted step: the host side's
        `prepare`, then placing the batch on the mesh. The step's output goes to
        `finish_train`."""
        tables, batch = self.host.prepare(state.tables, batch, train=True)
        state = state.replace(tables=tables)
        if self.shards_batch:
            batch = self.put_batch(batch)
        return state, batch

    @surface_check_errors()
    def finish_train(self, state: TrainState, next_batch=None) -> TrainState:
        """The host's part of `train_step` after the jitted step: the host side's
        `finish` (e.g. host-executed tables' sparse update)."""
        return state.replace(tables=self.host.finish(state.tables, state.step, next_batch))

    @surface_check_errors()
    def eval_step(self, state: TrainState, batch) -> jax.Array:
        """The model's output on `batch` (jitted, no dropout)."""
        return self._eval(state, batch)[0]

    def _eval(self, state: TrainState, batch) -> tuple[jax.Array, object]:
        """`eval_step`'s output, and the batch it ran on (the global batch, when this
        process's share went through the host side and was placed)."""
        tables, batch = self.host.prepare(state.tables, batch, train=False)
        state = state.replace(tables=tables)
        if self.shards_batch:
            batch = self.put_batch(batch)
        return _checked_wait(self._jitted("eval", batch)(state, batch)), batch

    @property
    def layouts(self) -> Layouts:
        """Each embedding layer's `TableStore`, by module path, as of `init`
        (`sparsejax.nn.embedding_layouts(model, batch)` computes it anywhere)."""
        if self._layouts is None:
            raise RuntimeError(
                "Trainer.layouts: call Trainer.init first, or use "
                "sparsejax.nn.embedding_layouts(model, batch)"
            )
        return self._layouts

    def init(self, key: jax.Array, batch, *, tables: bool = True) -> TrainState:
        """Fresh state, placed on the mesh; `batch` fixes the shapes (any batch of the
        run's capacities).

        Dense parameters come from the model's (jitted) init; tables from each layer's
        `TableStore.init` (on the trainer's mesh) outside `jit`, which draws
        default-initialized tables with numpy instead of compiling one random op per
        table shape. With `tables=False` the tables are only described (each store's
        `abstract_state`: shapes, dtypes, shardings): a restore template that never
        holds a table beside the one the restore reads.
        """
        k_init, k_tables, k_rng = jax.random.split(key, 3)
        batch = shape_batch(batch)
        self._layouts = None
        if (
            self.mesh.size > 1
            and tuple(self.mesh.axis_names) == AXES
            and isinstance(batch, SparseBatch)
        ):
            # the shapes of a batch split per device, in case the layers' tables are
            # placed on the mesh (only the shapes count here)
            batch = self._global(
                padding_batch(jax.tree.map(np.asarray, batch), self._local_devices()[0])
            )
        with tables_on(self.mesh):
            layouts, expansions, shapes = trace_layers(self.model, batch)
        unknown = set(shapes) - {"params", EMBEDDING, EMBEDDING_GRADS, EMBEDDING_LOOKUPS}
        if unknown:
            raise ValueError(
                f"the model has variable collections {sorted(unknown)} that the "
                f"trainer does not know how to update"
            )
        self._layouts, self._steps = layouts, {}
        # tables are dropped inside the jit, so XLA never compiles their initializers
        params = jax.jit(lambda k: self._init_variables(k, batch).get("params", {}))(k_init)
        layer_keys = {
            path: jax.random.fold_in(k_tables, zlib.crc32("/".join(path).encode()))
            for path in layouts
        }
        table_state = tables_from_layers(
            layouts,
            {
                path: store.init(layer_keys[path]) if tables else store.abstract_state()
                for path, store in self._stores().items()
            },
        )
        self.host.close()
        self.host = host_side(
            self._stores(),
            self.mesh,
            layer_keys=layer_keys,
            expansions=expansions,
            schedule=self.sparse_schedule,
            l2=self.sparse_l2,
            process_count=jax.process_count(),
        )
        state = TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=self.tx.init(params),
            tables=None,
            rng=jax.random.key_data(k_rng),
        )
        if tables:
            return self.put_state(dataclasses.replace(state, tables=table_state))
        dense = dataclasses.replace(self.state_sharding(), tables=None)
        return dataclasses.replace(jax.device_put(state, dense), tables=table_state)

    def _init_variables(self, key, batch):
        """The model's `init`, its embedding layers on the trainer's mesh."""
        with tables_on(self.mesh):
            return self.model.init(key, batch)

    def tables_by_name(self, state: TrainState) -> dict:
        """`{layer path: {table: {"weights", "slots"}}}`, unstacked (e.g. to inspect)."""
        return tables_by_name(self.layouts, state.tables)

    def _apply(self, state, params, probe, batch, train, rng=None):
        variables = {"params": params, EMBEDDING: state.tables}
        if probe is not None:
            variables[EMBEDDING_GRADS] = probe
        with tables_on(self.mesh):
            out, aux = self.model.apply(
                variables,
                batch,
                train=train,
                mutable=[EMBEDDING_LOOKUPS],
                rngs=None if rng is None else {"dropout": rng},
            )
        return out, aux.get(EMBEDDING_LOOKUPS, {})

    def _zeros_probe(self, batch):
        """Zeros shaped like the pooled rows of every embedding layer at this batch size."""
        shapes = jax.eval_shape(self._init_variables, jax.random.key(0), batch)
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes.get(EMBEDDING_GRADS, {}))

    def _train_step(self, state: TrainState, batch) -> tuple[TrainState, dict]:
        rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)

        # named scopes (PROFILE_SCOPES) attribute the step's time in `sparsejax profile`:
        # "dense" holds the model and loss, forward and backward, but the lookups
        def loss_fn(params, probe):
            with jax.named_scope("dense"):
                out, lookups = self._apply(state, params, probe, batch, True, rng)
                return self.loss_fn(out, batch), lookups

        (loss, lookups), (g_params, g_rows) = jax.value_and_grad(
            loss_fn, argnums=(0, 1), has_aux=True
        )(state.params, self._zeros_probe(batch))
        step = state.step + 1
        scale = None if self.sparse_schedule is None else self.sparse_schedule(state.step)
        with jax.named_scope("sparse_update"):
            tables = apply_embedding_gradients(
                state.tables,
                lookups,
                g_rows,
                step=step,
                learning_rate_scale=scale,
                l2=self.sparse_l2,
            )
        with (
            jax.named_scope("dense_optimizer"),
            jax.numpy_dtype_promotion("standard"),  # optax's Adam mixes int counts and floats
        ):
            updates, opt_state = self.tx.update(g_params, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
        new = state.replace(step=step, params=params, opt_state=opt_state, tables=tables)
        return new, {"loss": loss}

    def _eval_step(self, state: TrainState, batch) -> jax.Array:
        out, _ = self._apply(state, state.params, None, batch, False)
        return out

    def evaluate(
        self, state: TrainState, batches, *, recall_k: tuple[int, ...] = (1, 10)
    ) -> dict[str, float]:
        """Metrics over all `batches` (padded rows excluded): loss, and AUC, logloss and
        calibration for "binary", recall@k for "retrieval" (in-batch). A retrieval
        model's loss and recall@k average over its queries (`retrieval_queries`: label-0
        rows are no positive pairs); `examples` counts the real rows."""
        outs, labels, masks, losses, recalls = [], [], [], [], {k: [] for k in recall_k}
        examples = 0.0
        for batch in batches:
            # this process's share -> the global batch (a host side that maps batches:
            # eval_step prepares them first, then places the batch)
            if self.shards_batch and not self.host.maps_batches:
                batch = self.put_batch(batch)
            with surface_check_errors():
                out, batch = self._eval(state, batch)
            out, batch = _host(out), jax.tree.map(_host, batch)
            mask = np.asarray(batch.mask)
            examples += mask.sum()
            if self.task == "binary":
                losses.append((float(self.loss_fn(out, batch)), mask.sum()))
                outs.append(out)
                labels.append(np.asarray(batch.labels))
                masks.append(mask)
            else:
                queries = np.asarray(retrieval_queries(batch))
                n = float(queries.sum())
                losses.append((float(self.loss_fn(out, batch)), n))
                for k in recall_k:
                    recall = _metrics.recall_at_k(out, k, mask, queries=queries)
                    recalls[k].append((recall if n else 0.0, n))
        if not losses:
            raise ValueError("evaluate: no eval batches")
        total = sum(n for _, n in losses)
        mean = sum(v * n for v, n in losses) / total if total else float("nan")
        result = {"loss": mean, "examples": int(examples)}
        if self.task == "binary":
            y, z, m = np.concatenate(labels), np.concatenate(outs), np.concatenate(masks)
            result |= {
                "auc": _metrics.auc(y, z, m),
                "logloss": _metrics.logloss(y, z, m),
                "calibration": _metrics.calibration(y, z, m),
            }
        else:
            for k, vals in recalls.items():
                result[f"recall@{k}"] = (
                    sum(v * n for v, n in vals) / total if total else float("nan")
                )
        return result
