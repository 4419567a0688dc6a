"""The report's JSON schema (report/schema.json) and a validator for it.

``validate`` uses ``jsonschema`` when it is installed; otherwise a small checker for the subset of
JSON Schema the file uses (type, required, properties, items, enum, anyOf, $ref, pattern,
minimum, additionalProperties, propertyNames), so a report can be checked with no extra package.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

SCHEMA_VERSION = "1.1"
SCHEMA_PATH = Path(__file__).with_name("schema.json")

_TYPES = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
    "null": type(None),
}


@cache
def load_schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())


def validate(report: dict) -> None:
    """Raise ValueError naming the first place where ``report`` breaks the schema, or where one
    of its records breaks a rule the schema cannot state (:func:`record_problem`)."""
    schema = load_schema()
    try:
        import jsonschema
    except ImportError:
        errors = list(_errors(report, schema, schema, "$"))
        if errors:
            raise ValueError(f"report does not match {SCHEMA_PATH.name}: {errors[0]}") from None
    else:
        try:
            jsonschema.validate(report, schema)
        except jsonschema.ValidationError as error:
            where = "$" + "".join(f"[{p!r}]" for p in error.absolute_path)
            raise ValueError(
                f"report does not match {SCHEMA_PATH.name}: {where}: {error.message}"
            ) from None
    for index, record in enumerate(report["records"]):
        problem = _record_rule(record, f"$.records[{index}]")
        if problem is not None:
            raise ValueError(f"report does not match {SCHEMA_PATH.name}: {problem}")


def record_problem(record: object) -> str | None:
    """Why ``record`` (one parsed ``records.jsonl`` line) is not a report record, or None."""
    schema = load_schema()
    first = next(_errors(record, schema["$defs"]["record"], schema, "record"), None)
    return first if first is not None else _record_rule(record, "record")


def _record_rule(record: dict, where: str) -> str | None:
    """The rule readers rely on beyond the schema: an ``ok`` record with forward pairs (a
    backward-only record has none) has a ``primary_pair`` naming one of them."""
    forward = record["pairs"] or "backward" not in record
    if record["status"] == "ok" and forward and record.get("primary_pair") not in record["pairs"]:
        return (
            f"{where}: status 'ok' needs primary_pair naming one of its pairs "
            f"{sorted(record['pairs'])}, got {record.get('primary_pair')!r}"
        )
    return None


def _is_type(value, name: str) -> bool:
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[name])


def _errors(value, schema: dict, root: dict, where: str):
    """Yield messages for every rule of ``schema`` that ``value`` breaks."""
    if "$ref" in schema:
        target = root
        for part in schema["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        yield from _errors(value, target, root, where)
        return
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else types
        if not any(_is_type(value, name) for name in names):
            yield f"{where}: {value!r:.60} is not of type {types}"
            return
    if "enum" in schema and value not in schema["enum"]:
        yield f"{where}: {value!r:.60} is not one of {schema['enum']}"
    if "anyOf" in schema and all(any(_errors(value, s, root, where)) for s in schema["anyOf"]):
        yield f"{where}: {value!r:.60} matches none of anyOf"
    if "pattern" in schema and isinstance(value, str) and not re.search(schema["pattern"], value):
        yield f"{where}: {value!r} does not match {schema['pattern']!r}"
    if "minimum" in schema and _is_type(value, "number") and value < schema["minimum"]:
        yield f"{where}: {value} < minimum {schema['minimum']}"
    if isinstance(value, dict):
        for key in schema.get("required", []):
            if key not in value:
                yield f"{where}: missing required field {key!r}"
        properties = schema.get("properties", {})
        for key, item in value.items():
            if "propertyNames" in schema:
                yield from _errors(key, schema["propertyNames"], root, f"{where} key")
            if key in properties:
                yield from _errors(item, properties[key], root, f"{where}.{key}")
            elif isinstance(schema.get("additionalProperties"), dict):
                yield from _errors(item, schema["additionalProperties"], root, f"{where}.{key}")
    if isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            yield from _errors(item, schema["items"], root, f"{where}[{index}]")
