"""Kept true to the API (issue 19, point 5): every operation, parameter,
body field and record field the SDK uses (declared in roost._wire, the only
way the SDK builds requests and reads records) exists in the running
server's /v1/openapi.json with the same JSON type."""

from __future__ import annotations

import dataclasses
import json
import typing
import urllib.request
from typing import Any, Dict, Set

from roost import _wire as wire

from conftest import Deployment


def _load(deployment: Deployment) -> Dict[str, Any]:
    with urllib.request.urlopen(deployment.url + "/v1/openapi.json", timeout=30) as response:
        document: Dict[str, Any] = json.loads(response.read())
    return document


def _resolve(document: Dict[str, Any], schema: Dict[str, Any]) -> Dict[str, Any]:
    while "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        schema = document["components"]["schemas"][name]
    return schema


def _json_types(document: Dict[str, Any], schema: Dict[str, Any]) -> Set[str]:
    """The JSON types a schema allows (following $ref, oneOf)."""
    if "oneOf" in schema or "anyOf" in schema:
        types: Set[str] = set()
        for option in schema.get("oneOf", schema.get("anyOf", [])):
            types |= _json_types(document, option)
        return types
    schema = _resolve(document, schema)
    kind = schema.get("type")
    if kind is None and "enum" in schema:
        return {"string"}
    if isinstance(kind, list):
        return set(kind)
    return {kind} if kind else set()


def _python_types(annotation: Any) -> Set[str]:
    origin = typing.get_origin(annotation)
    if origin is typing.Union:
        types: Set[str] = set()
        for arg in typing.get_args(annotation):
            types |= {"null"} if arg is type(None) else _python_types(arg)
        return types
    if origin in (list, typing.List):
        return {"array"}
    if origin in (dict, typing.Dict):
        return {"object"}
    if dataclasses.is_dataclass(annotation):
        return {"object"}
    return {str: {"string"}, int: {"integer"}, float: {"number"}, bool: {"boolean"}}[annotation]


def _model_of(annotation: Any) -> Any:
    for arg in (annotation, *typing.get_args(annotation)):
        if dataclasses.is_dataclass(arg):
            return arg
        for inner in typing.get_args(arg):
            if dataclasses.is_dataclass(inner):
                return inner
    return None


def _check_model(document: Dict[str, Any], model: Any, schema: Dict[str, Any], seen: Set[str]) -> None:
    schema = _resolve(document, schema)
    if model.__name__ in seen:
        return
    seen.add(model.__name__)
    properties = schema["properties"]
    required = set(schema.get("required", []))
    hints = wire.field_types(model)
    for field in dataclasses.fields(model):
        assert field.name in properties, f"{model.__name__}.{field.name} is not in the API's schema"
        ours = _python_types(hints[field.name])
        theirs = _json_types(document, properties[field.name])
        assert ours - {"null"} == theirs - {"null"}, f"{model.__name__}.{field.name}: SDK {ours}, API {theirs}"
        if "null" not in ours:
            # The SDK treats it as always there: the API must promise it
            # (required and never null), or give the SDK's default.
            assert field.name in required or field.default is not dataclasses.MISSING or (
                field.default_factory is not dataclasses.MISSING
            ), f"{model.__name__}.{field.name} is not required by the API"
            assert "null" not in theirs, f"{model.__name__}.{field.name} may be null in the API"
        nested = _model_of(hints[field.name])
        if nested is not None:
            prop = properties[field.name]
            if "oneOf" in prop:
                prop = next(option for option in prop["oneOf"] if "$ref" in option)
            if _resolve(document, prop).get("type") == "array" or prop.get("type") == "array":
                prop = _resolve(document, prop)["items"]
            _check_model(document, nested, prop, seen)


def test_every_operation_and_field_the_sdk_uses_is_in_the_openapi_document(deployment: Deployment) -> None:
    document = _load(deployment)
    seen: Set[str] = set()
    for op in wire.OPERATIONS:
        where = f"{op.method} {op.path}"
        assert op.path in document["paths"], f"{where}: no such path"
        operation = document["paths"][op.path].get(op.method.lower())
        assert operation is not None, f"{where}: no such method"
        parameters = {(p["name"], p["in"]): p for p in operation.get("parameters", [])}
        for name in op.query:
            assert (name, "query") in parameters, f"{where}: no query parameter {name}"
        for name in [segment[1:-1] for segment in op.path.split("/") if segment.startswith("{")]:
            assert (name, "path") in parameters, f"{where}: no path parameter {name}"
        for name in op.headers:
            assert (name, "header") in parameters, f"{where}: no header {name}"
        if op.idempotency_key:
            assert ("Idempotency-Key", "header") in parameters, f"{where}: no Idempotency-Key header"
        if op.body is not None:
            body = _resolve(document, operation["requestBody"]["content"]["application/json"]["schema"])
            for name, kind in op.body.items():
                assert name in body["properties"], f"{where}: no body field {name}"
                theirs = _json_types(document, body["properties"][name])
                assert kind in theirs, f"{where}: body field {name} is {theirs}, the SDK sends {kind}"
        success = [code for code in operation["responses"] if code.startswith("2")]
        assert success, f"{where}: no success response"
        if op.response is None:
            continue
        schema = operation["responses"][success[0]]["content"]["application/json"]["schema"]
        if op.list_field is not None:
            listing = _resolve(document, schema)
            assert op.list_field in listing["properties"], f"{where}: no {op.list_field} in the answer"
            schema = listing["properties"][op.list_field]["items"]
            if "next_cursor" in listing["properties"]:
                assert _json_types(document, listing["properties"]["next_cursor"]) == {"string", "null"}
        _check_model(document, op.response, schema, seen)
    # Every record type the SDK exposes was checked through some operation.
    assert seen >= {m.__name__ for m in wire.MODELS}, f"unchecked models: {set(m.__name__ for m in wire.MODELS) - seen}"


def test_the_error_codes_the_sdk_types_are_the_apis(deployment: Deployment) -> None:
    from roost import _errors

    document = _load(deployment)
    codes = set(_resolve(document, {"$ref": "#/components/schemas/ErrorCode"})["enum"])
    assert set(_errors._BY_CODE) == codes, f"SDK {sorted(_errors._BY_CODE)} vs API {sorted(codes)}"
    detail = _resolve(document, {"$ref": "#/components/schemas/ErrorDetail"})
    assert {"code", "message", "request_id"} <= set(detail["required"])
