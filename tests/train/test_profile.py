"""`sparsejax profile`: HLO instructions charged to the library's named scopes (and
collectives by opcode), overlapping events split so the parts sum to the busy time, the
embedding byte model, and a profile of a tiny run end to end: every part measured, the
trace and summaries written together, nothing left behind when profiling fails."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax import runner
from sparsejax.__main__ import main
from sparsejax.data import JaggedIds
from sparsejax.embedding import FeatureSpec, TableSpec
from sparsejax.ops import SGD, RowWiseAdagrad
from sparsejax.runner import _profile
from sparsejax.train import _profiling

TINY = [
    "progress=false",
    "data.batch_size=64",
    "data.eval_batches=1",
    "data.synthetic_options={vocab_sizes: [500, 300, 40], num_dense: 3}",
    "model.embedding_dim=8",
    "model.options={bottom: [16, 8], top: [16, 1]}",
]


def test_hlo_instructions_are_charged_to_the_innermost_scope():
    table = jnp.ones((100, 8))
    w = jnp.ones((8, 4))

    def step(table, w, ids):
        with jax.named_scope("embedding_lookup"):
            rows = table[ids]
        with jax.named_scope("dense"):
            loss, g = jax.value_and_grad(lambda w: jnp.tanh(rows @ w).sum())(w)
        with jax.named_scope("sparse_update"):
            table = table.at[ids].add(-0.1)
        return table, w - g, loss

    hlo = jax.jit(step).lower(table, w, jnp.arange(5)).compile().as_text()
    parts = _profiling.hlo_parts(hlo)
    found = set(parts.values())
    assert {"embedding_lookup", "dense", "sparse_update"} <= found
    assert found <= {*_profiling.PROFILE_SCOPES, "other_device"}
    meta = 'metadata={op_name="jit(s)/%s"}'
    fake = (
        "%fused_computation (p: f32[8]) -> f32[] {\n"
        f"  %tanh.1 = f32[8]{{0}} tanh(f32[8]{{0}} %p), {meta % 'dense/tanh'}\n"
        f"  %dot.7 = f32[8]{{0}} dot(f32[8]{{0}} %tanh.1), {meta % 'dense/dot_general'}\n"
        f"  ROOT %reduce.2 = f32[] reduce(f32[8]{{0}} %dot.7), {meta % 'reduce_sum'}\n"
        "}\n\n"
        "ENTRY %main {\n"
        f"  %all-reduce.3 = f32[8]{{0}} all-reduce(f32[8]{{0}} %p), {meta % 'dense/x'}\n"
        f"  %dot.1 = f32[8]{{0}} dot(f32[8]{{0}} %all-reduce.3), "
        f"{meta % 'transpose(jvp(dense))/dot'}\n"
        "  %copy.2 = f32[8]{0} copy(f32[8]{0} %dot.1)\n"
        f"  %fusion.4 = f32[8]{{0}} fusion(f32[8]{{0}} %p), {meta % 'dense_optimizer/add'}\n"
        f"  %fusion.5 = f32[] fusion(f32[8]{{0}} %p), calls=%fused_computation, "
        f"{meta % 'reduce_sum'}\n"
        "}\n"
    )
    assert _profiling.hlo_parts(fake) == {
        "all-reduce.3": "collectives",
        "dot.1": "dense",  # inside transpose(jvp(...))
        "copy.2": "dense",  # no metadata: its operand's part
        "fusion.4": "dense_optimizer",  # not "dense": a whole path component only
        "fusion.5": "dense",  # its root is outside every scope, what it fuses is not
        "tanh.1": "dense",
        "dot.7": "dense",
        "reduce.2": "other_device",
    }


def test_overlapping_events_are_split_and_sum_to_the_busy_time():
    events = [(0, 10, "a"), (5, 15, "b"), (20, 30, "a"), (22, 24, "c")]
    split = _profiling.split_overlaps(events)
    assert split == pytest.approx({"a": 5 + 2.5 + 8 + 1, "b": 2.5 + 5, "c": 1})
    assert sum(split.values()) == pytest.approx(_profiling._union([(s, e) for s, e, _ in events]))


def test_kernels_without_run_ids_are_cut_into_executions_at_the_widest_gaps():
    events = [(0, 5, "a"), (1, 2, "b"), (6, 7, "c"), (50, 51, "a"), (51.5, 52, "b")]
    events += [(90, 91, "a"), (93, 94, "c")]
    groups = _profiling.split_executions(events, 3)
    assert [[op for *_, op in g] for g in groups] == [["a", "b", "c"], ["a", "b"], ["a", "c"]]
    assert _profiling.split_executions(events, 1) == [sorted(events)]


def test_embedding_bytes_follow_the_byte_model():
    tables = [
        TableSpec(name="a", vocab_size=10, dim=4, optimizer=RowWiseAdagrad(learning_rate=0.1)),
        TableSpec(name="b", vocab_size=10, dim=2, dtype="bfloat16", optimizer=SGD(learning_rate=1)),
    ]
    features = [FeatureSpec(name="x", table="a"), FeatureSpec(name="y", table="b", max_ids=3)]
    from sparsejax.data import BatchPacker

    host = {
        "x": JaggedIds(np.array([1, 1]), np.array([3, 3])),
        "y": JaggedIds(np.array([3, 0]), np.array([1, 2, 1])),
    }
    batch = BatchPacker(tables, features, batch_size=2).pack(host, labels=np.zeros(2))
    got = _profiling.embedding_bytes(tables, features, batch.features, 2)
    lookup = 2 * (16 + 8) + 2 * 4 * 4 + 3 * (4 + 8) + 2 * 2 * 4
    update = 2 * (12 + 16) + 3 * (12 + 8) + 1 * 2 * (16 + 4) + 2 * 2 * (4 + 0)
    assert got == {"embedding_lookup": lookup, "sparse_update": update}


def test_profile_of_a_run_measures_every_part_and_writes_it_whole(tmp_path, capsys):
    cfg = runner.load_config([], [f"out_dir={tmp_path}", "name=p", *TINY])
    result = _profile.profile(cfg, steps=4, warmup=2, log=lambda _: None)
    parts = result.parts
    assert set(parts) == set(_profiling.PARTS)
    for p in ("embedding_lookup", "dense", "sparse_update", "dense_optimizer", "dispatch"):
        assert parts[p] > 0, p
    assert parts["collectives"] == 0 and result.unattributed_events == 0
    assert result.bytes["embedding_lookup"] > 0 and result.gbps("embedding_lookup") > 0
    assert result.copy_gbps > 0 and result.flops > 0 and result.gather_gbps > 0
    assert parts["host_tables"] == 0  # no host-executed tables here
    # measured, none a remainder: never more than the step (on a tiny step the tracer's
    # own cost is most of the traced time, so no lower bound here)
    assert 0 < result.coverage <= 1.05
    out = tmp_path / "p" / "profile"
    assert sorted(os.listdir(out)) == ["summary.json", "summary.png", "summary.txt", "trace"]
    saved = json.loads((out / "summary.json").read_text())
    assert saved["parts"] == pytest.approx(parts) and saved["coverage"] == pytest.approx(
        result.coverage
    )
    traces = [f for _, _, fs in os.walk(out / "trace") for f in fs]
    assert any(f.endswith(".xplane.pb") for f in traces) and "perfetto_trace.json.gz" in traces
    assert "embedding lookup" in (out / "summary.txt").read_text()
    assert "% of gather" in (out / "summary.txt").read_text()
    ckpts = tmp_path / "p" / "checkpoints"
    assert not ckpts.exists() or not os.listdir(ckpts)  # profiling saves nothing


@pytest.mark.parametrize("where", ["device_events", "_noop_step"])  # after / while tracing
def test_a_profile_that_fails_leaves_no_partial_profile(tmp_path, monkeypatch, where):
    cfg = runner.load_config([], [f"out_dir={tmp_path}", "name=p", *TINY])
    old = tmp_path / "p" / "profile"
    old.mkdir(parents=True)
    (old / "summary.txt").write_text("the previous profile")

    def broken(*a, **k):
        raise RuntimeError("trace unreadable")

    if where == "_noop_step":
        monkeypatch.setattr(_profiling, where, lambda *a: broken)  # fails in the traced steps
    else:
        monkeypatch.setattr(_profiling, where, broken)
    with pytest.raises(RuntimeError, match="trace unreadable"):
        _profile.profile(cfg, steps=2, warmup=1, log=lambda _: None)
    assert (old / "summary.txt").read_text() == "the previous profile"
    assert not [n for n in os.listdir(tmp_path / "p") if n.startswith("profile.")]


def test_profile_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["profile", f"out_dir={tmp_path}", "data.batch_sise=3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sparsejax: config error:") and "batch_sise" in err
    assert "\n" not in err
    with pytest.raises(SystemExit):
        main(["profile", "--steps", "0"])
    assert "expected an integer >= 1" in capsys.readouterr().err


def test_profile_steps_trace_a_window_of_a_training_run(tmp_path):
    cfg = runner.load_config(
        [], [f"out_dir={tmp_path}", "name=w", "steps=8", "profile_steps=[3, 2]", *TINY]
    )
    lines = []
    summary = runner.train(cfg, log=lines.append)
    assert summary["step"] == 8  # training went on to the end
    out = tmp_path / "w" / "profile_steps_3"
    saved = json.loads((out / "summary.json").read_text())
    assert saved["steps"] == [3, 4] and saved["unattributed_events"] == 0
    assert saved["parts"]["embedding_lookup"] > 0 and saved["parts"]["sparse_update"] > 0
    assert 0 < sum(saved["parts"].values()) <= 1.05 * saved["step_ms"]
    assert any(f"{out}/summary.txt" in ln for ln in lines)
    with pytest.raises(
        runner.ConfigError, match=r"profile_steps must be \[first, count\].*\[0, 5\]"
    ):
        runner.load_config([], [f"out_dir={tmp_path}", "profile_steps=[0, 5]"])


def test_profile_of_a_run_with_tiered_tables_times_the_host_exchange(tmp_path):
    """Dynamic tables behind a device cache: the host maps ids and exchanges rows before
    each step (once: profiling must not remap a remapped batch), timed as `host`."""
    cfg = runner.load_config(
        [],
        [
            f"out_dir={tmp_path}",
            "name=t",
            *TINY,
            "data.synthetic_options={vocab_sizes: [500, 300, 40], num_dense: 3}",
            "tables={'*': {dynamic: true, cache_rows: 200}, C3: {cache_rows: 0, max_rows: 40}}",
        ],
    )
    result = _profile.profile(cfg, steps=3, warmup=2, log=lambda _: None)
    assert result.parts["host"] > 0 and result.parts["embedding_lookup"] > 0
    assert result.unattributed_events == 0 and 0 < result.coverage <= 1.05


def test_profile_of_a_run_with_host_tables_times_their_host_work(tmp_path):
    """Host-executed tables: their lookup and update run on the host, outside the
    jitted step, timed as `host_tables` with the bytes they move; the device's
    embedding parts hold only the device table's."""
    cfg = runner.load_config(
        [],
        [
            f"out_dir={tmp_path}",
            "name=h",
            *TINY,
            "tables={C1: {placement: host}, C2: {placement: host}}",
        ],
    )
    result = _profile.profile(cfg, steps=3, warmup=2, log=lambda _: None)
    assert result.parts["host_tables"] > 0 and result.gbps("host_tables") > 0
    assert 0 < result.bytes["embedding_lookup"] < result.bytes["host_tables"]
    assert result.unattributed_events == 0 and 0 < result.coverage <= 1.05


def test_a_run_that_ends_inside_the_window_leaves_no_trace_running(tmp_path):
    cfg = runner.load_config(
        [], [f"out_dir={tmp_path}", "name=e", "steps=5", "profile_steps=[4, 5]", *TINY]
    )
    lines = []
    runner.train(cfg, log=lines.append)
    assert any("inside profile_steps; no profile" in ln for ln in lines)
    run_dir = tmp_path / "e"
    assert not [n for n in os.listdir(run_dir) if n.startswith("profile")]
    jax.profiler.start_trace(str(tmp_path / "t"))  # the profiler was stopped
    jax.profiler.stop_trace()


def test_a_run_that_fails_inside_the_window_leaves_no_partial_trace(tmp_path, monkeypatch):
    from sparsejax.train import Trainer

    calls = {"n": 0}
    step = Trainer.train_step

    def failing(self, state, batch):
        calls["n"] += 1
        if calls["n"] == 4:  # inside profile_steps [3, 3]
            raise RuntimeError("the machine caught fire")
        return step(self, state, batch)

    monkeypatch.setattr(Trainer, "train_step", failing)
    cfg = runner.load_config(
        [], [f"out_dir={tmp_path}", "name=f", "steps=8", "profile_steps=[3, 3]", *TINY]
    )
    with pytest.raises(RuntimeError, match="caught fire"):
        runner.train(cfg, log=lambda _: None)
    assert not [n for n in os.listdir(tmp_path / "f") if n.startswith("profile")]
    jax.profiler.start_trace(str(tmp_path / "t"))  # the profiler was stopped
    jax.profiler.stop_trace()


def test_profile_of_placed_tables_reports_the_exchange_bytes(tmp_path):
    over = ["sharding.devices=4", "sharding.model=4"]
    over += [f"tables.C{i}.placement=row_wise" for i in (1, 2, 3)]
    cfg = runner.load_config([], [f"out_dir={tmp_path}", "name=p", *TINY, *over])
    result = _profile.profile(cfg, steps=2, warmup=1, log=lambda _: None)
    ex = result.exchange
    assert ex["steps"] >= 3 and ex["capacity"]
    assert 0 < ex["needed_bytes"] <= ex["sent_bytes"] <= 1.25 * ex["needed_bytes"]
    saved = json.loads((tmp_path / "p" / "profile" / "summary.json").read_text())
    assert saved["exchange"]["sent_bytes"] == pytest.approx(ex["sent_bytes"])
    assert (
        "exchange (lookup all-to-alls" in (tmp_path / "p" / "profile" / "summary.txt").read_text()
    )
