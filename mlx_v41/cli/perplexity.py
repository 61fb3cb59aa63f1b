"""`mlx_v41.perplexity`: perplexity over a local corpus, in mlx-lm's flags and output.

    mlx_v41.perplexity --model path/to/DeepSeek-V4.1-Flash --data-path corpus.jsonl
    mlx_v41.perplexity --model path/to/converted --data-path book.txt --index-topk 256
    mlx_v41.perplexity --model demo --data-path notes.txt --sequence-length 64 --num-samples 4

A `.jsonl` file gives one document per line (its "text" field); any other file is one text.
"""

from __future__ import annotations

import sys

import mlx.core as mx

from ..checkpoint.source import DEMO, load
from ..generation.api import DEFAULT_PREFILL_STEP_SIZE
from ..generation.perplexity import evaluate_perplexity, make_sequences, read_documents
from ..model.layers import HEAD_DTYPES
from ..model.model import PREFILL_MODES
from .args import (HEAD_DTYPE_HELP, PREFILL_MODE_HELP, ArgumentParser, _number, run_command,
                   add_expert_arguments, add_override_arguments,
                   expert_stats_line, load_options, model_overrides, report_experts)

# mlx-lm's defaults (mlx_lm.perplexity).
DEFAULT_BATCH_SIZE = 8
DEFAULT_SEQUENCE_LENGTH = 512
DEFAULT_NUM_SAMPLES = 256
DEFAULT_SEED = 123


def setup_arg_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="mlx_v41.perplexity",
                            description="Perplexity of DeepSeek V4.1 Flash over a local corpus.")
    add, positive = parser.add_argument, _number(int, 1, what="a positive integer")
    add("--model", required=True, help="model folder (published layout or converted), Hugging "
        "Face repo id, or 'demo'")
    add("--data-path", required=True,
        help="a local UTF-8 file: .jsonl (a \"text\" field per line) or plain text")
    add("--sequence-length", type=_number(int, 2, what="an integer >= 2"),
        default=DEFAULT_SEQUENCE_LENGTH,
        help=f"tokens per sequence (default {DEFAULT_SEQUENCE_LENGTH})")
    add("--num-samples", type=_number(int, -1, what="a positive integer or -1"),
        default=DEFAULT_NUM_SAMPLES,
        help=f"sequences to score, -1 for all the data gives (default {DEFAULT_NUM_SAMPLES})")
    add("--batch-size", type=positive, default=DEFAULT_BATCH_SIZE,
        help=f"sequences per forward (default {DEFAULT_BATCH_SIZE})")
    add("--seed", type=_number(int, 0, what="an integer >= 0"), default=DEFAULT_SEED,
        help=f"seed of the documents' order (default {DEFAULT_SEED})")
    add("--context-length", type=_number(int, 0, what="an integer >= 0"), default=0,
        help="tokens of each sequence prefilled as a prompt with --prefill-mode and not "
             "scored; the rest is scored continuing its cache (default 0: every token, "
             "from one exact forward)")
    add("--prefill-mode", choices=PREFILL_MODES, default="ced",
        help=PREFILL_MODE_HELP + " (applies to the --context-length prompt)")
    add("--prefill-step-size", type=positive, default=DEFAULT_PREFILL_STEP_SIZE,
        help=f"rows per forward chunk (default {DEFAULT_PREFILL_STEP_SIZE})")
    add("--head-dtype", choices=HEAD_DTYPES, default="float32", help=HEAD_DTYPE_HELP)
    add_override_arguments(parser)
    add_expert_arguments(parser)
    return parser


def _check_args(parser, args) -> None:
    if args.num_samples == 0:
        parser.error("argument --num-samples: 0 is not a positive integer or -1")
    if args.context_length >= args.sequence_length:
        parser.error(f"argument --context-length: {args.context_length} leaves nothing to "
                     f"score in sequences of {args.sequence_length} tokens")


def run(args) -> int:
    documents = read_documents(args.data_path)  # a bad file is refused before the model loads
    print(f"Loading model from {args.model}...", file=sys.stderr)
    if args.model == DEMO:
        print("demo model: a tiny random checkpoint, so its perplexity is near the vocabulary "
              "size", file=sys.stderr)
    model, tokenizer = load(args.model, prefill_mode=args.prefill_mode, dspark=False,
                            vision=False, head_dtype=args.head_dtype, **load_options(args))
    report_experts(model)
    data = make_sequences(tokenizer, documents, args.sequence_length,
                          args.num_samples, args.seed, args.data_path)
    print(f"Loaded {data.shape[0]} samples of {data.shape[1]} tokens from {args.data_path}",
          file=sys.stderr)
    result = evaluate_perplexity(model, data, args.batch_size, args.context_length,
                                 args.prefill_step_size, _progress)
    print(file=sys.stderr)
    print(f"Model: {args.model}")
    settings = {"prefill_mode": model.prefill_mode, "context_length": args.context_length,
                **{k: getattr(model.cfg, k) for k in model_overrides(args) or {}}}
    print("Settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    print(f"Perplexity: {result.perplexity:.3f} ± {result.standard_error:.3f}")
    print(f"Mean loss: {result.mean_loss:.4f} nats over {result.tokens} tokens")
    print(f"Evaluation time: {result.seconds:.2f} seconds")
    print(f"Tokens per second: {result.tokens_per_second:.1f}")
    print(f"Peak memory: {mx.get_peak_memory() / 1e9:.3f} GB")
    if expert_stats_line(model):
        print(expert_stats_line(model))
    return 0


def _progress(done: int, total: int) -> None:
    print(f"  Processed {done}/{total} batches...", end="\r", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    return run_command(run, args)  # DataError, CheckpointError, ConfigError: one line


if __name__ == "__main__":
    sys.exit(main())
