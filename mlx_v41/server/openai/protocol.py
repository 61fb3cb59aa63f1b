"""Request and response bodies of the OpenAI-compatible API as typed pydantic models (OpenAI's
field names). Types are strict (`"5"` is not a number, `1` not a boolean, NaN and Infinity not
numbers, a lone surrogate such as "\\ud800" not text: a 400), null is the default, unknown
fields are ignored as OpenAI does, and a field we know but cannot honour is refused by name.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from ..bodies import (ContentPart, Int, ObjectSchema, Seed, StrictBody, check_tool_names, parse,
                      whole_number)
from ..constraints import answer_format
from ..errors import RequestError

MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat completions
MAX_COMPLETION_LOGPROBS = 5  # and for completions
MAX_CHOICES = 16  # most choices (`n`) per request: each is a sequence of the batch
MIN_PENALTY, MAX_PENALTY = 0.01, 100.0  # repetition_penalty's range


class FunctionCall(StrictBody):
    name: str
    arguments: Union[str, dict, None] = ""


class ToolCall(StrictBody):
    id: Optional[str] = None
    type: Optional[Literal["function"]] = "function"
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
    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[ObjectSchema] = None


class Tool(StrictBody):
    type: Literal["function"]
    function: FunctionSpec


class StreamOptions(StrictBody):
    include_usage: Optional[bool] = False


class _Generation(StrictBody):
    """Fields shared by chat completions and completions."""

    model: Optional[str] = None
    max_tokens: Optional[whole_number(ge=1)] = None
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, ge=0, le=1)  # 0: the most likely token only
    top_k: Optional[whole_number(ge=-1)] = None  # 0 and -1 (vLLM's "off") both disable it
    min_p: Optional[float] = Field(None, ge=0, le=1)
    seed: Optional[Seed] = None
    stop: Union[str, list[str], None] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    # mlx-lm's extension; bounded so that logits divided or multiplied by it stay finite
    repetition_penalty: Optional[float] = Field(None, ge=MIN_PENALTY, le=MAX_PENALTY)
    logit_bias: Optional[dict[str, Annotated[float, Field(ge=-100, le=100)]]] = None
    n: Optional[whole_number(ge=1)] = 1
    echo: Optional[bool] = False
    user: Optional[str] = None

    def stops(self) -> list:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[whole_number(ge=1)] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Union[str, dict, None] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[whole_number(ge=0, le=MAX_TOP_LOGPROBS)] = None
    reasoning_effort: Union[str, Int, None] = None
    chat_template_kwargs: Optional[dict] = None
    response_format: Optional[dict] = None
    parallel_tool_calls: Optional[bool] = True

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
    prompt: Union[str, list[str], list[Int]]
    logprobs: Optional[whole_number(ge=0, le=MAX_COMPLETION_LOGPROBS)] = None
    suffix: Optional[str] = None
    best_of: Optional[Int] = None

    def token_limit(self) -> Optional[int]:
        return self.max_tokens

    def logprob_count(self) -> Optional[int]:
        return self.logprobs


def parse_body(model_class, body):
    """Validate a decoded JSON body; RequestError naming the first field at fault."""
    request = parse(model_class, body, chat=model_class is ChatCompletionRequest)
    _check_unsupported(request)
    return request


def _check_unsupported(request) -> None:
    """Known OpenAI fields whose values this server cannot honour, and rules across fields."""
    if request.n > MAX_CHOICES:
        raise RequestError(f"n must be at most {MAX_CHOICES}", param="n")
    if request.stream_options is not None and not request.stream:
        raise RequestError("stream_options is only allowed when stream is true",
                           param="stream_options")
    if request.echo:
        raise RequestError("echo is not supported", param="echo")
    if isinstance(request, CompletionRequest):
        if request.suffix or (request.best_of or 1) > 1:
            raise RequestError("suffix and best_of are not supported", param="prompt")
        return
    check_tool_names([tool.function.name for tool in request.tools or ()],
                     lambda k: f"tools[{k}].function.name")
    answer_format(request.response_format)


# ----------------------------------------------------------------------------- replies

FinishReason = Literal["stop", "length", "tool_calls", "cancelled"]


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]]


class ContentLogprob(TokenLogprob):
    top_logprobs: list[TokenLogprob]


class ChatLogprobs(BaseModel):
    content: Optional[list[ContentLogprob]]
    refusal: Optional[list[ContentLogprob]]


class FunctionCallReply(BaseModel):
    name: str
    arguments: str


class ToolCallReply(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCallReply


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: Optional[str]
    refusal: Optional[str]
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None
    tool_calls: Optional[list[ToolCallReply]] = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChatLogprobs]
    finish_reason: FinishReason


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ChatCompletion(BaseModel):
    """A whole chat completion; streamed, its `chat.completion.chunk` events."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs]
    finish_reason: FinishReason


class Completion(BaseModel):
    """A whole completion; streamed, its `text_completion` chunks."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class FunctionDelta(BaseModel):
    name: Optional[str] = None
    arguments: Optional[str] = None


class ToolCallDelta(BaseModel):
    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: FunctionDelta


class ChunkDelta(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None
    tool_calls: Optional[list[ToolCallDelta]] = None


class ChunkChoice(BaseModel):
    index: int
    delta: ChunkDelta
    logprobs: Optional[ChatLogprobs]
    finish_reason: Optional[FinishReason]


class ChatCompletionChunk(BaseModel):
    """A streamed chat completion's event; the last (with `include_usage`) has no choices."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Optional[Usage] = None


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs]
    finish_reason: Optional[FinishReason]


class CompletionChunk(BaseModel):
    """A streamed completion's event; the last (with `include_usage`) has no choices."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Optional[Usage] = None
