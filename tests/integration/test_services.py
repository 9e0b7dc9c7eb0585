"""`kiln services up|down`: a real MLflow server on loopback that a team's runs log to."""

import socket
import subprocess
import sys
import urllib.request

from mlflow.tracking import MlflowClient

KILN = [sys.executable, "-m", "kiln.cli", "services"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kiln(*args, **kw):
    return subprocess.run([*KILN, *args], capture_output=True, text=True, timeout=180, **kw)


def test_services_up_serves_runs_and_artifacts_then_down_stops_it(tmp_path):
    root, port = tmp_path / "services", free_port()
    up = kiln("up", "--dir", str(root), "--port", str(port))
    assert up.returncode == 0, up.stderr
    url = f"http://127.0.0.1:{port}"
    try:
        assert f"export MLFLOW_TRACKING_URI={url}" in up.stdout
        # A client logs a run and an artifact through the server; the artifact lands in the services dir.
        client = MlflowClient(url)
        exp = client.create_experiment("team")
        run = client.create_run(exp)
        client.log_metric(run.info.run_id, "loss/train", 1.5, step=1)
        note = tmp_path / "note.txt"
        note.write_text("hello")
        client.log_artifact(run.info.run_id, str(note))
        assert client.get_metric_history(run.info.run_id, "loss/train")[0].value == 1.5
        assert list((root / "artifacts").rglob("note.txt")), "artifacts are not served into <dir>/artifacts"
        assert (root / "mlflow.db").exists()

        # Bound to loopback only.
        ss = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True).stdout
        local = [line.split()[3] for line in ss.splitlines()]
        assert local and all(a.startswith("127.0.0.1:") for a in local), ss

        again = kiln("up", "--dir", str(root), "--port", str(port))
        assert again.returncode == 2 and "already running" in again.stderr and "Traceback" not in again.stderr
        busy = kiln("up", "--dir", str(tmp_path / "other"), "--port", str(port))
        assert busy.returncode == 2 and f"port {port} on 127.0.0.1 is in use" in busy.stderr
        assert "running" in kiln("status", "--dir", str(root)).stdout
    finally:
        down = kiln("down", "--dir", str(root))
    assert down.returncode == 0 and "stopped mlflow" in down.stdout
    try:
        urllib.request.urlopen(f"{url}/health", timeout=2)
        raise AssertionError("the server still answers after `kiln services down`")
    except OSError:
        pass
    assert not (root / "services.json").exists()
