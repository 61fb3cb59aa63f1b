"""The prompt-cache hit ratio of an agent's tool loop, per turn, through each chat API of
`mlx_v41.server`: chat completions (`openai`), Anthropic Messages (`anthropic`) and OpenAI
Responses with `previous_response_id` (only the new turn sent).

The loop: a system prompt of --system-chars, then --turns turns with thinking on; every reply
reasons and calls a tool `run` (the reply is scripted: a logits processor makes the real
model write it, as an agent's model would), and the tool's output (--result-chars) goes back.
Each API's loop has its own system prompt, so it starts with a cold cache. Printed per turn and
API: prompt tokens, cached tokens, the new turn's tokens (prompt minus
the previous prompt and reply) and the hit ratio cached / prompt. The rule it checks: from the
second turn on, cached = previous prompt + previous reply.

    python benchmarks/bench_agent_loop.py [--model PATH --turns 8 --system-chars 2000
                                           --result-chars 300]
"""

from __future__ import annotations

import argparse
import socket
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout too
import anthropic  # noqa: E402
import mlx.core as mx  # noqa: E402
import openai  # noqa: E402
import uvicorn  # noqa: E402

import mlx_v41  # noqa: E402
from mlx_v41.chat import format as cf  # noqa: E402
from mlx_v41.server import PromptCacheStore, ServerConfig, create_app  # noqa: E402
from mlx_v41.server.engine.batch import BatchEngine  # noqa: E402

CHECKPOINT = ROOT / "tests/data/goldens/tiny/hf"
TOOL = {"name": "run", "description": "Run a shell command and return its output",
        "parameters": {"type": "object", "required": ["cmd"],
                       "properties": {"cmd": {"type": "string"}}}}
SCRIPT_BIAS = 1e4  # beats any logit of the model


class Scripts:
    """The app's processor hook: a request whose user (or metadata.user_id) names turn k gets
    a processor that writes turn k's reply, then EOS."""

    def __init__(self, tokenizer, turns: int):
        self.eos = tokenizer.convert_tokens_to_ids(cf.EOS)
        self.replies = {f"turn-{k}": tokenizer.encode(reply_text(k), add_special_tokens=False)
                        + [self.eos] for k in range(turns)}

    def __call__(self, request, prompt):
        tokens = self.replies.get(getattr(request, "user", None))
        if tokens is None:
            return []
        start = len(prompt)

        def write(history, logits):
            n = history.shape[0] - start
            target = tokens[n] if n < len(tokens) else self.eos
            return logits + mx.where(mx.arange(logits.shape[-1]) == target, SCRIPT_BIAS, 0.0)
        return [write]


def reply_text(k: int) -> str:
    return (f"The output of step {k} tells me what to run next.{cf.THINK_END}\n\n"
            f"{cf.CALLS_OPEN}\n{cf.INVOKE_OPEN} name=\"run\">\n{cf.PARAM_OPEN} name=\"cmd\" "
            f"string=\"true\">ls -la src/part{k}{cf.PARAM_CLOSE}\n{cf.INVOKE_CLOSE}\n"
            f"{cf.CALLS_CLOSE}")


def serve(model, tokenizer, turns: int):
    engine = BatchEngine(model, tokenizer, PromptCacheStore(model, 1 << 30))
    app = create_app(engine, ServerConfig(model_id="bench"), Scripts(tokenizer, turns))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.02)
    return server, f"http://127.0.0.1:{sock.getsockname()[1]}"


def chat_loop(url: str, system: str, result: str, turns: int) -> list:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": "Explore the repository."}]
    out = []
    for k in range(turns):
        reply = client.chat.completions.create(
            model="bench", messages=messages, tools=[{"type": "function", "function": TOOL}],
            max_tokens=300, user=f"turn-{k}", reasoning_effort="high")
        message, usage = reply.choices[0].message, reply.usage
        out.append((usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens,
                    usage.completion_tokens))
        messages += [{"role": "assistant", "content": message.content,
                      "reasoning_content": message.reasoning_content,
                      "tool_calls": [c.model_dump() for c in message.tool_calls]},
                     {"role": "tool", "tool_call_id": message.tool_calls[0].id,
                      "content": result}]
    return out


def messages_loop(url: str, system: str, result: str, turns: int) -> list:
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    tools = [{"name": TOOL["name"], "description": TOOL["description"],
              "input_schema": TOOL["parameters"]}]
    messages, out = [{"role": "user", "content": "Explore the repository."}], []
    for k in range(turns):
        reply = client.messages.create(model="bench", max_tokens=300, system=system,
                                       messages=messages, tools=tools,
                                       metadata={"user_id": f"turn-{k}"},
                                       thinking={"type": "enabled", "budget_tokens": 250})
        usage = reply.usage
        out.append((usage.input_tokens + usage.cache_read_input_tokens,
                    usage.cache_read_input_tokens, usage.output_tokens))
        use = next(b for b in reply.content if b.type == "tool_use")
        messages += [{"role": "assistant",
                      "content": [b.model_dump(exclude_none=True) for b in reply.content]},
                     {"role": "user", "content": [{"type": "tool_result",
                                                   "tool_use_id": use.id, "content": result}]}]
    return out


def responses_loop(url: str, system: str, result: str, turns: int) -> list:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    turn_input: list = [{"role": "user", "content": "Explore the repository."}]
    previous, out = None, []
    for k in range(turns):
        reply = client.responses.create(model="bench", instructions=system, input=turn_input,
                                        tools=[{"type": "function", **TOOL}],
                                        max_output_tokens=300, user=f"turn-{k}",
                                        reasoning={"effort": "high"},
                                        previous_response_id=previous)
        usage = reply.usage
        out.append((usage.input_tokens, usage.input_tokens_details.cached_tokens,
                    usage.output_tokens))
        call = next(item for item in reply.output if item.type == "function_call")
        previous = reply.id
        turn_input = [{"type": "function_call_output", "call_id": call.call_id,
                       "output": result}]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(CHECKPOINT))
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system-chars", type=int, default=2000)
    parser.add_argument("--result-chars", type=int, default=300)
    args = parser.parse_args()
    model, tokenizer = mlx_v41.load(args.model)
    server, url = serve(model, tokenizer, args.turns)
    system = ("You are a coding agent working in a repository. " * 200)[:args.system_chars]
    result = ("drwxr-xr-x  src/module.py  1234 bytes\n" * 50)[:args.result_chars]
    try:
        for name, loop in (("chat completions", chat_loop), ("Anthropic Messages",
                                                             messages_loop),
                           ("Responses + previous_response_id", responses_loop)):
            # each API starts cold: its own system prompt (they render the same prompts)
            rows = loop(url, f"[{name}] {system}", result, args.turns)
            print(f"\n{name}")
            print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'new':>5} {'hit':>7}  rule")
            for k, (prompt, cached, reply) in enumerate(rows):
                new = prompt - (rows[k - 1][0] + rows[k - 1][2]) if k else prompt
                rule = "-" if k == 0 else \
                    ("ok" if cached == rows[k - 1][0] + rows[k - 1][2] else "MISS")
                print(f"{k + 1:>4} {prompt:>7} {cached:>7} {new:>5} {cached / prompt:>7.1%}  "
                      f"{rule}")
    finally:
        server.should_exit = True


if __name__ == "__main__":
    main()
