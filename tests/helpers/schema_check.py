"""Validate a JSON value against a JSON schema: ``jsonschema`` when installed, else a checker of the
keywords the structured-output tests use (type, properties, required, additionalProperties, enum,
minimum / maximum, minLength / maxLength, items, minItems / maxItems)."""

from __future__ import annotations

_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def schema_errors(value, schema: dict, path: str = "$") -> list[str]:
    try:
        import jsonschema
    except ImportError:
        return _errors(value, schema, path)
    return [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(value)]


def _errors(value, schema: dict, path: str) -> list[str]:
    errs: list[str] = []
    t = schema.get("type")
    if t is not None:
        if t == "integer":
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif t == "number":
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        else:
            ok = isinstance(value, _TYPES[t]) and not (t != "boolean" and isinstance(value, bool))
        if not ok:
            return [f"{path}: {value!r} is not of type {t}"]
    if "enum" in schema and value not in schema["enum"]:
        errs.append(f"{path}: {value!r} not in {schema['enum']}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errs.append(f"{path}: {value} < minimum {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errs.append(f"{path}: {value} > maximum {schema['maximum']}")
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0) or len(value) > schema.get("maxLength", len(value)):
            errs.append(f"{path}: length {len(value)} outside the string's bounds")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", len(value)):
            errs.append(f"{path}: {len(value)} items outside the array's bounds")
        for i, v in enumerate(value):
            errs += _errors(v, schema.get("items", {}), f"{path}[{i}]")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        errs += [f"{path}: missing {k!r}" for k in schema.get("required", ()) if k not in value]
        for k, v in value.items():
            if k in props:
                errs += _errors(v, props[k], f"{path}.{k}")
            elif schema.get("additionalProperties") is False:
                errs.append(f"{path}: unexpected property {k!r}")
    return errs
