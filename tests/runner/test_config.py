"""Layered configs: every shipped config validates; unknown or mistyped keys are errors
naming the key and the closest valid one; layering and overrides compose."""

import pathlib

import pytest

from sparsejax import runner
from sparsejax.runner import ConfigError, _config, _optim

CONFIGS = sorted((pathlib.Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_validates(path):
    cfg = runner.load_config([path])
    assert cfg.model.name in runner.MODELS
    opt = runner.sparse_optimizer(cfg.optimizer)
    assert type(opt).__name__.lower() == cfg.optimizer.sparse.replace("_", "")
    assert opt.learning_rate == cfg.optimizer.sparse_learning_rate


def test_default_config_is_the_no_argument_run():
    root = CONFIGS[0].parent
    assert runner.load_config([root / "default.yaml"]) == runner.RunConfig()


def test_layering_and_overrides(tmp_path):
    (tmp_path / "base.yaml").write_text("steps: 10\ndata: {batch_size: 32, zipf: 1.3}\n")
    (tmp_path / "exp.yaml").write_text("base: base.yaml\ndata: {batch_size: 64}\n")
    cfg = runner.load_config(
        [tmp_path / "exp.yaml"],
        [
            "data.prefetch=7",
            "optimizer.dense_learning_rate=1e-4",
            "model.options={bottom: [8, 16]}",
        ],
    )
    assert (cfg.steps, cfg.data.batch_size, cfg.data.zipf, cfg.data.prefetch) == (10, 64, 1.3, 7)
    assert cfg.optimizer.dense_learning_rate == pytest.approx(1e-4)
    assert cfg.model.options == {"bottom": [8, 16]}
    assert runner.config_from_dict(_config.to_dict(cfg)) == cfg  # round trip


@pytest.mark.parametrize(
    "override,message",
    [
        ("data.batch_sise=3", "unknown config key 'data.batch_sise'; did you mean 'batch_size'"),
        ("stesp=3", "unknown config key 'stesp'; did you mean 'steps'"),
        ("model.options={botom: [1]}", "'model.options.botom'; did you mean 'bottom'"),
        ("optimizer.sparse_options={epz: 1}", "'optimizer.sparse_options.epz'; did you mean 'eps'"),
        ("data.batch_size=many", "'data.batch_size': expected an int, got 'many'"),
        ("data.shuffle=3", "'data.shuffle': expected true/false, got 3"),
        ("model.name=dlrn", "'model.name': 'dlrn' is not one of"),
        ("steps=0", "`steps` must be >= 1"),
        ("epochs=2", "set exactly one of `steps` and `epochs`"),
        ("data", "must look like key.sub=value"),
        ("data.stream=true", "data.stream is for file data"),
        (
            "data.synthetic_options={num_dens: 3}",
            "'data.synthetic_options.num_dens'; did you mean 'num_dense'",
        ),
    ],
)
def test_errors_name_the_key(override, message):
    with pytest.raises(ConfigError, match=__import__("re").escape(message)):
        runner.load_config([], [override])


STREAM = [
    "data.kind=criteo",
    "data.train=a.tsv",
    "data.eval=b.tsv",
    "data.stream=true",
    "data.id_mapping=hash",
]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["steps=null", "epochs=2"], "`epochs` with data.stream: a stream's length is not known"),
        (["eval_every=epoch"], "eval_every=epoch with data.stream: a stream has no known"),
    ],
)
def test_a_stream_is_refused_what_needs_its_length_at_load(overrides, message):
    with pytest.raises(ConfigError, match=__import__("re").escape(message)):
        runner.load_config([], [*STREAM, *overrides])


def test_base_cycles_and_bad_files(tmp_path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match="includes itself"):
        runner.load_config([tmp_path / "a.yaml"])
    (tmp_path / "bad.yaml").write_text("steps: [1\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        runner.load_config([tmp_path / "bad.yaml"])


def test_file_data_needs_a_path(tmp_path):
    cfg = runner.load_config([], ["data.kind=criteo"])
    with pytest.raises(ConfigError, match="needs data.path"):
        runner.build_data(cfg)


def test_data_path_is_found_in_the_working_dir_then_in_the_data_dir(tmp_path, monkeypatch):
    (tmp_path / "data" / "sub").mkdir(parents=True)
    (tmp_path / "data" / "sub" / "x.tsv").write_text("")
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    monkeypatch.delenv(runner.DATA_DIR_ENV, raising=False)
    with pytest.raises(ConfigError) as e:
        runner.resolve_data_path("sub/x.tsv")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("data.path='sub/x.tsv': no such file")
    assert str(tmp_path / "cwd" / "sub" / "x.tsv") in msg and "SPARSEJAX_DATA_DIR is not set" in msg
    monkeypatch.setenv(runner.DATA_DIR_ENV, str(tmp_path / "data"))
    assert runner.resolve_data_path("sub/x.tsv") == str(tmp_path / "data" / "sub" / "x.tsv")
    (tmp_path / "cwd" / "sub").mkdir()
    (tmp_path / "cwd" / "sub" / "x.tsv").write_text("")  # the working directory comes first
    assert runner.resolve_data_path("sub/x.tsv") == str(tmp_path / "cwd" / "sub" / "x.tsv")
    with pytest.raises(
        ConfigError,
        match=r"data.path='nope.tsv': no such file \(looked for "
        r".*cwd/nope.tsv, .*data/nope.tsv\)$",
    ):
        runner.build_data(runner.load_config([], ["data.kind=criteo", "data.path=nope.tsv"]))


def test_no_shipped_config_names_a_path_outside_the_repository():
    for path in CONFIGS:
        cfg = runner.load_config([path])
        for value in (cfg.data.path, cfg.out_dir):
            assert value is None or not (value.startswith(("/", "..")) or "shared/" in value), (
                path.name,
                value,
            )


def _root():
    return CONFIGS[0].parent


def test_an_override_replaces_a_mapping_with_bang_equals(tmp_path):
    criteo = _root() / "criteo_sample.yaml"
    merged = runner.load_config([criteo], ["optimizer.sparse_options={eps: 1.0e-6}"])
    assert merged.optimizer.sparse_options == {"initial_accumulator_value": 0.0, "eps": 1e-6}
    cleared = runner.load_config([criteo], ["optimizer.sparse_options!={}"])
    assert cleared.optimizer.sparse_options == {}
    replaced = runner.load_config([criteo], ["optimizer.sparse_options!={eps: 1.0e-6}"])
    assert replaced.optimizer.sparse_options == {"eps": 1e-6}
    # in YAML: the !replace tag, at any depth and through base: chains
    (tmp_path / "exp.yaml").write_text(
        f"base: {criteo}\noptimizer:\n  sparse_options: !replace {{eps: 1.0e-7}}\n"
    )
    cfg = runner.load_config([tmp_path / "exp.yaml"], ["optimizer.sparse_learning_rate=0.1"])
    assert cfg.optimizer.sparse_options == {"eps": 1e-7}
    assert cfg.optimizer.sparse_learning_rate == 0.1
    assert runner.config_from_dict(_config.to_dict(cfg)) == cfg  # no marker left behind
    (tmp_path / "bad.yaml").write_text("optimizer: !replace 3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml is not valid YAML \(line 1, column 12: "):
        runner.load_config([tmp_path / "bad.yaml"])


def test_switching_the_sparse_optimizer_or_the_model_drops_the_old_options():
    criteo = _root() / "criteo_sample.yaml"  # adagrad with initial_accumulator_value
    cfg = runner.load_config([criteo], ["optimizer.sparse=lazy_adam"])
    assert cfg.optimizer.sparse == "lazy_adam" and cfg.optimizer.sparse_options == {}
    assert type(runner.sparse_optimizer(cfg.optimizer)).__name__ == "LazyAdam"
    for order in (1, -1):  # the command line is one layer: its own options are kept
        overrides = ["optimizer.sparse=lazy_adam", "optimizer.sparse_options={b1: 0.8}"]
        cfg = runner.load_config([criteo], overrides[::order])
        assert cfg.optimizer.sparse_options == {"b1": 0.8}
    same = runner.load_config([criteo], ["optimizer.sparse=adagrad"])  # not a switch
    assert same.optimizer.sparse_options == {"initial_accumulator_value": 0.0, "eps": 1e-10}
    deepfm = runner.load_config([_root() / "dlrm_criteo.yaml"], ["model.name=deepfm"])
    assert deepfm.model.options == {}  # dlrm's bottom/top would be unknown to DeepFM


def test_the_runner_checks_what_cannot_work_at_load_time():
    criteo = _root() / "criteo_sample.yaml"  # an epochs config
    with pytest.raises(ConfigError, match="add epochs=null to train 50 steps") as e:
        runner.load_config([criteo], ["steps=50"])
    assert "\n" not in str(e.value)
    assert runner.load_config([criteo], ["steps=50", "epochs=null"]).steps == 50
    for override, message in [
        ("keep_checkpoints=0", "`keep_checkpoints` must be >= 1, got 0"),
        ("data.eval_batches=0", "eval_batches must be >= 1"),
        ("data.batch_size=0", "batch_size must be >= 1"),
        ("epochs=2", "`epochs` needs file data"),
    ]:
        extra = ["steps=null"] if override.startswith("epochs") else []
        with pytest.raises(ConfigError, match=message):
            runner.load_config([], [override, *extra])


def test_docs_config_md_is_the_generated_schema_reference():
    path = _root().parent / "docs" / "config.md"
    assert path.read_text() == runner.config_reference(), (
        "docs/config.md is out of date: run `sparsejax config --schema > docs/config.md`"
    )


def test_schema_reference_documents_every_top_level_key():
    docs = _config.field_docs(runner.RunConfig)
    fields = [f.name for f in __import__("dataclasses").fields(runner.RunConfig)]
    assert set(fields) - set(docs) <= {"data", "model", "optimizer"}, set(fields) - set(docs)
    ref = runner.config_reference()
    for key in ("`steps` (int | null; default `300`)", "`data.batch_size`", "`optimizer.sparse`"):
        assert key in ref
    assert "`key!=value`" in ref and "!replace" in ref and "`data.prefetch`" in ref


# ---------------------------------------------------------------------------------------
# Values checked at load, before anything is created; late refusals leave nothing


def _train_cli(tmp_path, capsys, *overrides) -> str:
    """`sparsejax train` in-process: exit 2 and the one line it printed."""
    from sparsejax.__main__ import main

    code = main(["train", f"out_dir={tmp_path / 'runs'}", "progress=false", *overrides])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, (code, err)
    return err


@pytest.mark.parametrize(
    "override,message",
    [
        ("optimizer.sparse_learning_rate=-0.05", "'optimizer.sparse_learning_rate' must be > 0"),
        ("optimizer.dense_learning_rate=-1e-3", "'optimizer.dense_learning_rate' must be > 0"),
        ("model.embedding_dim=-1", "'model.embedding_dim' must be >= 1, got -1"),
        ("seed=-1", "'seed' must be >= 0, got -1"),
        ("data.zipf=0", "'data.zipf' must be > 0"),
        ("optimizer.sparse_options={eps: -1}", "'optimizer.sparse_options.eps' must be >= 0"),
        ("model.options={bottom: [-1, 16]}", "'model.options.bottom' must be >= 1, got [-1, 16]"),
        ("model.options={top: [64, 8]}", "'model.options.top' must end with 1"),
        ("model.options={bottom: wide}", "'model.options.bottom': expected a list, got 'wide'"),
        ("model.options={embedding_dim: 8}", "unknown config key 'model.options.embedding_dim'"),
        (
            "data.synthetic_options={num_dense: -2}",
            "'data.synthetic_options.num_dense' must be >= 0",
        ),
        ("data.synthetic_options={zipf: 2}", "unknown config key 'data.synthetic_options.zipf'"),
        (
            "tables={C1: {compose: {kind: qr, fraction: 1.5}}}",
            "'tables.C1.compose.fraction' must be in (0, 1]",
        ),
    ],
)
def test_out_of_range_values_are_refused_at_load(tmp_path, capsys, override, message):
    err = _train_cli(tmp_path, capsys, override)
    assert message in err, err
    assert not (tmp_path / "runs").exists()  # refused before anything was created


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["optimizer.sparse=lazy_adam", "optimizer.sparse_options={b1: 1.5}"],
            "'optimizer.sparse_options.b1' must be in [0, 1), got 1.5",
        ),
        (
            ["model.name=two_tower", "model.options={temperature: -0.1}"],
            "'model.options.temperature' must be > 0, got -0.1",
        ),
        (
            ["model.name=dcnv2", "model.options={structure: stacke}"],
            "'model.options.structure': 'stacke' is not one of ['stacked', 'parallel']",
        ),
        (
            ["model.name=two_tower", "model.options={temperature: '5e-2'}"],
            None,  # YAML 1.1 reads 5e-2 as a string: converted to the option's type
        ),
    ],
)
def test_options_are_typed_and_in_range_for_the_class_they_configure(overrides, message):
    if message is None:
        assert runner.load_config([], overrides).model.options == {"temperature": 0.05}
        return
    with pytest.raises(ConfigError) as e:
        runner.load_config([], overrides)
    assert message in str(e.value)


def _minus_one_labels(tmp_path) -> list[str]:
    """A Criteo file whose -1 labels stop the read: refused after the run directory was
    made (the data is read after the lock is taken)."""
    line = "\t".join(["-1", *["1"] * 13, *["a1"] * 26])
    (tmp_path / "day.tsv").write_text(f"{line}\n" * 10)
    return ["data.kind=criteo", f"data.path={tmp_path / 'day.tsv'}"]


def test_a_late_refusal_leaves_no_run_directory(tmp_path, capsys):
    """The directories this invocation made are removed, out_dir included."""
    err = _train_cli(tmp_path, capsys, *_minus_one_labels(tmp_path))
    assert "day.tsv: line 1: label -1" in err and "traceback in" not in err
    assert not (tmp_path / "runs").exists()


def test_a_late_refusal_keeps_the_previous_runs_files(tmp_path, capsys):
    """In a run directory that was there before, only what this invocation added goes."""
    run = tmp_path / "runs" / "default"
    run.mkdir(parents=True)
    (run / "notes.txt").write_text("mine\n")
    (run / "run.log").write_text("an earlier attempt\n")
    _train_cli(tmp_path, capsys, *_minus_one_labels(tmp_path))
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt", "run.log"]
    assert (run / "notes.txt").read_text() == "mine\n"
    log = (run / "run.log").read_text()  # the refused attempt is appended to its log
    assert log.startswith("an earlier attempt\n") and "day.tsv: line 1: label -1" in log


def test_a_directory_as_data_path_is_named_a_directory(tmp_path, capsys):
    (tmp_path / "parts").mkdir()
    err = _train_cli(tmp_path, capsys, "data.kind=criteo", f"data.path={tmp_path / 'parts'}")
    assert f"{tmp_path / 'parts'} is a directory, not a file" in err and "no such file" not in err
    assert "parts/*.csv" in err
    assert not (tmp_path / "runs").exists()


def test_a_binary_config_file_is_named(tmp_path, capsys):
    from sparsejax.__main__ import main

    (tmp_path / "model.bin").write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ConfigError) as e:
        runner.load_config([tmp_path / "model.bin"])
    assert str(e.value).startswith(f"config file {tmp_path / 'model.bin'} ")
    assert main(["config", str(tmp_path / "model.bin")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.bin" in err


# ---------------------------------------------------------------------------------------
# docs/config.md: every key, each model's options


def _section(ref: str, head: str) -> str:
    return ref.split(head, 1)[1].split("\n#", 1)[0]


@pytest.mark.parametrize(
    "kind_key,key,classes",
    [
        ("model.name", "model.options", runner.MODELS),
        (
            "optimizer.sparse",
            "optimizer.sparse_options",
            _optim._SPARSE,
        ),
    ],
    ids=["model", "sparse_optimizer"],
)
def test_the_reference_documents_exactly_the_options_a_config_may_set(kind_key, key, classes):
    """Per class: an option is documented (with its meaning) iff the config accepts it."""
    import dataclasses

    ref = runner.config_reference()
    common = _section(ref, f"## `{key}` by `{kind_key}`")
    for name, cls in classes.items():
        section = common + _section(ref, f"### `{kind_key}: {name}` ({cls.__name__})")
        for f in dataclasses.fields(cls):
            documented = f"- `{key}.{f.name}` (" in section
            try:
                runner.load_config([], [f"{kind_key}={name}", f"{key}={{{f.name}: []}}"])
                accepted = True
            except ConfigError as e:
                accepted = "unknown config key" not in str(e)
            assert documented == accepted, (name, f.name, documented, accepted)
        for line in section.splitlines():
            if line.startswith(f"- `{key}."):
                assert "): " in line, f"{line}: no description"


def test_the_reference_documents_the_table_schema_and_generators():
    import dataclasses

    from sparsejax import data as sd

    ref = runner.config_reference()
    schema = _section(ref, "## `data.schema` (TableSchema)")
    for f in dataclasses.fields(sd.TableSchema):
        assert f"- `data.schema.{f.name}` (" in schema, f.name
    behavior = _section(ref, "### `data.kind: behavior` (SyntheticBehavior)")
    assert "- `data.synthetic_options.num_users` (int; default `10000`): " in behavior
    assert "`data.synthetic_options.seed`" not in behavior  # the run's seed
    dlrm = _section(ref, "### `model.name: dlrm` (DLRM)")
    assert "`model.options.bottom` (list of int; default `[64, model.embedding_dim]`)" in dlrm
