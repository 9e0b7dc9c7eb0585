"""One real Ray cluster (`ray start --head`) and one loopback S3 server for the whole session."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.launch.local import free_port

sys.path.insert(0, str(Path(__file__).parent))
from ray_nodes import BIN, S3_ENV, start_head, stop_ray_cluster, wait_for_port  # noqa: E402

KILN = str(BIN / "kiln")


@pytest.fixture(scope="session")
def s3_server():
    """moto_server: a real S3-compatible HTTP server on loopback."""
    port = free_port()
    proc = subprocess.Popen(
        [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port)
        endpoint = f"http://127.0.0.1:{port}"
        import boto3

        boto3.client(
            "s3",
            endpoint_url=endpoint,
            **{k.lower(): v for k, v in S3_ENV.items() if k != "AWS_DEFAULT_REGION"},
            region_name="us-east-1",
        ).create_bucket(Bucket="kiln-test")
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture
def prometheus(tmp_path_factory):
    """Debian's Prometheus on loopback, with dashboards/prometheus.yml's scrape of Ray's
    service-discovery file and the alert rules, scraping every second. Yields its URL.

    One test long: each scrape has the node's Ray agent render every series. On a head that
    had run one job, the agent used 9.0% of a core while Prometheus scraped (Prometheus 2.5%
    more), 2.5% without (psutil over 60 s each, 2026-11-29): CPU the module's later Ray runs
    would lose on 2 cores."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("no `prometheus` on PATH: `make test` installs Debian's package (apt-get install prometheus)")
    import yaml

    tmp_path = tmp_path_factory.mktemp("prometheus")
    repo = Path(__file__).resolve().parents[2]
    cfg = yaml.safe_load((repo / "dashboards/prometheus.yml").read_text())
    cfg["global"]["scrape_interval"] = "1s"
    cfg["rule_files"] = [str(repo / "dashboards/alerts.yml")]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    port = free_port()
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'prom-data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for_port(port)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """A head node started like a user would: `ray start --head`, token auth on, dashboard on
    loopback for job submission. Yields (gcs_address, dashboard_url, env)."""
    if shutil.which("ray", path=str(BIN)) is None:
        pytest.fail("ray CLI not found next to the interpreter")
    # Workers report metrics every 2 s (Ray's default 10 s would leave a short run few points),
    # and MLflow's system metrics come every 2 s: its monitor logs only after its first interval,
    # and at its default 10 s a test run whose rank 0 trains for about 10 s logged them or not
    # by a race with the run's end.
    # The GCS declares a node dead after 3 failed health checks 2 s apart (Ray's defaults, 5
    # checks 3 s apart with a 10 s timeout, took 70 s to notice test_two_nodes' killed node).
    # A killed raylet refuses the check at once; a live one has 5 s to answer each.
    env = dict(
        os.environ,
        RAY_AUTH_MODE="token",
        RAY_metrics_report_interval_ms="2000",
        MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL="2",
        RAY_health_check_period_ms="2000",
        RAY_health_check_timeout_ms="5000",
        RAY_health_check_failure_threshold="3",
        **S3_ENV,
    )
    gcs_port, dash_port = free_port(), free_port()
    # With RAY_AUTH_MODE=token, `ray start` wants a token to exist; a fresh machine has none.
    # This creates ~/.ray/auth_token only when missing (output captured: it prints the token).
    subprocess.run(
        [str(BIN / "ray"), "get-auth-token", "--generate"], env=env, capture_output=True, check=True, timeout=60
    )
    start_head(gcs_port, dash_port, env, "--num-cpus=4", '--resources={"kiln_head": 1}')
    old = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", *S3_ENV)}
    os.environ.update(RAY_AUTH_MODE="token", **S3_ENV)

    def stop() -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        stop_ray_cluster(gcs_port)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    _STOP_CLUSTER.append(stop)
    try:
        wait_for_port(dash_port, timeout=120)
        yield f"127.0.0.1:{gcs_port}", f"http://127.0.0.1:{dash_port}", env
    finally:
        if stop in _STOP_CLUSTER:  # still up: no test's teardown stopped it early
            _STOP_CLUSTER.remove(stop)
            stop()


_STOP_CLUSTER: list = []  # the session cluster's stop, while it is up


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Stop the session's cluster once no later test needs it, not at the session's end: the
    tests after tests/integration (all of tests/unit) would otherwise share the 2 cores with
    its idle head (GCS, raylet, dashboard, metrics agent) for their whole run."""
    try:
        return (yield)
    finally:
        if _STOP_CLUSTER:
            later = [] if nextitem is None else item.session.items[item.session.items.index(nextitem) :]
            if not any("ray_cluster" in i.fixturenames for i in later):
                _STOP_CLUSTER.pop()()


@pytest.fixture(scope="session")
def s3_dataset(s3_server, ray_cluster, corpus, tmp_path_factory):
    """A BPE dataset prepared into the loopback S3 bucket; its s3:// URI."""
    _, _, env = ray_cluster
    out = subprocess.run(
        [
            KILN,
            "data",
            "prepare",
            "--input",
            corpus[0],
            "--input",
            corpus[1],
            "--input",
            corpus[3],
            "--output",
            "s3://kiln-test/stdlib-bpe",
            "--tokenizer",
            "bpe",
            "--vocab-size",
            "512",
            "--seq-len",
            "64",
            "--shard-tokens",
            "16384",
            "--s3-endpoint",
            s3_server,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=tmp_path_factory.mktemp("prep"),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return "s3://kiln-test/stdlib-bpe"
