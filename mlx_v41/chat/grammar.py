"""The grammars of a constrained V4.1 reply, in llguidance's Lark dialect: a JSON answer under a
schema, a DSML tool-call block whose invokes name the request's tools and whose parameters
follow each tool's JSON schema, or either one.

Each grammar writes what `format.render_tool_calls` renders for the same calls (parameters in
the schema's order, one per line; a string parameter as raw text with string="true", any other
value as JSON with `json.dumps`' separators), so the next turn's prompt repeats the reply token
for token and its prompt cache hits.
"""

from __future__ import annotations

import json
import re
from typing import Optional, Union

from . import format as cf

# json.dumps' separators, as the renderer writes non-string parameters; no free whitespace
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT = {"type": "object"}
_STRING_KEYWORDS = {"type", "enum", "const", "maxLength", "minLength", "pattern", "description",
                    "title", "default", "examples", "format"}
DEFINITIONS = ("$defs", "definitions")  # where a schema keeps the targets of its `$ref`s
_ANNOTATIONS = {"title", "description", "default", "examples"}


class SchemaError(ValueError):
    """A schema this module cannot turn into a grammar; `tool` names the tool (None: the
    answer's schema)."""

    def __init__(self, message: str, tool: Optional[str] = None):
        super().__init__(message)
        self.tool = tool


def reply_grammar(tokenizer, *, tools: list, forced: bool, may_call: bool,
                  answer: Union[None, str, dict], parallel: bool = True) -> str:
    """The grammar of a reply's answer part (after `</think>` in thinking mode).

    Args:
        tokenizer: the tokenizer, whose special tokens spell the DSML markers.
        tools: function specs `{"name", "parameters"}` the calls may name.
        forced: the reply is a call block (of `tools`).
        may_call: (not forced) the reply is the answer or a call block.
        answer: "json_object", a JSON schema, or None (only with `forced`).
        parallel: a call block may hold several calls.
    """
    if forced:
        return "start: calls\n" + _calls(tokenizer, tools, parallel)
    if answer is None:
        raise SchemaError("a constrained reply needs an answer format or forced calls")
    schema = ANY_JSON_OBJECT if answer == "json_object" else answer
    if not isinstance(schema, dict):
        raise SchemaError("the answer's schema must be a JSON object")
    rules = f"answer: %json {_json(schema)}\n"
    if may_call and tools:
        return "start: answer | calls\n" + rules + _calls(tokenizer, tools, parallel)
    return "start: answer\n" + rules


def _json(schema: dict) -> str:
    return json.dumps(dict(schema, **{"x-guidance": JSON_STYLE}), ensure_ascii=False)


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _dsml(tokenizer) -> str:
    token = tokenizer.convert_tokens_to_ids(cf.DSML)
    if not isinstance(token, int) or tokenizer.convert_ids_to_tokens(token) != cf.DSML:
        raise SchemaError(f"the tokenizer has no single token for {cf.DSML}, so tool calls "
                          "cannot be constrained")
    return f"<[{token}]>"


def _calls(tokenizer, tools: list, parallel: bool) -> str:
    """`calls`: the block `render_tool_calls` writes, with one rule per tool's invoke."""
    d = _dsml(tokenizer)
    invokes = [f"invoke_{i}" for i in range(len(tools))]
    more = ' ("\\n" invoke)*' if parallel else ""
    # the newline and the closing "</" are two lexemes: as one, the newline before another
    # invoke's "<" would be lexed as its start and that invoke refused (no backing up)
    lines = [f'calls: "\\n\\n<" {d} " calls>\\n" invoke{more} "\\n" "</" {d} " calls>"',
             f"invoke: {' | '.join(invokes)}"]
    for i, tool in enumerate(tools):
        lines += _invoke(i, tool, d)
    return "\n".join(lines) + "\n"


def _invoke(i: int, tool: dict, d: str) -> list:
    """Rules of one tool's invoke: its name, then each parameter and a newline, required ones
    always, optional ones maybe, in the schema's order."""
    name, schema = tool["name"], tool.get("parameters") or {}
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        raise SchemaError(f"tool {name!r}: parameters must be a JSON schema of an object", name)
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    # each parameter compiles alone: it carries the tool schema's definitions for its `$ref`s
    defs = {k: schema[k] for k in DEFINITIONS if isinstance(schema.get(k), dict)}
    # the name as the renderer writes it (raw, not JSON-escaped)
    opening = _literal(' invoke name="' + name + '">\n')
    head = f'invoke_{i}: "<" {d} {opening} '
    close = f'"</" {d} " invoke>"'
    lines, parts = [], []
    for k, (key, value_schema) in enumerate(properties.items()):
        rule = f"param_{i}_{k}"
        lines += _parameter(rule, key, value_schema, d, name, defs)
        parts.append(f'({rule} "\\n")' + ("" if key in required else "?"))
    if required:
        params = " ".join(parts)
    else:
        # no parameter at all is rendered as an empty line, so an empty body is not one of
        # the choices: the first parameter present opens each (the later ones are optional)
        params = "(" + " | ".join([" ".join([parts[k][:-1]] + parts[k + 1:])
                                   for k in range(len(parts))] + ['"\\n"']) + ")"
    return [head + params + " " + close] + lines


def _parameter(rule: str, key: str, schema, d: str, tool: str, defs: dict) -> list:
    opening = f'"<" {d} ' + _literal(f' parameter name="{key}" string=')
    schema = _resolved(schema, defs)
    if _is_plain_string(schema):
        value = _raw_string(rule, schema, tool, key)
        return [f'{rule}: {opening} "\\"true\\">" {rule.upper()}_TEXT {d} " parameter>"',
                value]
    if not isinstance(schema, dict):
        raise SchemaError(f"tool {tool!r}: parameter {key!r} has no JSON schema", tool)
    split = _split_string(schema) or _split_any_of(schema, defs)
    if split is not None:  # a string is written raw, anything else as JSON: one branch each
        text, other = split
        return [f"{rule}: {rule}_s | {rule}_j",
                *_parameter(f"{rule}_s", key, text, d, tool, defs),
                *_parameter(f"{rule}_j", key, other, d, tool, defs)]
    return [f'{rule}: {opening} "\\"false\\">" {rule}_json "</" {d} " parameter>"',
            f"{rule}_json: %json {_json(dict(defs, **schema))}"]


def _resolved(schema, defs: dict, depth: int = 0):
    """`schema` with a `$ref` of its own into `defs` (`#/$defs/Name`, as pydantic writes
    every nested model and enum) replaced by its target, its other keywords kept beside, so
    a string enum behind a `$ref` is still written raw as the renderer writes strings."""
    ref = schema.get("$ref") if isinstance(schema, dict) else None
    if not isinstance(ref, str) or depth > 8:  # a cycle of bare `$ref`s stays as it is
        return schema
    where, _, name = ref.removeprefix("#/").partition("/")
    target = defs.get(where, {}).get(name) if where in DEFINITIONS else None
    if not isinstance(target, dict):
        return schema  # the grammar library resolves (or refuses) it
    return _resolved({**target, **{k: v for k, v in schema.items() if k != "$ref"}}, defs,
                     depth + 1)


def _split_any_of(schema: dict, defs: dict):
    """(the string branch, the rest) of an `anyOf` with one plain string branch and others
    that never take a string (pydantic's `Optional[str]`), or None."""
    branches = schema.get("anyOf")
    if not (isinstance(branches, list) and set(schema) - {"anyOf"} <= _ANNOTATIONS):
        return None
    branches = [_resolved(b, defs) for b in branches]
    texts = [b for b in branches if _is_plain_string(b)]
    others = [b for b in branches if not _is_plain_string(b)]
    if len(texts) != 1 or not others or not all(_never_string(b) for b in others):
        return None
    notes = {k: v for k, v in schema.items() if k != "anyOf"}
    other = others[0] if len(others) == 1 else {"anyOf": others}
    return dict(texts[0], **notes), dict(other, **notes)


def _never_string(schema) -> bool:
    """Whether a schema's `type` rules strings out (so its values are written as JSON)."""
    types = schema.get("type") if isinstance(schema, dict) else None
    types = [types] if isinstance(types, str) else types
    return isinstance(types, list) and "string" not in types


def _split_string(schema: dict):
    """(the string part, the rest) of a schema whose type list holds "string" and others (a
    nullable string, as OpenAI's strict mode writes optional fields), or None."""
    types = schema.get("type")
    if not (isinstance(types, list) and "string" in types and len(types) > 1
            and set(schema) <= _STRING_KEYWORDS):
        return None
    others = [t for t in types if t != "string"]
    text = dict(schema, type="string")
    other = {k: v for k, v in schema.items() if k in ("type", "enum", "const", "description")}
    other["type"] = others if len(others) > 1 else others[0]
    choices = [schema["const"]] if "const" in schema else schema.get("enum")
    if choices is not None:
        text.pop("const", None)
        other.pop("const", None)
        text["enum"] = [c for c in choices if isinstance(c, str)]
        other["enum"] = [c for c in choices if not isinstance(c, str)]
        if not text["enum"] or not other["enum"]:
            return None
    return text, other


def _is_plain_string(schema) -> bool:
    """A parameter written as raw text: a string type with nothing but string keywords, or
    an enum (or const) of strings alone."""
    if not isinstance(schema, dict) or not set(schema) <= _STRING_KEYWORDS:
        return False
    choices = [schema["const"]] if "const" in schema else schema.get("enum")
    if "type" not in schema:
        return choices is not None and all(isinstance(c, str) for c in choices)
    return schema["type"] == "string"


def _raw_string(rule: str, schema: dict, tool: str, key: str) -> str:
    """A string parameter's text and the `</` after it as one lexeme (so the text itself may
    hold `</`: only the DSML token ends it)."""
    terminal = f"{rule.upper()}_TEXT"
    choices = [schema["const"]] if "const" in schema else schema.get("enum")
    if choices is not None:
        if not all(isinstance(c, str) for c in choices):
            raise SchemaError(f"tool {tool!r}: parameter {key!r}: a string enum holds a "
                              "non-string", tool)
        return f"{terminal}: " + " | ".join(_literal(c + "</") for c in choices)
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    length = f"/(.|\\n){{{low},{'' if high is None else high}}}/"
    if "pattern" in schema:
        # the pattern and the length bounds both hold: the two regexes' intersection
        pattern = _regex_body(schema["pattern"].removeprefix("^").removesuffix("$"))
        return f'{terminal}: (/({pattern})/ & {length}) "</"'
    return f'{terminal}: {length} "</"'


def _regex_body(body: str) -> str:
    return re.sub(r"(?<!\\)/", r"\\/", body)
