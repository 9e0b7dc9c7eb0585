"""Property tests (hypothesis): whatever a config file, a manifest or a sweep file holds, reading
it gives a valid object or a KilnError naming what is wrong, never another exception, which
the CLI would report as a bug."""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.config import RunConfig, load_config
from kiln.errors import KilnError

SETTINGS = settings(
    max_examples=150,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(["3e-4", "1e400", "-1", "0", "inf", "nan", "", "debug", "adamw", "s3://b/p", "~"])
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
SECTIONS = {
    f.name: [
        g.name
        for g in dataclasses.fields(
            f.type if not isinstance(f.type, str) else RunConfig.__dataclass_fields__[f.name].default_factory
        )
    ]
    for f in dataclasses.fields(RunConfig)
}
sections = st.sampled_from(sorted(SECTIONS)) | st.text(max_size=8)
field_names = st.sampled_from(sorted({n for names in SECTIONS.values() for n in names})) | st.text(max_size=8)
config_trees = st.dictionaries(sections, st.dictionaries(field_names, values, max_size=4) | values, max_size=4)


def _refused_or_valid(read, *args):
    try:
        return read(*args)
    except KilnError:
        return None


@SETTINGS
@given(tree=config_trees)
def test_any_config_tree_is_a_config_or_a_kiln_error(tmp_path, tree):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(tree))
    cfg = _refused_or_valid(load_config, path)
    assert cfg is None or isinstance(cfg, RunConfig)


@SETTINGS
@given(raw=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_any_config_bytes_are_a_config_or_a_kiln_error(tmp_path, raw):
    path = tmp_path / "c.yaml"
    path.write_bytes(raw)
    _refused_or_valid(load_config, path)


@SETTINGS
@given(
    overrides=st.lists(
        st.text(max_size=30)
        | st.builds(
            "{}={}".format,
            st.sampled_from(
                ["optim.lr", "train.max_steps", "parallel.deepspeed", "model", "model.flavour.x", "", "a..b"]
            ),
            st.text(max_size=10),
        ),
        max_size=3,
    )
)
def test_any_overrides_are_a_config_or_a_kiln_error(overrides):
    _refused_or_valid(load_config, None, overrides)


def _paths(node, prefix=()):
    """Every key path inside nested dicts and lists."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in items:
        yield (*prefix, key)
        yield from _paths(child, (*prefix, key))


DELETE = object()


@pytest.fixture(scope="module")
def dataset_copy(tmp_path_factory, byte_dataset):
    ds = tmp_path_factory.mktemp("prop") / "ds"
    shutil.copytree(byte_dataset, ds)
    return ds, json.loads((ds / "manifest.json").read_text())


@SETTINGS
@given(data=st.data())
def test_any_edit_of_a_manifest_is_read_or_refused(dataset_copy, data):
    from kiln.data.manifest import check_shards, load_manifest
    from kiln.storage import resolve

    ds, original = dataset_copy
    manifest = copy.deepcopy(original)
    for path in data.draw(st.lists(st.sampled_from(list(_paths(original))), min_size=1, max_size=3)):
        node = manifest
        try:
            for key in path[:-1]:
                node = node[key]
            new = data.draw(values | st.just(DELETE))
            if new is DELETE:
                del node[path[-1]]
            else:
                node[path[-1]] = new
        except (KeyError, IndexError, TypeError):  # an earlier edit removed or replaced the parent
            continue
    (ds / "manifest.json").write_text(json.dumps(manifest, allow_nan=True))
    loaded = _refused_or_valid(load_manifest, resolve(str(ds)))
    if loaded is not None:
        _refused_or_valid(check_shards, loaded)


KINDS = ["choice", "grid", "uniform", "loguniform", "randint"]
space_entries = st.dictionaries(
    st.sampled_from(["optim.lr", "train.max_steps", "optim.name", "model.dropout", "nope.field"]) | st.text(max_size=8),
    st.dictionaries(st.sampled_from(KINDS) | st.text(max_size=6), values, min_size=1, max_size=2) | values,
    max_size=3,
)
sweep_trees = st.fixed_dictionaries(
    {},
    optional={
        "name": values | st.just("s"),
        "base": st.just("base.yaml") | values,
        "space": space_entries | values,
        "num_samples": values,
        "search": st.sampled_from(["random", "grid", "optuna"]) | values,
        "scheduler": st.dictionaries(st.sampled_from(["name", "grace_period", "reduction_factor"]), values),
        "overrides": st.dictionaries(st.sampled_from(["optim.lr", "train.max_steps"]) | st.text(max_size=6), values),
        "conditional": values,
        "metric": values,
        "mode": values,
    },
)


@SETTINGS
@given(tree=sweep_trees)
def test_any_sweep_file_is_a_sweep_or_a_kiln_error(tmp_path, tree):
    from kiln.sweep.config import load_sweep, param_space

    (tmp_path / "base.yaml").write_text("train:\n  max_steps: 20\n  eval_every: 10\n")
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(tree))
    sweep = _refused_or_valid(load_sweep, tmp_path / "s.yaml")
    if sweep is not None:
        assert param_space(sweep.config)  # what Tune is handed is built without error
