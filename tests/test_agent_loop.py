"""An agent's tool loop stays cached, through each of the server's three chat APIs: 8 turns with
thinking on, each reply (scripted on the real model by the test hook) reasoning then calling a
tool, the tool's result sent back; from the second turn on the cached prompt tokens are exactly
the previous turn's prompt and reply, so only the new turn (the tool result and the next
assistant header) is prefilled. With tools in the conversation the chat format keeps every
turn's reasoning, which is what makes the whole reply reusable."""

from __future__ import annotations

import json

import anthropic
import pytest

import mlx_v41
from mlx_v41.chat import format as cf
from server_harness import MODEL_ID, Forcing, LiveServer, write_swa_checkpoint

pytestmark = pytest.mark.usefixtures("cpu")

TURNS = 8
TOOL = {"name": "run", "description": "Run a shell command",
        "parameters": {"type": "object", "required": ["cmd"],
                       "properties": {"cmd": {"type": "string"}}}}


def script(k: int) -> str:
    """Turn k's reply: reasoning, then one call of `run`."""
    return (f"Step {k}: list the files.{cf.THINK_END}\n\n{cf.CALLS_OPEN}\n"
            f'{cf.INVOKE_OPEN} name="run">\n{cf.PARAM_OPEN} name="cmd" string="true">ls -{k}'
            f"{cf.PARAM_CLOSE}\n{cf.INVOKE_CLOSE}\n{cf.CALLS_CLOSE}")


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    model, tokenizer = mlx_v41.load(write_swa_checkpoint(tmp_path_factory.mktemp("swa") / "hf"))
    server = LiveServer(model, tokenizer, hook=Forcing(tokenizer))
    for k in range(TURNS):
        server.hook.add(f"turn-{k}", script(k))
    yield server
    server.close()


def check_cached(turns: list) -> None:
    """turns: (prompt tokens, cached tokens, completion tokens) per turn. Each loop opens with
    its own user message, so its first turn finds nothing cached."""
    assert turns[0][1] == 0, turns
    for k in range(1, len(turns)):
        prompt, cached, _ = turns[k]
        before, _, reply = turns[k - 1]
        assert cached == before + reply, (k, turns)
        assert 0 < prompt - cached < 40, (k, turns)  # the new turn only


@pytest.mark.slow
def test_chat_completions_loop_stays_cached(live):
    client = live.client()
    messages = [{"role": "user", "content": "Look at the repository (chat completions)."}]
    tools, turns = [{"type": "function", "function": TOOL}], []
    for k in range(TURNS):
        reply = client.chat.completions.create(model=MODEL_ID, messages=messages, tools=tools,
                                               max_tokens=200, user=f"turn-{k}",
                                               reasoning_effort="high")
        message, usage = reply.choices[0].message, reply.usage
        assert reply.choices[0].finish_reason == "tool_calls"
        [call] = message.tool_calls
        assert json.loads(call.function.arguments) == {"cmd": f"ls -{k}"}
        turns.append((usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens,
                      usage.completion_tokens))
        messages += [{"role": "assistant", "content": message.content,
                      "reasoning_content": message.reasoning_content,
                      "tool_calls": [c.model_dump() for c in message.tool_calls]},
                     {"role": "tool", "tool_call_id": call.id, "content": f"file{k}.txt"}]
    check_cached(turns)


@pytest.mark.slow
def test_anthropic_messages_loop_stays_cached(live):
    client = anthropic.Anthropic(base_url=live.base_url.removesuffix("/v1"), api_key="unused",
                                 max_retries=0)
    tools = [{"name": TOOL["name"], "description": TOOL["description"],
              "input_schema": TOOL["parameters"]}]
    messages = [{"role": "user", "content": "Look at the repository (messages)."}]
    turns = []
    for k in range(TURNS):
        reply = client.messages.create(model=MODEL_ID, max_tokens=200, messages=messages,
                                       tools=tools, metadata={"user_id": f"turn-{k}"},
                                       thinking={"type": "enabled", "budget_tokens": 150})
        assert reply.stop_reason == "tool_use"
        use = next(block for block in reply.content if block.type == "tool_use")
        assert use.input == {"cmd": f"ls -{k}"}
        usage = reply.usage
        turns.append((usage.input_tokens + usage.cache_read_input_tokens,
                      usage.cache_read_input_tokens, usage.output_tokens))
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                       for b in reply.content]},
                     {"role": "user", "content": [{"type": "tool_result",
                                                   "tool_use_id": use.id,
                                                   "content": f"file{k}.txt"}]}]
    check_cached(turns)


@pytest.mark.slow
def test_responses_loop_with_previous_response_id_stays_cached(live):
    """Only the new turn is sent: the server's stored conversation supplies the rest."""
    client = live.client()
    tools = [{"type": "function", **TOOL}]
    turn_input: list = [{"role": "user", "content": "Look at the repository (responses)."}]
    previous, turns = None, []
    for k in range(TURNS):
        reply = client.responses.create(model=MODEL_ID, input=turn_input, tools=tools,
                                        max_output_tokens=200, user=f"turn-{k}",
                                        reasoning={"effort": "high"},
                                        previous_response_id=previous)
        [call] = [item for item in reply.output if item.type == "function_call"]
        assert json.loads(call.arguments) == {"cmd": f"ls -{k}"}
        usage = reply.usage
        turns.append((usage.input_tokens, usage.input_tokens_details.cached_tokens,
                      usage.output_tokens))
        previous = reply.id
        turn_input = [{"type": "function_call_output", "call_id": call.call_id,
                       "output": f"file{k}.txt"}]
    check_cached(turns)
