"""One generation with the Python API, in mlx-lm's conventions.

    python examples/generate.py                 # the demo checkpoint (random text)
    python examples/generate.py path/to/DeepSeek-V4.1-Flash
"""

import sys

from mlx_lm.sample_utils import make_sampler

import mlx_v41

model, tokenizer = mlx_v41.load(sys.argv[1] if len(sys.argv) > 1 else "demo")
messages = [{"role": "user", "content": "Write a haiku about the sea."}]
# The V4.1 chat format; enable_thinking=True would let the model reason first.
prompt = tokenizer.apply_chat_template(messages, tokenize=False, enable_thinking=False)

response = None
for response in mlx_v41.stream_generate(model, tokenizer, prompt, max_tokens=32,
                                        sampler=make_sampler(temp=0.7, top_p=0.95)):
    print(response.text, end="", flush=True)
print()
print(f"prompt {response.prompt_tokens} tokens at {response.prompt_tps:.1f} tokens/s; "
      f"{response.generation_tokens} generated at {response.generation_tps:.1f} tokens/s; "
      f"peak memory {response.peak_memory:.3f} GB; stopped on {response.finish_reason}")
