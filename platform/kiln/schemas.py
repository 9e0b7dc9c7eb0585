"""Typed input at the edge: pydantic schemas for what users hand Kiln, and one way to say
what is wrong with it (`type_problems`, `validated`): the field's path and the type expected,
never the value, which may be a secret.

The cluster-file fields Kiln reads are checked here before any rule looks at them.

Ray's JSON schema leaves many of these open (a node type's `node_config`, `resources`), and
KubeRay's CRDs do not ship with Ray, so a string where a mapping or a number belongs would
otherwise reach Kiln's rules as an internal error. Each wrong field is one line naming its
path and the type expected, never the value (which may be a secret). Other keys are allowed:
these are the parts Kiln reads, not the whole format.
"""

from __future__ import annotations

from typing import Any

import pydantic
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr

from kiln.errors import ConfigError


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class NodeType(_Open):
    min_workers: StrictInt = 0
    max_workers: StrictInt | None = None
    node_config: dict[str, Any] = {}
    resources: dict[str, float] = {}  # strict floats take integers too


class Provider(_Open):
    type: StrictStr


class Launcher(_Open):
    """A Ray cluster launcher YAML."""

    cluster_name: StrictStr | None = None
    max_workers: StrictInt | None = None
    provider: Provider | None = None
    head_node_type: StrictStr | None = None
    available_node_types: dict[str, NodeType] = {}
    setup_commands: list[StrictStr] = []
    head_setup_commands: list[StrictStr] = []
    worker_setup_commands: list[StrictStr] = []
    head_start_ray_commands: list[StrictStr] = []
    worker_start_ray_commands: list[StrictStr] = []


class EnvVar(_Open):
    name: StrictStr | None = None
    value: StrictStr | StrictInt | None = None


class Container(_Open):
    name: StrictStr | None = None
    image: StrictStr | None = None
    env: list[EnvVar] | None = None


class PodSpec(_Open):
    containers: list[Container] | None = None


class Template(_Open):
    spec: PodSpec | None = None


class HeadGroup(_Open):
    template: Template | None = None


class WorkerGroup(_Open):
    groupName: StrictStr | None = None  # noqa: N815 - KubeRay's spelling
    template: Template | None = None
    minReplicas: StrictInt = 0  # noqa: N815
    replicas: StrictInt = 0
    maxReplicas: StrictInt = 2**31  # noqa: N815


class AuthOptions(_Open):
    mode: StrictStr | None = None


class ClusterSpec(_Open):
    headGroupSpec: HeadGroup | None = None  # noqa: N815
    workerGroupSpecs: list[WorkerGroup] | None = None  # noqa: N815
    authOptions: AuthOptions | None = None  # noqa: N815


class Metadata(_Open):
    name: StrictStr | None = None


class JobSpec(_Open):
    entrypoint: StrictStr | None = None
    rayClusterSpec: ClusterSpec | None = None  # noqa: N815
    clusterSelector: dict[str, Any] | None = None  # noqa: N815


class KubeRay(_Open):
    """A KubeRay RayCluster or RayJob manifest."""

    apiVersion: StrictStr | None = None  # noqa: N815
    kind: StrictStr | None = None
    metadata: Metadata | None = None
    spec: dict[str, Any] | None = None


def type_problems(model: type[BaseModel] | pydantic.TypeAdapter, doc: Any) -> list[str]:
    """One line per field of `doc` whose type `model` (a model or a TypeAdapter, strict) does
    not take: its path and what was expected, never the value."""
    try:
        if isinstance(model, pydantic.TypeAdapter):
            model.validate_python(doc, strict=True)
        else:
            model.model_validate(doc)
    except pydantic.ValidationError as e:
        lines = [f"{_path(err['loc']) or '(top level)'}: {_expected(err)}" for err in e.errors()]
        return list(dict.fromkeys(lines))  # a union's members each report the same field
    return []


def validated(schema: type | Any, value: Any, where: str) -> Any:
    """`value` checked strictly against `schema` (a dataclass, TypedDict or type); the first
    problem as a ConfigError that starts with `where`, e.g. `prepare: seq_len: expected an integer`."""
    adapter = pydantic.TypeAdapter(schema)
    problems = type_problems(adapter, value)
    if problems:
        raise ConfigError(f"{where}: {problems[0].removeprefix('(top level): ')}")
    return value


_MEMBERS = {"str", "int", "float", "bool", "dict", "list"}  # pydantic's names for a union's members


def _path(loc: tuple) -> str:
    return ".".join(str(p) for p in loc if str(p) not in _MEMBERS)


def _expected(err: dict) -> str:
    kind = err["type"]
    words = {"int_type": "expected an integer", "missing": "required", "bool_type": "expected true or false",
             "dataclass_type": "expected a mapping", "extra_forbidden": "not a known field", "string_type": "expected a string", "dict_type": "expected a mapping",
             "list_type": "expected a list", "float_type": "expected a number", "model_type": "expected a mapping",
             "model_attributes_type": "expected a mapping"}
    return words.get(kind, f"{err['msg'].split(',')[0].lower()}")
