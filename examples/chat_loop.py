"""A multi-turn chat that keeps one prompt cache: each turn renders only its new messages
(`context=` the earlier ones, so no second BOS) and prefills only those tokens.

    python examples/chat_loop.py [model] ["first question" "second question" ...]
"""

import sys

import mlx_v41
from mlx_v41.chat.format import EOS, IMAGE_PLACEHOLDER, encode_messages

model, tokenizer = mlx_v41.load(sys.argv[1] if len(sys.argv) > 1 else "demo")
questions = sys.argv[2:] or ["Hello! Who are you?", "What did I just ask?"]

cache = model.make_cache()  # every token so far: stream_generate feeds each token it yields
history, closing = [], ""
for question in questions:
    new = [{"role": "user", "content": question}]
    # A reply cut at max_tokens has no EOS in the cache yet: close it before the new turn.
    prompt = closing + encode_messages(new, thinking_mode="chat", context=history)
    print(f">> {question}")
    reply = ""
    for response in mlx_v41.stream_generate(model, tokenizer, prompt, max_tokens=24,
                                            prompt_cache=cache):
        print(response.text, end="", flush=True)
        reply += response.text
    print(f"\n[{response.prompt_tokens} new prompt tokens, cache at {cache[0].offset}]")
    closing = "" if response.finish_reason == "stop" else EOS
    # The renderer refuses an image placeholder in a reply (random demo text may hold one).
    history += new + [{"role": "assistant", "content": reply.replace(IMAGE_PLACEHOLDER, "")}]
