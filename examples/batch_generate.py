"""Several prompts of different lengths decoded together, each exactly as it would run alone;
then the incremental engine a server uses: a request joining while others decode.

    python examples/batch_generate.py                 # the demo checkpoint (random text)
    python examples/batch_generate.py path/to/DeepSeek-V4.1-Flash
"""

import sys

import mlx_v41

model, tokenizer = mlx_v41.load(sys.argv[1] if len(sys.argv) > 1 else "demo")
questions = ["Hi!", "Name three colours and say why you like each of them.", "2 + 2 = ?"]
prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                         enable_thinking=False) for q in questions]

result = mlx_v41.batch_generate(model, tokenizer, prompts, max_tokens=24)
for question, text in zip(questions, result.texts):
    print(f"{question!r} -> {text!r}")
stats = result.stats
print(f"{stats.generation_tokens} tokens at {stats.generation_tps:.1f} tokens/s in all; "
      f"peak memory {stats.peak_memory:.3f} GB")

# The engine: insert, step, and insert again while the first sequences decode.
engine = mlx_v41.BatchGenerator(model, stop_tokens=tokenizer.eos_token_ids, max_tokens=8)
ids = [tokenizer.encode_prompt(p) for p in prompts]
first = engine.insert(ids[:2])
steps = 0
while len(engine):
    if steps == 3:
        late, = engine.insert(ids[2:])
        print(f"step 3: sequence {late} joins {len(engine) - 1} running")
    for response in engine.next():
        if response.finish_reason is not None:
            print(f"step {steps}: sequence {response.uid} done ({response.finish_reason})")
    steps += 1
