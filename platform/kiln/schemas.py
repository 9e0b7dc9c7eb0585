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

from kiln.errors import ConfigError, KilnError


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
        return _problems(e)
    return []


def validated(
    schema: type | pydantic.TypeAdapter | Any,
    value: Any,
    where: str,
    *,
    json: bool = False,
    error: type[KilnError] = ConfigError,
) -> Any:
    """`value` checked strictly against `schema` (a dataclass, TypedDict, type or TypeAdapter;
    with `json`, `value` is a JSON document's bytes); the validated value, or the first problem
    as an `error` that starts with `where`, e.g. `prepare: seq_len: expected an integer`."""
    adapter = schema if isinstance(schema, pydantic.TypeAdapter) else pydantic.TypeAdapter(schema)
    try:
        return adapter.validate_json(value, strict=True) if json else adapter.validate_python(value, strict=True)
    except pydantic.ValidationError as e:
        raise error(f"{where}: {_problems(e)[0].removeprefix('(top level): ')}") from None


def _problems(e: pydantic.ValidationError) -> list[str]:
    lines = [f"{_path(err['loc']) or '(top level)'}: {_expected(err)}" for err in e.errors()]
    return list(dict.fromkeys(lines))  # a union's members each report the same field


_MEMBERS = {"str", "int", "float", "bool", "dict", "list"}  # pydantic's names for a union's members
# pydantic's error types in words; any other is pydantic's own message, shortened.
_WORDS = {
    "int_type": "expected an integer",
    "float_type": "expected a number",
    "bool_type": "expected true or false",
    "string_type": "expected a string",
    "list_type": "expected a list",
    "dict_type": "expected a mapping",
    "model_type": "expected a mapping",
    "model_attributes_type": "expected a mapping",
    "dataclass_type": "expected a mapping",
    "missing": "required",
    "extra_forbidden": "not a known field",
    "json_invalid": "not valid JSON",
}


def _path(loc: tuple) -> str:
    return ".".join(str(p) for p in loc if str(p) not in _MEMBERS)


def _expected(err: dict) -> str:
    return _WORDS.get(err["type"], err["msg"].split(",")[0].lower())
