"""`mlx_v41.compare`: how far a test setting is from a reference setting, on the same tokens.

    mlx_v41.compare --model path/to/converted-mixed_3_8 --reference path/to/converted-official \\
        --data-path corpus.jsonl
    mlx_v41.compare --model PATH --index-topk 128 --data-path book.txt      # against PATH as is
    mlx_v41.compare --model PATH --prefill-mode ced_replay --context-length 384 --data-path f.txt

The test takes --model and the plain flags; the reference takes --reference (default: --model)
and the --reference-* flags. The reference runs first and is freed before the test loads.
"""

from __future__ import annotations

import gc
import json
import sys

import mlx.core as mx
import numpy as np

from ..checkpoint.source import load, resolve_model_path
from ..generation.api import DEFAULT_PREFILL_STEP_SIZE
from ..generation.compare import (DEFAULT_KL_TOP_K, check_same_tokens, compare,
                                  record_reference)
from ..generation.perplexity import make_sequences, read_documents
from ..model.config import ModelArgs, with_overrides
from ..model.layers import HEAD_DTYPES
from ..model.model import PREFILL_MODES
from .args import (EXPERT_MEMORY_HELP, HEAD_DTYPE_HELP, PREFILL_MODE_HELP, ArgumentParser,
                   _number, expert_memory_value, report_experts, run_command)

DEFAULT_SEQUENCE_LENGTH = 512
DEFAULT_NUM_SAMPLES = 16
DEFAULT_BATCH_SIZE = 4
DEFAULT_SEED = 123
DEFAULT_PROMPTS = 4
DEFAULT_PROMPT_LENGTH = 128
DEFAULT_MAX_TOKENS = 64

# (flag suffix, load() keyword or overrides key, kind, help)
SETTINGS = (
    ("prefill-mode", "prefill_mode", dict(choices=PREFILL_MODES, default="ced"),
     PREFILL_MODE_HELP),
    ("head-dtype", "head_dtype", dict(choices=HEAD_DTYPES, default="float32"), HEAD_DTYPE_HELP),
    ("compat-reference-index-k-bug", "compat_reference_index_k_bug",
     dict(action="store_true"), "the official reference's decode-time index-key defect (D1)"),
    ("index-topk", "index_topk", dict(type=_number(int, 1, what="a positive integer")),
     "compressed rows each query attends (default: the checkpoint's)"),
    ("candidate-blocks", "candidate_topk_blocks",
     dict(type=_number(int, 1, what="a positive integer")),
     "blocks in the Reindex layers' candidate pool (default: the checkpoint's)"),
    ("sliding-window", "sliding_window", dict(type=_number(int, 1, what="a positive integer")),
     "window positions each query attends, at most the checkpoint's"),
    ("expert-memory", "expert_memory", dict(type=expert_memory_value, default="auto",
                                            metavar="SIZE"), EXPERT_MEMORY_HELP),
)
OVERRIDE_KEYS = ("index_topk", "candidate_topk_blocks", "sliding_window")


def setup_arg_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="mlx_v41.compare", description="Compare a test setting of "
                            "DeepSeek V4.1 Flash with a reference setting on the same tokens.")
    add = parser.add_argument
    positive = _number(int, 1, what="a positive integer")
    add("--model", required=True, help="the test model folder (or repo id, or 'demo')")
    add("--reference", default=None, help="the reference model folder (default: --model)")
    add("--data-path", required=True,
        help="a local UTF-8 file: .jsonl (a \"text\" field per line) or plain text")
    add("--sequence-length", type=_number(int, 3, what="an integer >= 3"),
        default=DEFAULT_SEQUENCE_LENGTH, help=f"tokens per sequence ({DEFAULT_SEQUENCE_LENGTH})")
    add("--num-samples", type=_number(int, -1, what="a positive integer or -1"),
        default=DEFAULT_NUM_SAMPLES, help=f"sequences, -1: all ({DEFAULT_NUM_SAMPLES})")
    add("--batch-size", type=positive, default=DEFAULT_BATCH_SIZE,
        help=f"sequences per forward ({DEFAULT_BATCH_SIZE})")
    add("--seed", type=_number(int, 0, what="an integer >= 0"), default=DEFAULT_SEED,
        help=f"seed of the documents' order ({DEFAULT_SEED})")
    add("--context-length", type=_number(int, 0, what="an integer >= 0"), default=0,
        help="tokens of each sequence prefilled with each side's --prefill-mode and not "
             "scored (default 0: every prediction from one exact forward)")
    add("--kl-top-k", type=_number(int, 0, what="an integer >= 0"), default=DEFAULT_KL_TOP_K,
        help=f"reference log-probabilities kept per position ({DEFAULT_KL_TOP_K}; the rest "
             "is one bucket); 0: the whole vocabulary, exact KL")
    add("--ladder-samples", type=_number(int, 0, what="an integer >= 0"), default=1,
        help="sequences whose residual streams enter the per-block ladder (1)")
    add("--prompts", type=_number(int, 0, what="an integer >= 0"), default=DEFAULT_PROMPTS,
        help=f"free-running prompts: the first tokens of the first sequences "
             f"({DEFAULT_PROMPTS})")
    add("--prompt-length", type=positive, default=DEFAULT_PROMPT_LENGTH,
        help=f"tokens per free-running prompt ({DEFAULT_PROMPT_LENGTH})")
    add("-m", "--max-tokens", type=positive, default=DEFAULT_MAX_TOKENS,
        help=f"greedy tokens per free-running prompt ({DEFAULT_MAX_TOKENS})")
    add("--prefill-step-size", type=positive, default=DEFAULT_PREFILL_STEP_SIZE,
        help=f"rows per forward chunk ({DEFAULT_PREFILL_STEP_SIZE})")
    add("--json", action="store_true", help="print one JSON object instead of the tables")
    for suffix, _, kind, text in SETTINGS:
        add(f"--{suffix}", help="test: " + text, **kind)
    for suffix, _, kind, text in SETTINGS:
        add(f"--reference-{suffix}", help="reference: " + text, **kind)
    return parser


def side_settings(args, prefix: str = "") -> dict:
    """`load` keywords of one side's flags (overrides in their own dict, None when none)."""
    values = {key: getattr(args, (prefix + suffix).replace("-", "_"))
              for suffix, key, _, _ in SETTINGS}
    overrides = {k: values.pop(k) for k in OVERRIDE_KEYS if values[k] is not None}
    for key in OVERRIDE_KEYS:
        values.pop(key, None)
    return {**values, "overrides": overrides or None}


def _check_args(parser, args) -> None:
    if args.num_samples == 0:
        parser.error("argument --num-samples: 0 is not a positive integer or -1")
    if args.context_length >= args.sequence_length - 1:
        parser.error(f"argument --context-length: {args.context_length} leaves fewer than two "
                     f"predictions to score in sequences of {args.sequence_length} tokens")
    if args.prompt_length > args.sequence_length and args.prompts:
        parser.error(f"argument --prompt-length: {args.prompt_length} exceeds "
                     f"--sequence-length {args.sequence_length}")


def check_side(label: str, path: str, settings: dict):
    """A side's folder (resolved once: a Hub id is looked up here, not again at its load),
    config and overrides, checked before any weights load (so a bad one is refused in a
    second, not after the reference pass)."""
    try:
        folder = resolve_model_path(path)
        with_overrides(ModelArgs.from_file(folder / "config.json"), settings["overrides"])
    except ValueError as e:
        raise ValueError(f"{label}: {e}") from None
    return folder


def _load(label: str, path: str, folder, settings: dict):
    print(f"Loading the {label} from {path}...", file=sys.stderr)
    try:
        model, tokenizer = load(folder, dspark=False, vision=False, **settings)
    except ValueError as e:
        raise ValueError(f"{label}: {e}") from None
    report_experts(model)
    return model, tokenizer


def _sequences(args, tokenizer, documents: list) -> np.ndarray:
    return np.array(make_sequences(tokenizer, documents, args.sequence_length,
                                   args.num_samples, args.seed, args.data_path))


def run(args) -> int:
    reference_path = args.reference or args.model
    documents = read_documents(args.data_path)
    reference_folder = check_side("reference", reference_path,
                                  side_settings(args, "reference-"))
    folder = check_side("test model", args.model, side_settings(args))
    model, tokenizer = _load("reference", reference_path, reference_folder,
                             side_settings(args, "reference-"))
    data = _sequences(args, tokenizer, documents)
    prompts = [row[:args.prompt_length].tolist() for row in data[:args.prompts]]
    print(f"Reference: {data.shape[0]} samples of {data.shape[1]} tokens", file=sys.stderr)
    record = record_reference(model, mx.array(data), context=args.context_length,
                              batch_size=args.batch_size, kl_top_k=args.kl_top_k,
                              ladder_samples=args.ladder_samples, prompts=prompts,
                              max_tokens=args.max_tokens, step_size=args.prefill_step_size)
    del model, tokenizer
    gc.collect()
    mx.clear_cache()
    model, tokenizer = _load("test model", args.model, folder, side_settings(args))
    check_same_tokens(_sequences(args, tokenizer, documents), data)
    result = compare(model, record, batch_size=args.batch_size,
                     step_size=args.prefill_step_size)
    out = {"model": args.model, "reference": reference_path,
           "settings": side_settings(args), "reference_settings": side_settings(args,
                                                                                 "reference-"),
           "context_length": args.context_length, "kl_top_k": args.kl_top_k,
           **result.as_dict()}
    print(json.dumps(out) if args.json else format_tables(out))
    return 0


def _changed(settings: dict) -> str:
    shown = {k: v for k, v in settings.items() if k == "prefill_mode" or
             (k == "head_dtype" and v != "float32") or (k == "overrides" and v) or
             (k == "compat_reference_index_k_bug" and v)}
    if shown.get("overrides"):
        shown.update(shown.pop("overrides"))
    return ", ".join(f"{k}={v}" for k, v in shown.items())


def format_tables(out: dict) -> str:
    """The result as text: the settings, the teacher-forced and free-running numbers, the
    ladder (markdown tables)."""
    kl = "exact (whole vocabulary)" if out["kl_exact"] else \
        f"top-{out['kl_top_k']} + tail bucket (a lower bound)"
    lines = [f"Test:      {out['model']} ({_changed(out['settings'])})",
             f"Reference: {out['reference']} ({_changed(out['reference_settings'])})",
             f"Context length: {out['context_length']}; KL: {kl}", "",
             "| teacher-forced, {} positions | value |".format(out["positions"]), "|---|---|",
             f"| KL(reference ‖ test) mean | {out['kl_mean']:.6f} |",
             f"| KL p99 | {out['kl_p99']:.6f} |",
             f"| KL max | {out['kl_max']:.6f} |",
             f"| top-1 agreement | {out['top1_agreement']:.4f} |",
             f"| Δ log p(reference's top-1) | {out['argmax_logprob_delta']:+.6f} |",
             f"| Δ log p(data's next token) | {out['target_logprob_delta']:+.6f} |",
             f"| perplexity test / reference | {out['perplexity']:.3f} / "
             f"{out['reference_perplexity']:.3f} |", ""]
    if out["first_difference"]:
        speed, ref = out["speed"], out["reference_speed"]
        lines += [f"| free-running, {len(out['first_difference'])} prompts, "
                  f"{out['max_tokens']} greedy tokens | value |", "|---|---|",
                  f"| tokens before the first difference | "
                  f"{' '.join(map(str, out['first_difference']))} |",
                  f"| mean / longest common prefix | {out['mean_first_difference']:.1f} / "
                  f"{out['longest_common_prefix']} |",
                  f"| prefill tok/s test / reference | {speed['prefill_tps']:.1f} / "
                  f"{ref['prefill_tps']:.1f} |",
                  f"| decode tok/s test / reference | {speed['decode_tps']:.2f} / "
                  f"{ref['decode_tps']:.2f} |", ""]
    if out["ladder"]:
        lines += ["| block (stream entering it) | relative RMS | cosine |", "|---|---|---|"]
        lines += [f"| {r['layer']} | {r['relative_rms']:.6f} | {r['cosine']:.6f} |"
                  for r in out["ladder"]]
    return "\n".join(lines).rstrip()


def main(argv=None) -> int:
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    return run_command(run, args)  # DataError, CompareError, CheckpointError: one line


if __name__ == "__main__":
    sys.exit(main())
