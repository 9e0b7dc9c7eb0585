"""YAML as Kiln reads it (`kiln.yamlfile`): merge keys work, duplicates and alias bombs do not,
and size and depth are bounded before anything is built."""

from __future__ import annotations

import pytest
import yaml

from kiln import yamlfile
from kiln.config import load_config
from kiln.errors import ConfigError


def test_merge_keys_work_and_a_key_beside_the_merge_wins(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("base: &base {lr: 0.001, weight_decay: 0.05}\noptim:\n  <<: *base\n  lr: 3e-4\n")
    tree = yamlfile.read_mapping(cfg, "c.yaml")
    assert tree["optim"] == {"lr": 3e-4, "weight_decay": 0.05}


def test_a_run_config_with_a_merge_key_loads(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("train:\n  <<: &common {max_steps: 7, micro_batch_size: 2}\n  max_steps: 9\n")
    train = load_config(cfg).train
    assert (train.max_steps, train.micro_batch_size) == (9, 2)


def test_a_duplicate_key_is_refused_even_beside_a_merge():
    with pytest.raises(yaml.YAMLError, match="duplicate key 'lr'"):
        yamlfile.load_text("a: &a {x: 1}\nb:\n  <<: *a\n  lr: 1\n  lr: 2\n", "t")


def _bomb(levels: int) -> str:
    lines = ["l0: &l0 [x]"] + [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_is_refused_before_it_is_built():
    with pytest.raises(ConfigError, match="alias bomb"):
        yamlfile.load_text(_bomb(9), "bomb.yaml")  # 9**9 values if built


def test_anchors_reused_within_reason_load():
    tree = yamlfile.load_text(_bomb(3), "ok.yaml")  # 9**3 = 729 values from 40 written
    assert len(tree["l3"]) == 9 and tree["l3"][0][0][0] == ["x"]


@pytest.mark.parametrize(
    "text,needle",
    [
        ("a: " + "[" * 100 + "]" * 100, "nests lists and mappings over 64 deep"),
        ("a: 1\n" * (yamlfile.MAX_BYTES // 4), "characters; expected at most"),
    ],
)
def test_deep_or_huge_text_is_refused(text, needle):
    with pytest.raises(ConfigError, match=needle):
        yamlfile.load_text(text, "t")


def test_a_huge_file_is_refused_unread(tmp_path):
    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:
        f.truncate(50 << 20)  # sparse: 50 MB that costs no disk
    with pytest.raises(ConfigError, match="larger than"):
        yamlfile.read_mapping(big, "big.yaml")


def test_an_override_value_is_bounded_too():
    bomb = (
        "{"
        + ", ".join(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" if i else "a0: &a0 [x]" for i in range(10))
        + "}"
    )
    with pytest.raises(ConfigError, match="--set parallel.deepspeed"):
        load_config(None, [f"parallel.deepspeed={bomb}"])
