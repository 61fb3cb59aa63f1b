"""What does each conversion recipe cost in quality against the official recipe (the published
FP8 / FP4 precision)? Converts the checkpoint with each recipe (into --work-dir, reused when
already there) and compares it with the published folder on a text file (docs/quality.md).

    python examples/recipe_ladder.py path/to/DeepSeek-V4.1-Flash book.txt --work-dir /Volumes/x
    python examples/recipe_ladder.py HF FILE --recipes mixed_4_8 mixed_3_8 mixed_2_8
"""

import argparse
import gc
import math
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

import mlx_v41
from mlx_v41.convert import convert
from mlx_v41.generation.compare import compare, record_reference
from mlx_v41.generation.perplexity import make_sequences, read_documents

# recipe -> convert() keywords (docs/convert.md#recipes)
RECIPES = {"mxfp8": dict(quantize=True, q_mode="mxfp8"), "affine8": dict(quantize=True, q_bits=8),
           **{f"mixed_{b}_8": dict(quant_predicate=f"mixed_{b}_8") for b in (4, 3, 2)}}
parser = argparse.ArgumentParser()
parser.add_argument("hf_path")
parser.add_argument("data_path")
parser.add_argument("--recipes", nargs="+", choices=RECIPES, default=["mixed_4_8", "mixed_3_8",
                                                                       "mixed_2_8"])
parser.add_argument("--work-dir", default=None)
parser.add_argument("--sequence-length", type=int, default=2048)
parser.add_argument("--num-samples", type=int, default=8)
parser.add_argument("--prompts", type=int, default=4)
parser.add_argument("--max-tokens", type=int, default=64)
parser.add_argument("--kl-top-k", type=int, default=128)  # 0: exact KL
args = parser.parse_args()
work = Path(args.work_dir or tempfile.mkdtemp(prefix="recipe_ladder_"))


def load(path):
    return mlx_v41.load(str(path), dspark=False, vision=False)


def step(text):  # progress on stderr, so stdout holds only the table
    print(f"[{time.perf_counter() - START:6.0f} s] {text}", file=sys.stderr, flush=True)


START = time.perf_counter()
step(f"loading the reference {args.hf_path}")
model, tokenizer = load(args.hf_path)
data = make_sequences(tokenizer, read_documents(args.data_path), args.sequence_length,
                      args.num_samples, source=args.data_path)
prompts = [row[:data.shape[1] // 2].tolist() for row in data[:args.prompts]]
step(f"reference pass: {data.shape[0]} x {data.shape[1]} tokens, {len(prompts)} prompts")
record = record_reference(model, data, batch_size=1, kl_top_k=args.kl_top_k, prompts=prompts,
                          max_tokens=args.max_tokens)
del model
print(f"{data.shape[0]} x {data.shape[1]} tokens of {args.data_path}; reference: the official "
      f"recipe; KL {'exact' if record.is_exact else 'over its top-k + tail'}\n")
print("| recipe | KL mean | top-1 | KL p99 | perplexity (official {:.3f}) | weights GB | decode "
      "tok/s | greedy prefix |\n|---|---|---|---|---|---|---|---|".format(
          math.exp(-record.target_logprob.astype(float).mean())))
for number, recipe in enumerate(args.recipes, 1):
    folder = work / recipe
    if not folder.is_dir():
        step(f"{recipe} ({number}/{len(args.recipes)}): converting into {folder}")
        convert(args.hf_path, folder, drop_vision=True, drop_dspark=True, progress=False,
                log=lambda line: None, **RECIPES[recipe])
    gc.collect()
    mx.clear_cache()
    step(f"{recipe} ({number}/{len(args.recipes)}): comparing with the reference")
    r = compare(load(folder)[0], record, batch_size=1)
    size = sum(f.stat().st_size for f in folder.glob("model-*.safetensors")) / 1e9
    print(f"| {recipe} | {r.kl_mean:.6f} | {r.top1_agreement:.4f} | {r.kl_p99:.6f} "
          f"| {r.perplexity:.3f} | {size:.3g} | {r.speed['decode_tps']:.2f} "
          f"| {r.mean_first_difference:.1f} / {r.max_tokens} |", flush=True)
