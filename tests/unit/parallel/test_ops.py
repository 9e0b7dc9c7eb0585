"""DeepSpeed's JIT op cache: inside the environment, and a dead build's lock cleared."""

import os
import sys
import time

from kiln.parallel.ops import STALE_LOCK_S, use_environment_cache


def test_the_cache_is_the_environments_own_unless_the_user_chose_one(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert use_environment_cache() == os.path.join(sys.prefix, "torch_extensions")
    assert os.environ["TORCH_EXTENSIONS_DIR"] == os.path.join(sys.prefix, "torch_extensions")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert use_environment_cache() == str(tmp_path)


def test_a_dead_builds_lock_is_removed_and_a_live_ones_kept(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    dead, live = tmp_path / "cpu_adam" / "lock", tmp_path / "deepspeed_shm_comm" / "lock"
    for lock in (dead, live):
        lock.parent.mkdir()
        lock.write_text("")
    old = time.time() - STALE_LOCK_S - 60
    os.utime(dead, (old, old))
    use_environment_cache()
    assert not dead.exists()
    assert live.exists()  # a build under way in another process
    assert [r.message for r in caplog.records if "lock" in r.message] == [
        f"removing {dead}: an op build that died 21 min ago left it, and every run would wait on it"
    ]


def test_deepspeed_imports_without_mlflow_in_a_rank_that_logs_nothing_and_mlflow_still_imports_after():
    """DeepSpeed's autotuner tries `import mlflow` on load; a rank that logs nothing skips it. A
    process that imported MLflow first keeps DeepSpeed's view of it."""
    import subprocess

    probe = (
        "import sys\n"
        "from kiln.parallel.ops import import_deepspeed\n"
        "{first}"
        "import_deepspeed()\n"
        "import deepspeed.autotuning.autotuner as tuner\n"
        "before = 'mlflow' in sys.modules\n"
        "import mlflow\n"
        "print(before, tuner.has_mlflow, mlflow.MlflowClient.__name__)\n"
    )
    for first, expected in (("", "False False MlflowClient"), ("import mlflow\n", "True True MlflowClient")):
        out = subprocess.run([sys.executable, "-c", probe.format(first=first)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split("\n")[-2] == expected, (first, out.stdout)


def test_deepspeeds_muon_imports_without_compiling_and_compiles_at_its_first_call():
    """ZeRO imports DeepSpeed's Muon in every rank whatever its optimizer; the import's three
    `torch.compile` wrappers load inductor (1.5-2.1 CPU-s a rank). Through Kiln they are made at
    a function's first call: the import loads no inductor compiler, the first call makes the
    wrapper, and it returns what the function itself returns."""
    import subprocess

    probe = (
        "import sys, torch\n"
        "from kiln.parallel.ops import import_deepspeed\n"
        "import_deepspeed()\n"
        "from deepspeed.runtime.zero.muon import original_muon as m, muon_optimizer\n"
        "imported = 'torch._inductor.compile_fx' in sys.modules\n"
        "g = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))\n"
        "with torch._dynamo.config.patch(disable=True):  # run eagerly: the test is the wrapping\n"
        "    same = torch.equal(m.zeropower_via_newtonschulz5(g, 5), m.zeropower_via_newtonschulz5.__wrapped__(g, 5))\n"
        "print(imported, 'torch._inductor.compile_fx' in sys.modules, same,\n"
        "      muon_optimizer.MuonWithAuxAdam.__mro__[1] is m.MuonWithAuxAdam)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "False True True True", out.stdout


def test_a_world_of_one_binds_no_port_another_process_could_hold():
    """A lone local run's process group needs no rendezvous. One through env:// binds
    MASTER_PORT, and CI once lost a run to EADDRINUSE when another process held the port picked
    for it: here a port is held while the group is made with MASTER_PORT set to it."""
    import socket
    import subprocess

    probe = (
        "import torch.distributed as dist\n"
        "from kiln.parallel.ops import init_distributed\n"
        "init_distributed(on_cuda=False)\n"
        "assert dist.get_world_size() == 1\n"
        "t = __import__('torch').ones(3)\n"
        "dist.all_reduce(t)\n"
        "print('sum', float(t.sum()))\n"
    )
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        env = os.environ | {
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(held.getsockname()[1]),
        }
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
    # Its one failure in CI said nothing in stderr: the exit status and stdout say the rest.
    assert out.returncode == 0 and "sum 3.0" in out.stdout, (out.returncode, out.stdout[-1000:], out.stderr[-3000:])
