"""The state file `kiln sweep --resume` reads: private, never holding a secret, and a resume of
a sweep whose secrets were left out says which, instead of running without them."""

import pytest

from kiln.errors import ConfigError
from kiln.sweep.config import STATE_FILE, load_sweep, stored_sweep
from kiln.sweep.run import _start_parent

PW = "planted-sweep-pw-Lm30"
DS = "planted-sweep-ds-Rt41"


def _sweep_file(tmp_path, name, byte_dataset, secrets: bool):
    (tmp_path / "base.yaml").write_text(f"data:\n  path: {byte_dataset}\ntrain:\n  max_steps: 20\n  eval_every: 10\n")
    extra = (
        (
            f"overrides:\n  data.s3_endpoint: http://kiln:{PW}@127.0.0.1:9\n"
            f"  parallel.deepspeed.aws_secret_access_key: {DS}\n"
        )
        if secrets
        else ""
    )
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"name: {name}\nbase: base.yaml\nspace:\n  optim.lr: {{loguniform: [1e-4, 1e-2]}}\n{extra}")
    return load_sweep(path)


def test_state_is_private_without_secrets_and_resume_names_what_it_lacks(tmp_path, byte_dataset):
    uri, root = f"sqlite:///{tmp_path}/m.db", tmp_path / "sweeps"
    _start_parent(_sweep_file(tmp_path, "plain", byte_dataset, secrets=False), uri, str(root / "plain"))
    _start_parent(_sweep_file(tmp_path, "secret", byte_dataset, secrets=True), uri, str(root / "secret"))

    state = root / "secret" / STATE_FILE
    assert state.stat().st_mode & 0o777 == 0o600
    assert PW not in state.read_text() and DS not in state.read_text()
    with pytest.raises(ConfigError) as refused:
        stored_sweep(str(root), "secret")
    assert "base_tree.data.s3_endpoint" in str(refused.value)
    assert "base_tree.parallel.deepspeed.aws_secret_access_key" in str(refused.value)

    resumed = stored_sweep(str(root), "plain")  # nothing was left out: it resumes as it was
    assert resumed.config.name == "plain" and resumed.base_config.train.max_steps == 20

    state.write_text('{"sweep": 3}')
    with pytest.raises(ConfigError, match="is not a Kiln sweep state file"):
        stored_sweep(str(root), "secret")
