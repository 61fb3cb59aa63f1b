"""The layer schedule, the cache bytes the config implies, and the bytes a real cache holds.

    python examples/inspect_cache.py [model]
"""

import sys

import mlx.core as mx

import mlx_v41
from mlx_v41.cli.inspect import global_bytes_per_token, report

model, tokenizer = mlx_v41.load(sys.argv[1] if len(sys.argv) > 1 else "demo")
print(report(model.args, context=4096, memory=None))  # what `mlx_v41.inspect` prints

prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hello " * 40}])
cache = model.make_cache()
model.prefill(mx.array([prompt]), cache)
sizes = mlx_v41.cache_bytes(cache)
print(f"\nafter a {len(prompt)}-token prompt:")
for part in ("global_kv", "window", "other", "total"):
    print(f"  {part:>9}: {sizes[part]:>9,} bytes")
per_token = global_bytes_per_token(model.args.text_config)
print(f"  the config predicts {per_token:g} global-KV bytes per token: "
      f"{per_token * len(prompt):,.0f} bytes for this prompt")
