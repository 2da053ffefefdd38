"""Validate a CacheShard the way the API server would: the CRD's own schema plus its CEL rules.

A real API server rejects bad CacheShards at ``kubectl apply``. The local cluster's API
(:mod:`kvshard_local.apiserver`) does the same with this module, and the operator checks every
object again, since it should not trust that it runs behind a validating server (a CacheShard stored
before a CRD upgrade tightened a rule is one way to meet an invalid one). So both check every object
against the *same* ``openAPIV3Schema`` (with jsonschema) and evaluate the *same*
``x-kubernetes-validations`` rules (with cel-python), and every message names the field, e.g.
``spec.clusters: -1 is less than the minimum of 1``. It needs ``jsonschema`` and ``cel-python``
(the ``operator`` extra), so only the operator and the local API import it.

Kubernetes semantics kept here: defaults are applied before validation, unknown fields are errors
(``kubectl apply`` validates strictly), integers never accept floats, CEL rules run with ``self``
bound to the node that declares them and report at ``fieldPath`` when given.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Iterator, Mapping
from typing import Any, cast

import celpy
import jsonschema
import jsonschema.validators
from celpy import adapter as cel_adapter
from celpy import evaluation as cel_evaluation

from kvshard import crd

_SKIP_CEL_ERRORS = (cel_evaluation.CELEvalError, KeyError, TypeError, AttributeError)


@dataclasses.dataclass(frozen=True)
class Violation:
    """One rejected field: where (a dotted path such as ``spec.catalog.file.path``) and why."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class InvalidCacheShardError(ValueError):
    """A CacheShard breaks its CRD's schema or CEL rules; ``violations`` lists every field."""

    def __init__(self, violations: list[Violation]) -> None:
        super().__init__("; ".join(str(v) for v in violations))
        self.violations = violations


def _is_strict_integer(checker: Any, instance: object) -> bool:
    return isinstance(instance, int) and not isinstance(instance, bool)


_TypeChecker = jsonschema.Draft202012Validator.TYPE_CHECKER.redefine("integer", _is_strict_integer)
_Validator = jsonschema.validators.extend(jsonschema.Draft202012Validator, type_checker=_TypeChecker)


def _closed(schema: Any) -> Any:
    """Turn OpenAPI structural schema into JSON Schema that rejects unknown fields."""
    if isinstance(schema, dict):
        out = {k: _closed(v) for k, v in schema.items() if k != "x-kubernetes-validations"}
        if (
            out.get("type") == "object"
            and "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_closed(v) for v in schema]
    return schema


def apply_defaults(schema: Mapping[str, Any], value: Any) -> Any:
    """A copy of ``value`` with the schema's ``default``s filled in, as the API server does."""
    value = copy.deepcopy(value)
    _fill(schema, value)
    return value


def _fill(schema: Mapping[str, Any], value: Any) -> None:
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                _fill(sub, value[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in value:
                if key not in schema.get("properties", {}):
                    _fill(extra, value[key])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            _fill(schema["items"], item)


def _path(parts: Iterator[Any] | list[Any]) -> str:
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "<root>"


def _join(base: str, name: str) -> str:
    return name if base == "<root>" else f"{base}.{name}"


def _schema_violations(schema: Mapping[str, Any], obj: Any) -> list[Violation]:
    validator = _Validator(_closed(schema))
    found: list[Violation] = []
    for error in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path))):
        where = _path(list(error.absolute_path))
        if error.validator == "required":
            missing = re.match(r"'([^']+)'", error.message)
            field = _join(where, missing.group(1)) if missing else where
            found.append(Violation(field, "Required value"))
        elif error.validator == "additionalProperties" and isinstance(error.instance, dict):
            known = set(cast(dict[str, Any], error.schema).get("properties", {}))
            for name in sorted(set(error.instance) - known):
                found.append(Violation(_join(where, name), "unknown field"))
        elif error.validator == "maxLength" and isinstance(error.instance, str):
            found.append(Violation(where, f"must be at most {error.validator_value} characters "
                                          f"(got {len(error.instance)})"))
        elif error.validator == "pattern" and isinstance(error.instance, str):
            shown = error.instance if len(error.instance) <= 60 else error.instance[:57] + "..."
            found.append(Violation(where, f"{shown!r} does not match {error.validator_value!r}"))
        else:
            found.append(Violation(where, error.message))
    return found


def _cel_violations(schema: Mapping[str, Any], value: Any, where: str) -> Iterator[Violation]:
    if value is None:
        return
    for rule in schema.get("x-kubernetes-validations", []):
        try:
            passed = _evaluate(rule["rule"], value)
        except _SKIP_CEL_ERRORS:
            continue  # a type error that the schema check already reports
        if not passed:
            field = where + rule.get("fieldPath", "")
            yield Violation(field, rule.get("message") or f"failed rule: {rule['rule']}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for name, sub in props.items():
            if name in value:
                yield from _cel_violations(sub, value[name], _join(where, name))
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key, sub_value in value.items():
                if key not in props:
                    yield from _cel_violations(extra, sub_value, _join(where, key))
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            yield from _cel_violations(schema["items"], item, f"{where}[{i}]")


_ENV = celpy.Environment()
_PROGRAMS: dict[str, Any] = {}


def _evaluate(rule: str, value: Any) -> bool:
    program = _PROGRAMS.get(rule)
    if program is None:
        program = _PROGRAMS[rule] = _ENV.program(_ENV.compile(rule))
    result = program.evaluate({"self": cel_adapter.json_to_cel(value)})
    if isinstance(result, cel_evaluation.CELEvalError):
        raise result
    return bool(result)


def violations(obj: Mapping[str, Any], schema: Mapping[str, Any] | None = None, *,
               api_version: str = f"{crd.GROUP}/{crd.VERSION}", kind: str = crd.KIND) -> list[Violation]:
    """Every violation of the CRD's schema and CEL rules (empty when valid); the CacheShard CRD's
    unless ``schema`` (and the ``api_version`` and ``kind`` it belongs to) say otherwise."""
    schema = schema if schema is not None else crd.version_schema(crd.load_crd())
    found: list[Violation] = []
    if obj.get("apiVersion", api_version) != api_version:
        found.append(Violation("apiVersion", f"must be {api_version}"))
    if obj.get("kind", kind) != kind:
        found.append(Violation("kind", f"must be {kind}"))
    defaulted = apply_defaults(schema, dict(obj))
    found += _schema_violations(schema, defaulted)
    found += _cel_violations(schema, defaulted, "<root>")
    return found


def validate(obj: Mapping[str, Any], schema: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The object with defaults applied, or :class:`InvalidCacheShardError` naming every bad field."""
    schema = schema if schema is not None else crd.version_schema(crd.load_crd())
    found = violations(obj, schema)
    if found:
        raise InvalidCacheShardError(found)
    return cast(dict[str, Any], apply_defaults(schema, dict(obj)))


def validate_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Validate just a ``spec`` (what a kopf handler receives); returns the defaulted spec."""
    obj = {"apiVersion": f"{crd.GROUP}/{crd.VERSION}", "kind": crd.KIND, "metadata": {}, "spec": dict(spec)}
    return cast(dict[str, Any], validate(obj)["spec"])
