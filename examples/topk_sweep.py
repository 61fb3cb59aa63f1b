"""How much does a smaller index top-k cost in quality, and what does it buy in speed? Each
`index_topk` against the baseline (the checkpoint's 512) on a text file: teacher-forced KL and
top-1 agreement, perplexity, greedy prefix, prefill and decode speed (docs/quality.md).

    python examples/topk_sweep.py path/to/DeepSeek-V4.1-Flash book.txt
    python examples/topk_sweep.py MODEL FILE --topks 64 128 256 512 --sequence-length 4096
"""

import argparse
import gc

import mlx.core as mx

import mlx_v41
from mlx_v41.generation.compare import compare, record_reference
from mlx_v41.generation.perplexity import make_sequences, read_documents

parser = argparse.ArgumentParser()
parser.add_argument("model")
parser.add_argument("data_path")
parser.add_argument("--topks", type=int, nargs="+", default=[64, 128, 256, 512])
parser.add_argument("--baseline", type=int, default=512)
parser.add_argument("--sequence-length", type=int, default=4096)
parser.add_argument("--num-samples", type=int, default=4)
parser.add_argument("--prompts", type=int, default=2)
parser.add_argument("--max-tokens", type=int, default=32)
parser.add_argument("--kl-top-k", type=int, default=128)  # 0: exact KL
args = parser.parse_args()


def load(topk):
    return mlx_v41.load(args.model, dspark=False, vision=False, overrides={"index_topk": topk})


model, tokenizer = load(args.baseline)
data = make_sequences(tokenizer, read_documents(args.data_path), args.sequence_length,
                      args.num_samples, source=args.data_path)
prompts = [row.tolist() for row in data[:args.prompts]]  # long prompts: top-k matters there
record = record_reference(model, data, batch_size=1, kl_top_k=args.kl_top_k, prompts=prompts,
                          max_tokens=args.max_tokens)
del model
print(f"{data.shape[0]} x {data.shape[1]} tokens of {args.data_path}; baseline index_topk "
      f"{args.baseline}; KL {'exact' if record.is_exact else 'over its top-k + tail'}\n")
print("| index_topk | KL mean | top-1 | KL p99 | perplexity | prefill tok/s | decode tok/s "
      "| greedy prefix |\n|---|---|---|---|---|---|---|---|")
for topk in args.topks:
    gc.collect()
    mx.clear_cache()
    r = compare(load(topk)[0], record, batch_size=1)
    print(f"| {topk} | {r.kl_mean:.6f} | {r.top1_agreement:.4f} | {r.kl_p99:.6f} "
          f"| {r.perplexity:.3f} | {r.speed['prefill_tps']:.1f} | {r.speed['decode_tps']:.2f} "
          f"| {r.mean_first_difference:.1f} / {r.max_tokens} |", flush=True)
