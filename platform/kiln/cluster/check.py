"""`kiln cluster check`: validate a cluster file before `ray up` or `kubectl apply`.

Two kinds of file live in cluster/:
- Ray cluster launcher YAMLs, checked against the JSON schema that ships inside the `ray`
  package (the one `ray up` itself validates with), then against what Kiln needs on top:
  token auth on every node, Kiln installed the way `make demo` installs it, a consistent
  head node type and worker counts.
- KubeRay `RayCluster` / `RayJob` manifests (apiVersion ray.io/v1). KubeRay publishes its CRDs
  with the operator, not with Ray, so these are checked against the fields KubeRay documents:
  the required keys, replica bounds, and token auth.

Every problem is reported at once, each with its path in the file.
"""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from kiln import yamlfile
from kiln.errors import ConfigError
from kiln.ray.private import ray_up_problem
from kiln.redact import SECRET_PATTERN, TOKEN_SHAPES, URL_USERINFO
from kiln.schemas import ClusterSpec, JobSpec, KubeRay, Launcher, type_problems

KUBERAY_KINDS = ("RayCluster", "RayJob")


def ray_schema() -> dict:
    """The cluster-config schema of the installed Ray."""
    return json.loads(resources.files("ray.autoscaler").joinpath("ray-schema.json").read_text())


def check_launcher(cfg: dict) -> list[str]:
    """Problems of a Ray cluster launcher config: Ray's schema first, then Kiln's needs."""
    import jsonschema

    problems = type_problems(Launcher, cfg)
    if problems:
        return problems  # Ray's schema and Kiln's rules assume these types
    validator = jsonschema.Draft7Validator(ray_schema())
    problems = [
        f"{'.'.join(map(str, e.absolute_path)) or '(top level)'}: {_schema_words(e)}"
        for e in sorted(validator.iter_errors(cfg), key=lambda e: list(map(str, e.absolute_path)))
    ]
    if problems:
        return problems  # the rest assumes the shapes the schema guarantees
    refusal = ray_up_problem(cfg)  # what `ray up` runs before it contacts the provider
    if refusal is not None:
        problems.append(f"ray up would refuse it: {refusal}")

    types = cfg.get("available_node_types", {})
    head = cfg.get("head_node_type")
    if types and head not in types:
        problems.append(f"head_node_type: {head!r} is not one of available_node_types ({', '.join(types)})")
    for name, node in types.items():
        lo, hi = node.get("min_workers", 0), node.get("max_workers", cfg.get("max_workers", 0))
        if lo > hi:
            problems.append(f"available_node_types.{name}: min_workers {lo} > max_workers {hi}")
    if cfg["provider"]["type"] == "local" and not cfg["provider"].get("head_ip"):
        problems.append("provider.head_ip: a local cluster needs the head machine's address")

    setup = " ".join(cfg.get("setup_commands", []) + cfg.get("head_setup_commands", []))
    image = (cfg.get("docker") or {}).get("image")
    if not image and "make install" not in setup and "pip install" not in setup:
        problems.append(
            "docker.image: nothing installs Kiln; run Kiln's image (`make image`, cluster/Dockerfile), or "
            "`cd ~/kiln && make install` in setup_commands"
        )
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        cmds = " ".join(cfg.get(key, []))
        if "ray start" in cmds and "RAY_AUTH_MODE=token" not in cmds:
            problems.append(
                f"{key}: `ray start` without RAY_AUTH_MODE=token; Kiln keeps Ray's token auth on on every node"
            )
    if "dashboard-host=0.0.0.0" in " ".join(cfg.get("head_start_ray_commands", [])):
        problems.append(
            "head_start_ray_commands: the dashboard binds to 0.0.0.0; bind it to 127.0.0.1 "
            "and reach it with `ray dashboard <file>`"
        )
    return problems


def _schema_words(e) -> str:
    """A schema error in words that name the rule, never the offending value (jsonschema's own
    message quotes it, and it may be a secret)."""
    if e.validator in ("required", "additionalProperties", "dependencies"):
        return e.message  # names keys, not values
    if e.validator == "type":
        return f"expected type {e.validator_value!r}"
    if e.validator == "enum":
        return f"expected one of {e.validator_value}"
    return f"does not satisfy the schema's {e.validator!r} rule"


def _containers(template: Any, where: str, problems: list[str]) -> list[dict]:
    containers = ((template or {}).get("spec") or {}).get("containers")
    if not containers:
        problems.append(f"{where}.template.spec.containers: at least one container is required")
        return []
    for i, c in enumerate(containers):
        for key in ("name", "image"):
            if not c.get(key):
                problems.append(f"{where}.template.spec.containers[{i}].{key}: required")
    return containers


def _check_cluster_spec(spec: dict, where: str, problems: list[str]) -> None:
    if not isinstance(spec, dict):
        problems.append(f"{where}: expected a mapping")
        return
    envs = []
    head = spec.get("headGroupSpec")
    if not isinstance(head, dict):
        problems.append(f"{where}.headGroupSpec: required")
    else:
        envs += _containers(head.get("template"), f"{where}.headGroupSpec", problems)
    for i, group in enumerate(spec.get("workerGroupSpecs") or []):
        w = f"{where}.workerGroupSpecs[{i}]"
        if not group.get("groupName"):
            problems.append(f"{w}.groupName: required")
        envs += _containers(group.get("template"), w, problems)
        lo, n, hi = group.get("minReplicas", 0), group.get("replicas", 0), group.get("maxReplicas", 2**31)
        if not lo <= n <= hi:
            problems.append(f"{w}: expected minReplicas <= replicas <= maxReplicas, got {lo}, {n}, {hi}")
    token_env = any(
        e.get("name") == "RAY_AUTH_MODE" and e.get("value") == "token" for c in envs for e in c.get("env") or []
    )
    if (spec.get("authOptions") or {}).get("mode") != "token" and not token_env:
        problems.append(
            f"{where}.authOptions.mode: expected `token` (or RAY_AUTH_MODE=token on every "
            "container); Kiln keeps Ray's token auth on"
        )


def check_kuberay(doc: dict) -> list[str]:
    """Problems of a KubeRay RayCluster or RayJob manifest."""
    problems = type_problems(KubeRay, doc)
    spec = doc.get("spec")
    if isinstance(spec, dict):
        model = ClusterSpec if doc.get("kind") == "RayCluster" else JobSpec
        problems += [f"spec.{p}" for p in type_problems(model, spec)]
    if problems:
        return problems  # the rules below assume these types
    if doc.get("apiVersion") != "ray.io/v1":
        problems.append(f"apiVersion: expected ray.io/v1, got {doc.get('apiVersion')!r}")
    kind = doc.get("kind")
    if kind not in KUBERAY_KINDS:
        return problems + [f"kind: expected one of {', '.join(KUBERAY_KINDS)}, got {kind!r}"]
    if not (doc.get("metadata") or {}).get("name"):
        problems.append("metadata.name: required")
    spec = doc.get("spec")
    if not isinstance(spec, dict):
        return problems + ["spec: required"]
    if kind == "RayCluster":
        _check_cluster_spec(spec, "spec", problems)
    else:
        if not spec.get("entrypoint"):
            problems.append("spec.entrypoint: required (the command the job runs, e.g. python jobs/pretrain.py ...)")
        if "rayClusterSpec" in spec:
            _check_cluster_spec(spec["rayClusterSpec"], "spec.rayClusterSpec", problems)
        elif not spec.get("clusterSelector"):
            problems.append("spec: a RayJob needs rayClusterSpec (a new cluster) or clusterSelector (an existing one)")
    return problems


def check_cluster_file(path: str | Path) -> str:
    """Validate one cluster file; return what it is, or raise ConfigError listing every problem."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path}: a directory, not a cluster file (pass the files in it: {path}/*.yaml)")
    if not path.exists():
        raise ConfigError(f"{path}: no such cluster file")
    text = yamlfile.read_text(path, f"{path}: this cluster file")
    try:  # strict and bounded like run configs: a key given twice is refused, not last-wins
        doc = yamlfile.load_text(text, f"{path}")
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {yamlfile.problem(e)}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    if "apiVersion" in doc or "kind" in doc:
        what, problems = f"KubeRay {doc.get('kind')}", check_kuberay(doc)
    else:
        what, problems = f"Ray cluster launcher config ({(doc.get('provider') or {}).get('type')})", check_launcher(doc)
    problems += credentials_in_clear(doc)
    if problems:
        raise ConfigError(f"{path} ({what}): " + "; ".join(problems))
    return what


# `NAME=value` in a shell command, e.g. `export AWS_SECRET_ACCESS_KEY=...` in setup_commands.
_ASSIGNMENT = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*)=([^\s;&|'\"\\]+)")


def credentials_in_clear(node: Any, where: str = "") -> list[str]:
    """Where a cluster file holds a credential itself rather than taking it from the environment
    or a Kubernetes Secret: a secret-named key or env entry with a literal value, a secret-named
    shell assignment, a URL with a password, or a known token shape. The value is never echoed."""
    found: list[str] = []
    if isinstance(node, dict):
        name = node.get("name")
        if isinstance(name, str) and SECRET_PATTERN.search(name) and _literal(node.get("value")):
            found.append(f"{where}: env {name} has a literal value; take it from a Secret (valueFrom)")
        for key, value in node.items():
            path = f"{where}.{key}" if where else str(key)
            if isinstance(key, str) and SECRET_PATTERN.search(key) and _literal(value):
                found.append(f"{path}: a credential in clear; take it from the environment instead")
            else:
                found += credentials_in_clear(value, path)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += credentials_in_clear(value, f"{where}[{i}]")
    elif isinstance(node, str) and _secret_in_text(node):
        found.append(f"{where}: a credential in clear; take it from the environment instead")
    return found


def _literal(value: Any) -> bool:
    """A value long enough to be a secret (`token` as an auth mode is a setting), and neither a
    reference to one ($VAR, ${VAR}) nor the path of a file that holds one (~/.ray/auth_token)."""
    text = str(value)
    return isinstance(value, (str, int)) and len(text) >= 8 and not text.startswith(("$", "/", "~", "./"))


def _secret_in_text(text: str) -> bool:
    if TOKEN_SHAPES.search(text) or any(":" in m.group("userinfo") for m in URL_USERINFO.finditer(text)):
        return True
    return any(SECRET_PATTERN.search(k) and _literal(v) for k, v in _ASSIGNMENT.findall(text))
