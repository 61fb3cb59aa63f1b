"""Real agent libraries against a live server on a random checkpoint: instructor (TOOLS and
JSON_SCHEMA modes), langchain-openai's `with_structured_output`, the openai Agents SDK (a
function tool, an `output_type`) and the openai SDK's `parse` / `stream` helpers. Each asks
for a nested pydantic model (`$ref`s into `$defs`) through a forced call or a schema answer,
so the grammar, not the weights, makes the reply valid: the library must hand back a parsed
object of the right type. The server runs as `mlx_v41.server --no-thinking` (free reasoning
on a random model need not close). Slow: each library is a separate install and a few
hundred decoded tokens per reply."""

from __future__ import annotations


import openai
import pytest

from nested_models import Place
from server_harness import LiveServer, write_swa_checkpoint

import mlx_v41

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("cpu")]

LIMIT = 800  # max_tokens; a forced call of the character-level vocabulary takes 100-300
ASK = "Describe a place."








@pytest.fixture(scope="module")
def live(tmp_path_factory):
    model, tokenizer = mlx_v41.load(write_swa_checkpoint(tmp_path_factory.mktemp("swa") / "hf"))
    server = LiveServer(model, tokenizer, thinking=False)
    yield server
    server.close()


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor(live, mode):
    instructor = pytest.importorskip("instructor")
    client = instructor.from_openai(live.client(), mode=getattr(instructor.Mode, mode))
    place = client.chat.completions.create(
        model="tiny", response_model=Place, max_retries=0, max_tokens=LIMIT,
        messages=[{"role": "user", "content": ASK}])
    assert isinstance(place, Place)


@pytest.mark.parametrize("method", [None, "json_schema", "function_calling"])
def test_langchain_with_structured_output(live, method):
    chat_models = pytest.importorskip("langchain_openai")
    model = chat_models.ChatOpenAI(model="tiny", base_url=live.base_url, api_key="unused",
                                   max_tokens=LIMIT, temperature=0, max_retries=0)
    structured = model.with_structured_output(Place) if method is None else \
        model.with_structured_output(Place, method=method)
    assert isinstance(structured.invoke(ASK), Place)


def _agents_model(live):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=live.base_url, api_key="unused", max_retries=0)
    return agents, agents.OpenAIChatCompletionsModel(model="tiny", openai_client=client)


def test_agents_sdk_output_type(live):
    agents, model = _agents_model(live)
    agent = agents.Agent(name="places", instructions="Answer with a place.", model=model,
                         output_type=Place,
                         model_settings=agents.ModelSettings(max_tokens=LIMIT))
    result = agents.Runner.run_sync(agent, ASK, max_turns=1)
    assert isinstance(result.final_output, Place)


def test_agents_sdk_function_tool(live):
    """tool_choice "required" forces the call; the tool's result ends the run."""
    agents, model = _agents_model(live)
    seen = []

    @agents.function_tool
    def mark(place: Place) -> str:
        """Mark a place on the map."""
        seen.append(place)
        return "marked"

    agent = agents.Agent(name="mapper", instructions="Mark a place.", model=model,
                         tools=[mark], tool_use_behavior="stop_on_first_tool",
                         model_settings=agents.ModelSettings(tool_choice="required",
                                                             max_tokens=LIMIT))
    result = agents.Runner.run_sync(agent, ASK, max_turns=2)
    assert result.final_output == "marked"
    assert seen and all(isinstance(place, Place) for place in seen)


def test_openai_parse_helpers(live):
    """The openai SDK's `parse` (a pydantic response_format, a `pydantic_function_tool`)
    and its streamed `stream` helper."""
    client = live.client()
    messages = [{"role": "user", "content": ASK}]
    reply = client.chat.completions.parse(model="tiny", messages=messages, max_tokens=LIMIT,
                                          response_format=Place)
    assert isinstance(reply.choices[0].message.parsed, Place)
    reply = client.chat.completions.parse(
        model="tiny", messages=messages, max_tokens=LIMIT,
        tools=[openai.pydantic_function_tool(Place)], tool_choice="required")
    calls = reply.choices[0].message.tool_calls
    assert calls and all(isinstance(c.function.parsed_arguments, Place) for c in calls)
    with client.chat.completions.stream(model="tiny", messages=messages, max_tokens=LIMIT,
                                        response_format=Place) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Place)
    beta = getattr(getattr(client, "beta", None), "chat", None)
    if beta is not None:  # older SDKs kept `parse` under beta
        reply = beta.completions.parse(model="tiny", messages=messages, max_tokens=LIMIT,
                                       response_format=Place)
        assert isinstance(reply.choices[0].message.parsed, Place)
