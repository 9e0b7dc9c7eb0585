from pathlib import Path

import pytest

from kiln.config import RunConfig, annotated_yaml, load_config
from kiln.errors import ConfigError
from kiln.knobs import field_docs, flatten

REPO = Path(__file__).resolve().parents[2]


def test_defaults_validate_and_every_field_is_documented():
    cfg = RunConfig().validate()
    for section in ("data", "model", "parallel", "optim", "schedule", "train", "logging"):
        value = getattr(cfg, section)
        docs = field_docs(type(value))
        missing = [f for f in vars(value) if f not in docs]
        assert not missing, f"{section}: undocumented fields {missing}"


@pytest.mark.parametrize("path", sorted((REPO / "jobs" / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    assert isinstance(load_config(path), RunConfig)


def test_overrides_are_typed():
    cfg = load_config(
        None,
        [
            "optim.lr=3e-4",
            "train.max_steps=7",
            "parallel.use_gpu=true",
            "parallel.deepspeed.zero_optimization.reduce_bucket_size=1000",
        ],
    )
    assert cfg.optim.lr == pytest.approx(3e-4) and isinstance(cfg.optim.lr, float)
    assert cfg.train.max_steps == 7
    assert cfg.parallel.use_gpu is True
    assert cfg.parallel.deepspeed == {"zero_optimization": {"reduce_bucket_size": 1000}}


def test_override_beats_yaml(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("optim:\n  lr: 0.1\ntrain:\n  max_steps: 5\n")
    cfg = load_config(f, ["optim.lr=0.01"])
    assert cfg.optim.lr == 0.01 and cfg.train.max_steps == 5


@pytest.mark.parametrize(
    "override, needle",
    [
        ("optim.lrr=1", "unknown config key 'optim.lrr'; did you mean 'lr'?"),
        ("trian.max_steps=1", "unknown config key 'trian'; did you mean 'train'?"),
        ("parallel.zero_stage=5", "parallel.zero_stage = 5 is out of range: expected one of 0, 1, 2, 3"),
        ("optim.lr=-1", "optim.lr = -1.0 is out of range"),
        ("train.max_steps=ten", "train.max_steps = 'ten' is not an integer"),
        (
            "optim.name=adagrad",
            "optim.name = 'adagrad' is not allowed: expected one of ['adamw', 'adam', 'sgd', 'rmsprop', 'lamb']",
        ),
        ("model.flavour=huge", "model.flavour = 'huge' is out of range: expected one of"),
        ("train.precision=fp8", "train.precision = 'fp8' is not allowed"),
        ("optim=1", "'optim' is a section"),
        ("optim.lr", "expected KEY=VALUE"),
    ],
)
def test_bad_overrides_name_the_field(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert needle in str(e.value)


def test_yaml_typo_is_named(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  max_stpes: 3\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'train.max_stpes'; did you mean 'max_steps'\?"):
        load_config(f)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_flatten_and_annotated_yaml_round_trip(tmp_path):
    cfg = load_config(None, ["optim.lr=0.002"])
    flat = flatten(cfg.to_dict())
    assert flat["optim.lr"] == 0.002 and flat["train.max_steps"] == cfg.train.max_steps
    text = annotated_yaml(cfg)
    assert "# Peak learning rate" in text
    f = tmp_path / "gen.yaml"
    f.write_text(text)
    assert load_config(f) == cfg


def test_a_relative_data_path_reaches_workers_as_an_absolute_one(byte_dataset, monkeypatch):
    """Ray Train workers run in another directory and read the shards themselves."""
    from kiln.config import load_config
    from kiln.data.check import resolve_against_data

    monkeypatch.chdir(byte_dataset.parent)
    cfg, datasets = resolve_against_data(load_config(None, [f"data.path={byte_dataset.name}"]))
    assert cfg.data.path == str(byte_dataset) and datasets[0].manifest.location.path == str(byte_dataset)


@pytest.mark.parametrize(
    "content, needle",
    [
        (b"train:\n  max_steps: 5\n  max_steps: 7\n", "duplicate key 'max_steps' (line 3, column 3)"),
        (b"", "is empty: expected a mapping of settings"),
        (b"# only a comment\n", "is empty: expected a mapping of settings"),
        (b"optim: []\n", "optim must be a mapping, got []"),
        (b"optim:\n  lr: .inf\n", "optim.lr = inf is not a finite number"),
        (b"optim:\n  lr: 1e400\n", "optim.lr = inf is not a finite number"),
        (b"# caf\xe9\noptim: {}\n", "is not UTF-8 text (byte 5)"),
        (b"a: [\n", "node content (line 2, column 1)"),
    ],
    ids=["duplicate-key", "empty", "comment-only", "list-section", "inf", "overflow", "latin-1", "unclosed"],
)
def test_a_config_file_that_says_less_or_other_than_it_seems_is_refused(tmp_path, content, needle):
    path = tmp_path / "run.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_sweep_override_through_a_value_is_refused(tmp_path):
    from kiln.sweep.config import load_sweep

    with pytest.raises(ConfigError, match="--set name.tag: 'name' is not a section of the sweep file"):
        load_sweep(REPO / "jobs/configs/sweeps/optimizers-x-schedules.yaml", ["name.tag=x"])


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["train.compile=true", "parallel.zero_stage=3"], "train.compile = true with parallel.zero_stage = 3"),
        (
            ["train.compile=true", "parallel.zero_stage=1", "parallel.pipeline_stages=2"],
            "compile works with ZeRO 0-2 and no pipeline",
        ),
        (["train.mixed_precision=autocast"], "train.mixed_precision = 'autocast' with train.precision = 'fp32'"),
        (["train.mixed_precision=amp", "train.precision=bf16"], "train.mixed_precision = 'amp' is not allowed"),
    ],
)
def test_speed_options_refuse_what_deepspeed_cannot_do(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert needle in str(e.value)
    # and what it can do loads, into DeepSpeed's own switch
    from kiln.parallel.engine import deepspeed_config

    ok = load_config(None, ["train.compile=true", "train.precision=bf16", "train.mixed_precision=autocast"])
    ds = deepspeed_config(ok, 1)
    assert ds["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"} and not ds["bf16"]["enabled"]


@pytest.mark.parametrize(
    "overrides, autocast",
    [
        (["parallel.use_gpu=true", "parallel.zero_stage=0"], True),  # auto: a GPU at ZeRO-0 takes autocast
        (["parallel.use_gpu=true", "parallel.zero_stage=2"], False),  # ZeRO shards bf16 weights' smaller states
        (
            ["parallel.use_gpu=true", "parallel.zero_stage=0", "parallel.num_workers=2", "parallel.pipeline_stages=2"],
            False,
        ),  # a pipeline runs no autocast
        (["parallel.zero_stage=0"], False),  # CPUs keep DeepSpeed's bf16
        (["parallel.use_gpu=true", "parallel.zero_stage=0", "train.mixed_precision=weights"], False),  # a choice stands
        (["parallel.zero_stage=2", "train.mixed_precision=autocast"], True),
    ],
)
def test_bf16_auto_is_autocast_on_a_gpu_at_zero0_without_a_pipeline(overrides, autocast):
    from kiln.parallel.engine import deepspeed_config

    cfg = load_config(None, ["train.precision=bf16", *overrides])
    ds = deepspeed_config(cfg, 1)
    assert cfg.autocast is autocast
    assert (ds["torch_autocast"]["enabled"], ds["bf16"]["enabled"]) == (autocast, not autocast)
    same = [o for o in overrides if not o.startswith("train.mixed_precision")]  # explicit autocast needs bf16
    fp32 = deepspeed_config(load_config(None, ["train.precision=fp32", *same]), 1)
    assert not fp32["torch_autocast"]["enabled"] and not fp32["bf16"]["enabled"]


def test_a_bare_off_is_the_word_where_the_field_takes_words():
    """YAML 1.1 reads `off` as false; a field whose choices are words takes the word."""
    assert load_config(None, ["train.health.policy=off"]).train.health.policy == "off"
    with pytest.raises(ConfigError, match=r"train.precision = False is not allowed"):
        load_config(None, ["train.precision=off"])


def test_mlflow_experiment_name_names_the_experiment_where_the_config_names_none(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    assert load_config(None).logging.experiment == "from-env"
    assert load_config(None, ["logging.run_name=x"]).logging.experiment == "from-env"
    assert load_config(None, ["logging.experiment=given"]).logging.experiment == "given"
    named = tmp_path / "named.yaml"
    named.write_text("logging:\n  experiment: in-file\n")
    assert load_config(named).logging.experiment == "in-file"
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME")
    assert load_config(None).logging.experiment == "kiln"


def test_the_deepspeed_passthrough_may_be_a_json_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds.json").write_text(
        '{"zero_optimization": {"reduce_bucket_size": 5e7}, "comms_logger": {"enabled": true}}'
    )
    cfg = load_config(None, ["parallel.deepspeed=ds.json"])
    assert cfg.parallel.deepspeed == {
        "zero_optimization": {"reduce_bucket_size": 5e7},
        "comms_logger": {"enabled": True},
    }
    (tmp_path / "c.yaml").write_text("parallel:\n  deepspeed: ds.json\n")
    assert load_config(tmp_path / "c.yaml").parallel.deepspeed == cfg.parallel.deepspeed
