"""What every API's request bodies share: strict pydantic models (`StrictBody`) in which a
null field takes its default, whole numbers (`Int`) and seeds (`Seed`), content parts, the
validation that names the field at fault in the API's spelling (`parse`), the check that
refuses lone surrogates and literal image placeholders (`check_text`), and the OpenAPI
declarations of a route's bodies (`json_body`, `documented`).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Optional

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter,
                      ValidationError, model_validator)
from pydantic_core import PydanticCustomError

from ..chat.format import IMAGE_PLACEHOLDER
from ..generation.sequence import MAX_SEED
from .errors import RequestError, field_path

MIN_SEED = -2**63  # OpenAI's seeds are int64; a negative one samples as seed + 2**64
# statuses any POST route may answer with its API's error body
ERROR_STATUSES = {400: "a bad request, naming the field at fault", 401: "not authenticated",
                  404: "another model's name", 413: "the request body is too large",
                  429: "more requests than --max-concurrent-requests",
                  500: "a request that failed while running", 503: "the server is shutting down"}


def _whole(value):
    """JSON Schema's integers include 2.0: a float with an integral value is that integer."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def whole_number(**bounds):
    """An integer field's type with pydantic's bounds (`ge=1`), which takes 2.0 as 2 (the
    bounds sit inside the conversion, so that the JSON schema states them)."""
    return Annotated[int, Field(**bounds), BeforeValidator(_whole)]


Int = whole_number()
Seed = Annotated[whole_number(ge=MIN_SEED, le=MAX_SEED),
                 AfterValidator(lambda seed: seed % (MAX_SEED + 1))]


def _object_schema(schema: dict) -> dict:
    kind = schema.get("type", "object")
    if kind != "object":
        raise PydanticCustomError("object_schema", "must be a JSON schema of type 'object', got "
                                  "type {kind}", {"kind": repr(kind)})
    return schema


ObjectSchema = Annotated[dict, AfterValidator(_object_schema)]  # a tool's parameters


class StrictBody(BaseModel):
    """A request body of any API: strict types, unknown fields ignored, no NaN or Infinity; an
    optional field sent as null takes its default, as if it were left out."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        if not isinstance(data, dict):
            return data
        optional = {field.alias or name for name, field in cls.model_fields.items()
                    if not field.is_required()}
        return {key: value for key, value in data.items()
                if value is not None or key not in optional}


class ContentPart(StrictBody):
    type: str
    text: Optional[str] = None
    refusal: Optional[str] = None  # an assistant's refusal part, sent back as text
    image_url: Optional[Any] = None  # {"url": "data:..."} or the URI itself
    image: Optional[Any] = None  # the same, under the name of the "image" part type


# ----------------------------------------------------------------------------- validation

def parse(model_class, body, *, where: str = "", dotted: bool = False, chat: bool = True):
    """`body` as `model_class`, or a RequestError naming the deepest field at fault in the
    API's spelling (`dotted`: Anthropic's `messages.0.content`, else OpenAI's
    `messages[0].content`, after `where`); then `check_text` on every string (`chat`: the
    body is rendered as a chat, so no string may hold the image placeholder)."""
    if not isinstance(body, dict):
        raise RequestError(f"{where or 'the request body'} must be a JSON object, got "
                           f"{type(body).__name__}", param=where or None)
    try:
        request = model_class.model_validate(body)
    except ValidationError as e:
        at, message = _first_error(e.errors(), body, where, dotted)
        raise RequestError(f"{at}: {message}", param=at) from None
    check_text(request.model_dump(exclude_none=True, by_alias=True), where, dotted=dotted,
               chat=chat)
    return request


def _first_error(errors: list, body, where: str, dotted: bool) -> tuple:
    """(location, message) of the deepest error; the failures of a union's members at that
    location are joined ("a valid string or a valid list")."""
    located = [(_located(error["loc"], body, error["type"]), error["msg"]) for error in errors]
    depth = max(len(loc) for loc, _ in located)
    loc = next(loc for loc, _ in located if len(loc) == depth)
    messages = list(dict.fromkeys(msg for other, msg in located if other == loc))
    message = messages[0] + "".join(f" or {m.removeprefix('Input should be ')}"
                                    for m in messages[1:])
    return field_path(loc, dotted, where) or "body", message


def _located(loc: tuple, body, kind: str) -> tuple:
    """A pydantic location without the tags of union members (`str`, `list[...]`, a content
    block's type): the parts the body holds, and the name of a missing field."""
    out, value = [], body
    for i, part in enumerate(loc):
        if isinstance(value, dict) and isinstance(part, str) and part in value:
            value = value[part]
        elif isinstance(value, list) and isinstance(part, int) and 0 <= part < len(value):
            value = value[part]
        elif not (i == len(loc) - 1 and kind == "missing"):
            continue
        out.append(part)
    return tuple(out)


def check_text(value, where: str = "", *, dotted: bool = False, chat: bool = False) -> None:
    """Refuse a string (or key) holding a lone surrogate, which JSON's "\\ud800" escapes
    allow but UTF-8 cannot carry, or (`chat`) the literal image placeholder, which only an
    image part may put in a prompt; `where` names it as `parse` would."""
    if isinstance(value, str):
        _check_string(value, where, "", chat)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_string(key, where, "a key's ", chat)
            check_text(item, field_path((key,), dotted, where), dotted=dotted, chat=chat)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_text(item, field_path((i,), dotted, where), dotted=dotted, chat=chat)


def _check_string(text: str, where: str, what: str, chat: bool) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"{where or 'body'}: {what}lone surrogate U+{ord(text[e.start]):04X} "
                           f"at character {e.start} is not valid text", param=where or None
                           ) from None
    if chat and IMAGE_PLACEHOLDER in text:
        raise RequestError(f"{where or 'body'}: {what}text holds the literal image placeholder "
                           f"{IMAGE_PLACEHOLDER}; send images as image parts",
                           param=where or None)


OPENAI_TOOL_NAME = 64  # OpenAI: letters, digits, _ and -, at most 64 characters
ANTHROPIC_TOOL_NAME = 128  # Anthropic: the same characters, at most 128
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]+")


def check_tool_names(names: list, where, longest: int = OPENAI_TOOL_NAME) -> None:
    """A request's tools have distinct names (the reply names the tool it calls) made of
    letters, digits, `_` and `-`, at most `longest` of them (the API's rule); `where(k)` is
    the location of tool k's name."""
    seen = set()
    for k, name in enumerate(names):
        if not (_TOOL_NAME.fullmatch(name) and len(name) <= longest):
            raise RequestError(f"{where(k)}: {name!r} is not a tool name: use letters, digits, "
                               f"'_' and '-', at most {longest} characters", param=where(k))
        if name in seen:
            raise RequestError(f"{where(k)}: another tool is named {name!r} too", param=where(k))
        seen.add(name)


# ----------------------------------------------------------------------------- OpenAPI

def schema_of(kind) -> dict:
    """The JSON schema of a type with its definitions inlined, as an operation's OpenAPI
    entry can hold it (pydantic's `#/$defs/...` references point nowhere there)."""
    schema = TypeAdapter(kind).json_schema()
    definitions = schema.pop("$defs", {})

    def inline(node):
        if isinstance(node, list):
            return [inline(item) for item in node]
        if not isinstance(node, dict):
            return node
        if "$ref" in node:
            target = definitions[node["$ref"].rsplit("/", 1)[1]]
            return inline({**target, **{k: v for k, v in node.items() if k != "$ref"}})
        return {key: inline(item) for key, item in node.items()}

    return inline(schema)


def json_body(model_class) -> dict:
    """A route's `openapi_extra` declaring its JSON request body (the routes read and validate
    the body themselves, so that errors keep each API's shape)."""
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": schema_of(model_class)}}}}


def documented(reply: type[BaseModel], error: type[BaseModel], *, events=None,
               done: bool = False, statuses: dict = ERROR_STATUSES) -> dict:
    """A route's `responses`: `reply` with 200, or server-sent events whose `data` is JSON of
    the type `events` (and OpenAI's closing `[DONE]`, with `done`); `error` with each of
    `statuses`."""
    ok: dict = {"model": reply, "description": "the reply"}
    if events is not None:
        ok["content"] = {"text/event-stream": {"itemSchema": event_schema(events, done)}}
        ok["description"] = "the reply, or with `stream` its server-sent events"
    return {200: ok, **{status: {"model": error, "description": why}
                        for status, why in statuses.items()}}


def event_schema(data, done: bool = False) -> dict:
    """One server-sent event, as OpenAPI 3.2's `itemSchema` states it: its `data` is JSON of
    the type `data` (or, with `done`, the closing `[DONE]`)."""
    payload = {"type": "string", "contentMediaType": "application/json",
               "contentSchema": schema_of(data)}
    return {"type": "object", "required": ["data"], "properties": {
        "data": {"anyOf": [{"const": "[DONE]"}, payload]} if done else payload,
        "event": {"type": "string"}}}
