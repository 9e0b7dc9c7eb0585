"""Every shipped cluster file validates; each kind of mistake in one is caught and named."""

import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from kiln.cluster.check import check_cluster_file, check_kuberay, check_launcher, ray_schema

REPO = Path(__file__).resolve().parents[3]
LAUNCHERS = sorted((REPO / "cluster").glob("*.yaml"))
KUBERAY = sorted((REPO / "cluster" / "kuberay").glob("*.yaml"))


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def test_the_files_the_issue_asks_for_are_shipped():
    assert {p.name for p in LAUNCHERS} >= {"aws-gpu.yaml", "gcp-gpu.yaml", "onprem.yaml"}
    assert {load(p)["kind"] for p in KUBERAY} == {"RayCluster", "RayJob"}
    assert "cluster_name" in ray_schema()["required"]  # the schema inside the installed ray


@pytest.mark.parametrize("path", LAUNCHERS + KUBERAY, ids=lambda p: p.name)
def test_shipped_file_validates(path):
    assert check_cluster_file(path)


def _image() -> str:
    """The image `make image` tags for GPU clusters: the Makefile's IMAGE and the package version."""
    makefile = (REPO / "Makefile").read_text()
    image = re.search(r"^IMAGE := (\S+)$", makefile, re.M).group(1)
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert "-t $(IMAGE):$(VERSION)-cuda" in makefile
    return f"{image}:{version}-cuda"


@pytest.mark.parametrize("path", LAUNCHERS, ids=lambda p: p.name)
def test_launchers_keep_token_auth_and_run_kilns_image(path):
    cfg = load(path)
    assert all(
        "RAY_AUTH_MODE=token" in " ".join(cfg[k]) for k in ("head_start_ray_commands", "worker_start_ray_commands")
    )
    assert cfg["docker"]["image"] == _image() and cfg["docker"]["container_name"]
    commands = " ".join(c for k in cfg if k.endswith("_commands") for c in cfg[k])
    assert "make install" not in commands and ".venv" not in commands  # Kiln is in the image
    assert list(cfg["file_mounts"]) == ["~/.ray/auth_token"]


@pytest.mark.parametrize("path", KUBERAY, ids=lambda p: p.name)
def test_kuberay_pods_run_the_same_image(path):
    doc = load(path)
    spec = doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    images = {c["image"] for g in groups for c in g["template"]["spec"]["containers"]}
    assert images == {_image()}, images


AWS = load(REPO / "cluster" / "aws-gpu.yaml")


def mutated(cfg: dict, path: str, value) -> dict:
    cfg = copy.deepcopy(cfg)
    *parents, leaf = path.split(".")
    node = cfg
    for p in parents:
        node = node[p]
    if value is None:
        del node[leaf]
    else:
        node[leaf] = value
    return cfg


@pytest.mark.parametrize(
    "path,value,expected",
    [
        ("max_worker", 3, "'max_worker' was unexpected"),  # typo: Ray's schema
        ("available_node_types.gpu-spot.resources", None, "'resources' is a required property"),
        (
            "available_node_types.gpu-spot.min_workers",
            "2",
            "available_node_types.gpu-spot.min_workers: expected an integer",
        ),
        ("max_workers", "two", "max_workers: expected an integer"),
        ("available_node_types.gpu-spot.node_config", "m5.large", "gpu-spot.node_config: expected a mapping"),
        ("available_node_types.gpu-spot.resources", "GPU=1", "gpu-spot.resources: expected a mapping"),
        ("setup_commands", "export WANDB_API_KEY=sk-planted-Zq1", "setup_commands: expected a list"),
        ("provider", None, "'provider' is a required property"),
        ("head_node_type", "cpu-head", "'cpu-head' is not one of available_node_types"),
        ("available_node_types.gpu-spot.min_workers", 9, "min_workers 9 > max_workers 8"),
        ("worker_start_ray_commands", ["ray start --address=$RAY_HEAD_IP:6379"], "without RAY_AUTH_MODE=token"),
        (
            "head_start_ray_commands",
            ["RAY_AUTH_MODE=token ray start --head --dashboard-host=0.0.0.0"],
            "binds to 0.0.0.0",
        ),
        ("docker", None, "docker.image: nothing installs Kiln"),
    ],
)
def test_launcher_mistakes_are_named(path, value, expected):
    problems = check_launcher(mutated(AWS, path, value))
    assert any(expected in p for p in problems), problems
    if "expected a" in expected:  # a type Kiln checks says what it expected, never the value (a secret?)
        assert not any(isinstance(value, str) and value in p for p in problems), problems


CLUSTER = load(REPO / "cluster" / "kuberay" / "raycluster.yaml")
JOB = load(REPO / "cluster" / "kuberay" / "rayjob.yaml")


@pytest.mark.parametrize(
    "doc,path,value,expected",
    [
        (CLUSTER, "apiVersion", "ray.io/v1alpha1", "expected ray.io/v1"),
        (CLUSTER, "kind", "RayService", "expected one of RayCluster, RayJob"),
        (CLUSTER, "spec.headGroupSpec", None, "spec.headGroupSpec: required"),
        (CLUSTER, "spec.authOptions", None, "expected `token`"),
        (
            CLUSTER,
            "spec.workerGroupSpecs",
            [
                {
                    "groupName": "gpu",
                    "replicas": 9,
                    "maxReplicas": 8,
                    "template": {"spec": {"containers": [{"name": "w", "image": "i"}]}},
                }
            ],
            "minReplicas <= replicas <= maxReplicas",
        ),
        (
            CLUSTER,
            "spec.workerGroupSpecs",
            [{"groupName": "gpu", "template": {"spec": {"containers": [{"name": "w"}]}}}],
            "containers[0].image: required",
        ),
        (
            CLUSTER,
            "spec.workerGroupSpecs",
            [{"groupName": "gpu", "replicas": "2"}],
            "workerGroupSpecs.0.replicas: expected an integer",
        ),
        (CLUSTER, "metadata", "kiln", "metadata: expected a mapping"),
        (CLUSTER, "spec.headGroupSpec", {"template": "pod"}, "headGroupSpec.template: expected a mapping"),
        (
            CLUSTER,
            "spec.workerGroupSpecs",
            [
                {
                    "groupName": "gpu",
                    "template": {"spec": {"containers": [{"name": "w", "image": "i", "env": "RAY_AUTH_MODE=token"}]}},
                }
            ],
            "containers.0.env: expected a list",
        ),
        (JOB, "spec.entrypoint", None, "spec.entrypoint: required"),
        (JOB, "spec.rayClusterSpec", None, "needs rayClusterSpec"),
    ],
)
def test_kuberay_mistakes_are_named(doc, path, value, expected):
    problems = check_kuberay(mutated(doc, path, value))
    assert any(expected in p for p in problems), problems


def test_cli_checks_every_file_and_reports_each_problem_without_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(mutated(AWS, "max_worker", 3)))
    missing = tmp_path / "missing.yaml"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kiln.cli",
            "cluster",
            "check",
            str(REPO / "cluster" / "onprem.yaml"),
            str(bad),
            str(missing),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "onprem.yaml: ok" in proc.stdout
    assert "bad.yaml" in proc.stderr and "'max_worker' was unexpected" in proc.stderr
    assert "missing.yaml: no such cluster file" in proc.stderr
    assert "Traceback" not in proc.stderr


SECRET = "wJalrXUtnFEMIK7MDENGbPxRfiCY"


@pytest.mark.parametrize(
    "plant, where",
    [
        (lambda d: d["setup_commands"].append(f"export AWS_SECRET_ACCESS_KEY={SECRET}"), "setup_commands[1]"),
        (lambda d: d["provider"].__setitem__("aws_secret_access_key", SECRET), "provider.aws_secret_access_key"),
        (
            lambda d: d["head_setup_commands"].append(
                "echo export MLFLOW_TRACKING_URI=http://u:hunter22@10.0.0.1:5000"
            ),
            "head_setup_commands[3]",
        ),
        (lambda d: d["setup_commands"].append("echo AKIAIOSFODNN7EXAMPLE"), "setup_commands[1]"),
    ],
    ids=["shell-export", "secret-key", "url-password", "aws-key-shape"],
)
def test_a_cluster_file_holding_a_credential_is_refused_without_echoing_it(tmp_path, plant, where):
    doc = load(REPO / "cluster" / "aws-gpu.yaml")
    plant(doc)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(Exception) as e:
        check_cluster_file(path)
    assert f"{where}: a credential in clear" in str(e.value)
    assert SECRET not in str(e.value) and "hunter22" not in str(e.value) and "AKIA" not in str(e.value)


def test_a_kubernetes_secret_as_a_literal_env_value_is_refused():
    doc = load(REPO / "cluster" / "kuberay" / "raycluster.yaml")
    container = doc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    container.setdefault("env", []).append({"name": "AWS_SECRET_ACCESS_KEY", "value": SECRET})
    from kiln.cluster.check import credentials_in_clear

    found = credentials_in_clear(doc)
    assert len(found) == 1 and "env AWS_SECRET_ACCESS_KEY has a literal value" in found[0]


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda p: p.mkdir(), "a directory, not a cluster file"),
        (lambda p: p.write_bytes(Path("/bin/ls").read_bytes()[:4096]), "is not UTF-8 text"),
    ],
    ids=["directory", "binary"],
)
def test_a_directory_or_a_binary_is_named(tmp_path, make, needle):
    path = tmp_path / "c.yaml"
    make(path)
    out = subprocess.run(
        [str(Path(sys.executable).parent / "kiln"), "cluster", "check", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr and needle in out.stderr


def test_every_shown_job_submission_carries_the_runtime_env():
    """`--working-dir .` alone skips jobs/runtime_env.yaml's py_modules: nodes would run the
    `kiln` they installed, not the checkout's. Every `ray job submit` the cluster files, the
    README and docs/ show gives the runtime env instead."""
    shown = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "cluster").rglob("*.yaml"))]
    shown.append(REPO / "cluster/README.md")
    submits = [
        (p.name, line)
        for p in shown
        for line in p.read_text().splitlines()
        if "ray job submit" in line and "--address" in line
    ]
    assert len(submits) >= 6, submits  # the four cluster headers, README's cluster section
    bad = [
        (name, line)
        for name, line in submits
        if "--working-dir" in line or "--runtime-env jobs/runtime_env.yaml" not in line
    ]
    assert not bad, bad
