"""What a request constrains, in every API's terms made one: which tool calls it forces
(`tool_choice` required / a named function / Anthropic's any / tool) and what its answer must
be (`response_format` json_object / json_schema, Responses' `text.format`), turned into the
JSON fields a constrained processor is made from (`processors.processors_from`), or a
RequestError naming the field the grammar library refused.
"""

from __future__ import annotations

from typing import Optional, Union

from ..chat import grammar
from ..generation.constrained import GrammarError, check_grammar
from .errors import RequestError

JSON_OBJECT = "json_object"  # an answer that is any JSON object


def constraint_fields(tokenizer, *, tools: list, calls: str = "auto",
                      named: Optional[str] = None,
                      answer: Union[None, str, dict] = None, thinking: bool = False,
                      parallel: bool = True, reasoning_budget: Optional[int] = None,
                      params: Optional[dict] = None) -> Optional[dict]:
    """The constraint of a request, or None when it has none.

    Args:
        tokenizer: the served tokenizer (its special tokens name the DSML markers).
        tools: the request's tools as function specs `{"name", "description", "parameters"}`.
        calls: "auto", "none" or "required" (OpenAI's names; Anthropic's "any" is
            "required", its "tool" is `named`).
        named: the tool whose call is forced (then `calls` is ignored).
        answer: None (free text), JSON_OBJECT, or a JSON schema the answer must match.
        thinking: the reply opens with free reasoning; the constraint starts after `</think>`.
        parallel: whether a forced call block may hold several calls.
        reasoning_budget: most reasoning tokens before `</think>` is forced (None: no bound).
        params: the request's field names for errors: "tools", "tool_choice", "format".
    Raises:
        RequestError: an unknown tool name, or a schema the grammar library cannot compile,
            naming the field.
    """
    params = {"tools": "tools", "tool_choice": "tool_choice", "format": "response_format",
              **(params or {})}
    by_name = {tool["name"]: tool for tool in tools}
    if named is not None and named not in by_name:
        raise RequestError(f"{params['tool_choice']}: the tool {named!r} is not among the "
                           f"request's tools ({', '.join(by_name) or 'none given'})",
                           param=params["tool_choice"])
    if named is None and calls == "required" and not tools:
        raise RequestError(f"{params['tool_choice']}: forcing a tool call needs tools",
                           param=params["tool_choice"])
    if named is None and calls != "required" and answer is None:
        return None
    try:
        text = grammar.reply_grammar(
            tokenizer, tools=[by_name[named]] if named is not None else tools,
            forced=named is not None or calls == "required", may_call=calls == "auto",
            answer=answer, parallel=parallel)
        check_grammar(text, tokenizer)
    except grammar.SchemaError as e:
        param = params["tools"] if e.tool is not None else params["format"]
        raise RequestError(f"{param}: {e}", param=param) from None
    except GrammarError as e:
        param = params["format"] if answer is not None and named is None \
            and calls != "required" else params["tools"]
        raise RequestError(f"{param}: the grammar library cannot compile it ({e})",
                           param=param) from None
    return {"grammar": text, "thinking": thinking, "reasoning_budget": reasoning_budget}


def answer_format(response_format: Optional[dict], param: str = "response_format"):
    """What `response_format` asks of the answer: None (text), "json_object" or the JSON
    schema of `json_schema` (OpenAI's shapes; Responses' `text.format` is the same flattened:
    its name, schema and strict sit beside the type)."""
    if not response_format:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_object"
    if kind != "json_schema":
        raise RequestError(f"{param}.type must be 'text', 'json_object' or 'json_schema', got "
                           f"{kind!r}", param=f"{param}.type")
    spec = response_format.get("json_schema", response_format)
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        where = f"{param}.json_schema.schema" if "json_schema" in response_format else \
            f"{param}.schema"
        raise RequestError(f"{where} must be a JSON schema object", param=where)
    return schema
