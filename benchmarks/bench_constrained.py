"""Grammar-constrained decoding's cost: the llguidance mask per token against a decode step, in
one run.

(a) Decode --tokens greedy tokens of the tiny golden checkpoint (vocabulary 512) after a chat
prompt: plain, under a JSON-schema answer grammar, and under a forced DSML tool-call grammar
whose parameter is the same JSON. The schema is an array of --tokens objects at least, so no
reply can finish early: every step computes a mask. Each mode is warmed up, the modes are timed
in turn within every repeat (load from other processes falls on all alike), prefill is not
timed; the median of --repeats is reported as ms/token and the ratio to plain.
(b) The mask alone: `GrammarProcessor` calls on one fixed logits row along the JSON reply of
(a) (consume the new token, compute the mask, apply it), and llguidance's `compute_bitmask`
alone, in µs per token.
(c) A 128k vocabulary: a synthetic byte-level BPE built with the `tokenizers` library (--vocab
entries: the 256 byte symbols, then merges of an existing token and a byte symbol, mostly
ASCII letters, digits, JSON punctuation and the space mark, up to 12 symbols long), wrapped
as a fast Hugging Face tokenizer: llguidance's tokenizer build time, then (b) on it along a
JSON text that tokenizer encodes. A synthetic vocabulary, not a trained one: the mask's cost
depends on how many tokens fit each state, so real vocabularies may differ.

    python benchmarks/bench_constrained.py [--tokens 64 --repeats 3 --vocab 128000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout too
import mlx_v41  # noqa: E402
from mlx_v41.chat.grammar import reply_grammar  # noqa: E402
from mlx_v41.generation.api import generate_step, prefill  # noqa: E402
from mlx_v41.generation.constrained import Constraint, grammar_tokenizer  # noqa: E402

CHECKPOINT = ROOT / "tests" / "data" / "goldens" / "tiny" / "hf"
ROW = {"type": "object", "additionalProperties": False, "required": ["id", "ok", "tag"],
       "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                      "ok": {"type": "boolean"}, "tag": {"enum": ["red", "green", "blue"]}}}


def rows_schema(n: int) -> dict:
    """An object holding an array of at least `n` rows: longer than `n` tokens."""
    return {"type": "object", "additionalProperties": False, "required": ["rows"],
            "properties": {"rows": {"type": "array", "items": ROW, "minItems": n}}}


class Mode:
    """One way to decode --tokens tokens after the prompt: its timings and last reply."""

    def __init__(self, name: str, constraint=None):
        self.name, self.constraint, self.seconds, self.reply = name, constraint, [], []

    def run(self, model, prompt: list, tokens: int, record: bool = True) -> None:
        cache = model.make_cache()
        logits = prefill(model, prompt, cache)
        processor = None if self.constraint is None else self.constraint.processor()
        tic = time.perf_counter()
        steps = generate_step(model, logits, cache, tokens=prompt, max_tokens=tokens,
                              logits_processors=None if processor is None else [processor])
        reply = [token for token, _ in steps]
        if record:
            self.seconds.append(time.perf_counter() - tic)
            self.reply = reply
        if processor is not None:  # every step was masked (the first row too)
            assert processor.masks == tokens + 1, (self.name, processor.masks)


def decode_costs(model, tokenizer, args) -> tuple:
    """(a); returns the prompt, the JSON mode's constraint and its reply."""
    prompt = tokenizer.encode_chat([{"role": "user", "content": "hi"}], thinking=False)
    schema = rows_schema(args.tokens)
    stops = tokenizer.eos_token_ids
    tool = {"name": "put", "parameters": {"type": "object", "properties": {"rows": schema},
                                          "required": ["rows"]}}
    modes = [Mode("plain"),
             Mode("JSON schema", Constraint(reply_grammar(
                 tokenizer, tools=[], forced=False, may_call=False, answer=schema), tokenizer,
                 stop_tokens=stops)),
             Mode("tool call (JSON parameter)", Constraint(reply_grammar(
                 tokenizer, tools=[tool], forced=True, may_call=False, answer=None),
                 tokenizer, stop_tokens=stops))]
    for mode in modes:
        mode.run(model, prompt, min(args.tokens, 8), record=False)  # warm-up
    for repeat in range(args.repeats):
        for mode in modes:
            mode.run(model, prompt, args.tokens)
            print(f"  repeat {repeat + 1} {mode.name:28s} {mode.seconds[-1]:6.3f} s", flush=True)
    plain = statistics.median(modes[0].seconds) / args.tokens
    print(f"\n(a) decode, {args.tokens} tokens, median of {args.repeats}")
    print(f"{'mode':28s} {'ms/token':>9s} {'x plain':>8s}")
    for mode in modes:
        per = statistics.median(mode.seconds) / args.tokens
        print(f"{mode.name:28s} {1e3 * per:9.2f} {per / plain:8.2f}")
    print(f"JSON reply starts: {tokenizer.decode(modes[1].reply)[:60]!r}")
    return prompt, modes[1].constraint, modes[1].reply


def mask_costs(constraint, prompt: list, reply: list, vocab: int, rounds: int) -> tuple:
    """(b): µs per token of processor calls along `reply` and of compute_bitmask alone."""
    from llguidance import LLMatcher

    logits = mx.random.normal((1, vocab))
    mx.eval(logits)
    calls = []
    for _ in range(rounds):
        processor = constraint.processor()
        mx.eval(processor(mx.array(prompt), logits))
        histories = [mx.array(prompt + reply[:n + 1]) for n in range(len(reply))]
        tic = time.perf_counter()
        for history in histories:
            mx.eval(processor(history, logits))
        calls.append((time.perf_counter() - tic) / len(reply))
    masks = []
    for _ in range(rounds):
        matcher = LLMatcher(constraint.ll_tokenizer, constraint.grammar, log_level=0)
        spent = 0.0
        for token in reply:
            tic = time.perf_counter()
            matcher.compute_bitmask()
            spent += time.perf_counter() - tic
            assert matcher.consume_token(token), "the reply left the grammar"
        masks.append(spent / len(reply))
    return 1e6 * statistics.median(calls), 1e6 * statistics.median(masks)


def synthetic_bpe(size: int, seed: int = 0):
    """A fast Hugging Face byte-level BPE tokenizer of `size` entries (plus an EOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    common = [c for c in alphabet if c.isalnum() and c.isascii()] + list('":,{}[]') \
        + ["Ġ"] * 8
    rng = np.random.default_rng(seed)
    vocab = {c: i for i, c in enumerate(alphabet)}
    pieces, merges = list(alphabet), []
    while len(vocab) < size:
        base = pieces[int(len(pieces) * rng.random() ** 2)]  # favour the older, shorter ones
        extra = common[rng.integers(len(common))] if rng.random() < 0.85 \
            else alphabet[rng.integers(len(alphabet))]
        token = base + extra
        if token in vocab or len(token) > 12:
            continue
        vocab[token] = len(vocab)
        pieces.append(token)
        merges.append((base, extra))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")
    hf.add_special_tokens({"eos_token": "<eos>"})
    return hf


def large_vocabulary(args) -> None:
    """(c)."""
    tic = time.perf_counter()
    hf = synthetic_bpe(args.vocab)
    made = time.perf_counter() - tic
    tic = time.perf_counter()
    grammar_tokenizer(hf)
    built = time.perf_counter() - tic
    schema = rows_schema(1)
    text = json.dumps({"rows": [{"id": i * 37 % 1000, "ok": i % 3 == 0,
                                 "tag": ["red", "green", "blue"][i % 3]} for i in range(12)]})
    reply = hf.encode(text, add_special_tokens=False)
    constraint = Constraint(reply_grammar(hf, tools=[], forced=False, may_call=False,
                                          answer=schema), hf)
    calls, masks = mask_costs(constraint, [0], reply, len(hf), args.rounds)
    print(f"\n(c) synthetic byte-level BPE, {len(hf)} entries (built in {made:.1f} s)")
    print(f"llguidance tokenizer build: {1e3 * built:.0f} ms")
    print(f"mask along a {len(reply)}-token JSON reply: processor call {calls:.0f} µs/token, "
          f"compute_bitmask alone {masks:.0f} µs/token")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=CHECKPOINT,
                        help="checkpoint folder (default: the tiny golden, random weights)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens decoded per mode")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5,
                        help="passes along the reply for the mask timings (median)")
    parser.add_argument("--vocab", type=int, default=128000,
                        help="entries of the synthetic vocabulary in (c); 0 skips (c)")
    args = parser.parse_args()
    model, tokenizer = mlx_v41.load(args.model, dspark=False)
    print(f"{args.model}: vocabulary {model.cfg.vocab_size}; mlx {mx.__version__}, device "
          f"{mx.default_device()}", flush=True)
    prompt, constraint, reply = decode_costs(model, tokenizer, args)
    calls, masks = mask_costs(constraint, prompt, reply, model.cfg.vocab_size, args.rounds)
    print(f"\n(b) mask alone along the JSON reply ({len(reply)} tokens, median of "
          f"{args.rounds}): processor call {calls:.0f} µs/token, compute_bitmask alone "
          f"{masks:.0f} µs/token")
    if args.vocab:
        large_vocabulary(args)
    else:
        print("\n(c) skipped (--vocab 0)")


if __name__ == "__main__":
    main()
