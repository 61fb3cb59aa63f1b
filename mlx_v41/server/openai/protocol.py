"""Request bodies of the OpenAI-compatible API as typed pydantic models (OpenAI's field names).
Types are strict (`"5"` is not a number, `1` not a boolean, NaN and Infinity not numbers, a
lone surrogate such as "\\ud800" not text: a 400), unknown fields are ignored as OpenAI does,
and a field we know but cannot honour is refused by name.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import ConfigDict, Field, ValidationError

from ...generation.sequence import MAX_SEED
from ..bodies import ContentPart, StrictBody, check_text
from ..constraints import answer_format
from ..errors import RequestError

MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat completions
MAX_COMPLETION_LOGPROBS = 5  # and for completions
MAX_CHOICES = 16  # most choices (`n`) per request: each is a sequence of the batch


class FunctionCall(StrictBody):
    name: str
    arguments: Union[str, dict] = ""


class ToolCall(StrictBody):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None  # the same text under the name some clients send back


class FunctionSpec(StrictBody):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    name: str
    description: Optional[str] = None
    parameters: Optional[dict] = None


class Tool(StrictBody):
    type: Literal["function"]
    function: FunctionSpec


class StreamOptions(StrictBody):
    include_usage: bool = False


class _Generation(StrictBody):
    """Fields shared by chat completions and completions."""

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1)  # 0 and -1 (vLLM's "off") both disable it
    min_p: Optional[float] = Field(None, ge=0, le=1)
    seed: Optional[int] = Field(None, ge=0, le=MAX_SEED)
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = Field(None, gt=0)  # mlx-lm's extension
    logit_bias: Optional[dict[str, float]] = None
    n: int = Field(1, ge=1)
    user: Optional[str] = None

    def stops(self) -> list:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    tools: Optional[list[Tool]] = None
    tool_choice: Union[str, dict, None] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    reasoning_effort: Union[str, int, None] = None
    chat_template_kwargs: Optional[dict] = None
    response_format: Optional[dict] = None
    parallel_tool_calls: bool = True

    def token_limit(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens

    def logprob_count(self) -> Optional[int]:
        """None: no logprobs; else the alternatives per token (0..20)."""
        if not self.logprobs:
            if self.top_logprobs:
                raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
            return None
        return self.top_logprobs or 0


class CompletionRequest(_Generation):
    prompt: Union[str, list[str], list[int]]
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    def token_limit(self) -> Optional[int]:
        return self.max_tokens

    def logprob_count(self) -> Optional[int]:
        return self.logprobs


def parse_body(model_class, body):
    """Validate a decoded JSON body; RequestError naming the first field at fault."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got "
                           f"{type(body).__name__}")
    try:
        request = model_class.model_validate(body)
    except ValidationError as e:
        error = e.errors()[0]
        where = ".".join(str(part) for part in error["loc"]) or "body"
        raise RequestError(f"{where}: {error['msg']}", param=where) from None
    check_text(request.model_dump(exclude_none=True), "")
    _check_unsupported(request)
    return request


def _check_unsupported(request) -> None:
    """Known OpenAI fields whose non-default values this server cannot honour."""
    if request.n > MAX_CHOICES:
        raise RequestError(f"n must be at most {MAX_CHOICES}", param="n")
    if isinstance(request, CompletionRequest):
        if request.echo or request.suffix or (request.best_of or 1) > 1:
            raise RequestError("echo, suffix and best_of are not supported", param="prompt")
        return
    answer_format(request.response_format)

