"""DSpark speculative decoding against plain greedy decoding, on one checkpoint in one run.

(a) The verify forward: one target forward of k + 1 rows (then trimmed back) against a
single-row decode step, k = 1..5, and one draft pass against the same step.
(b) Plain against speculative tokens/s with the checkpoint's own drafter: on the golden's
random mtp.* weights almost nothing is accepted, so this measures the overhead (k = 5, also
with draft_confidence 0.5, which cuts a block where the drafter's survival drops below it).
(c) An oracle drafter that proposes the target's own greedy continuation (precomputed by a
plain run of the same prompt and length): every draft is accepted, the upper bound at k = 5.
Greedy throughout; every speculative stream is asserted equal to the plain one. Each mode is
warmed up, then the modes are timed in turn within every repeat (so load from other processes
falls on all alike) and the median of --repeats is reported; prefill is not timed.

    python benchmarks/bench_dspark.py [--model PATH --prompt 64 --tokens 48 --repeats 3 --rounds 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout too
import mlx_v41  # noqa: E402
from mlx_v41.cache.layer import trim_cache  # noqa: E402
from mlx_v41.generation.api import generate_step, prefill  # noqa: E402
from mlx_v41.generation.speculative import DraftStats, Sampling, speculative_steps  # noqa: E402

CHECKPOINT = ROOT / "tests/data/goldens/schedule/hf"
DRAFTS = 5  # the drafter's block: the anchor and 5 proposals
SURE = 1e4  # an oracle confidence logit: sigmoid(SURE) == 1 in fp32


class OracleDrafter:
    """`DSpark.draft`'s signature, proposing the 5 tokens that follow the anchor in a known
    greedy stream, with logits that put all mass on them and full confidence."""

    def __init__(self, stream: list, start: int, vocab: int):
        self.stream, self.start, self.vocab = stream, start, vocab

    def draft(self, embed, lm_head, anchor, rings, sample=None):
        i = rings[0].offset - self.start  # the anchor's index in the stream
        assert anchor.item() == self.stream[i], "the oracle's stream is not the target's"
        following = (self.stream[i + 1:i + 1 + DRAFTS] + [0] * DRAFTS)[:DRAFTS]
        tokens = mx.array([[anchor.item()] + following], dtype=mx.int32)
        hot = mx.arange(self.vocab)[None] == tokens[0, 1:, None]              # [5, V]
        logits = mx.where(hot, 0.0, -1e9).astype(mx.float32)[None]
        return tokens, logits, mx.full((1, DRAFTS), SURE, dtype=mx.float32)


def fresh(model, prompt: list) -> tuple:
    """A new cache holding the prompt, and the prompt's last logits."""
    cache = model.make_cache()
    return prefill(model, prompt, cache), cache


def eval_step(logits, cache) -> None:
    mx.eval(logits, [c.state for c in cache])


def forward_seconds(model, prompt: list, rounds: int) -> dict:
    """rows -> median seconds of one forward of that many rows at the prompt's end, trimmed
    back each time (the trim evaluated outside the timing); row counts 1..6 take turns within
    each round so that load from other processes falls on all alike."""
    _, cache = fresh(model, prompt)
    rng = np.random.default_rng(1)
    ids = {rows: mx.array(rng.integers(3, model.cfg.vocab_size, (1, rows)), dtype=mx.int32)
           for rows in range(1, DRAFTS + 2)}
    times = {rows: [] for rows in ids}
    for _ in range(rounds + 1):  # the first round warms each shape up
        for rows, x in ids.items():
            tic = time.perf_counter()
            eval_step(model(x, cache=cache), cache)
            times[rows].append(time.perf_counter() - tic)
            trim_cache(cache, rows)
            eval_step([], cache)
    return {rows: statistics.median(t[1:]) for rows, t in times.items()}


def draft_seconds(model, prompt: list, rounds: int) -> float:
    """Median seconds of one draft pass of the checkpoint's drafter after the prompt."""
    _, cache = fresh(model, prompt)
    rings = cache[model.cfg.num_hidden_layers:]
    anchor = mx.array([prompt[-1]], dtype=mx.int32)
    times = []
    for _ in range(rounds + 1):
        tic = time.perf_counter()
        mx.eval(model.dspark.draft(model.model.embed_tokens, model.lm_head.weight, anchor, rings))
        times.append(time.perf_counter() - tic)
    return statistics.median(times[1:])


def verify_costs(model, prompt: list, rounds: int) -> None:
    """(a): a verify forward of k + 1 rows and a draft pass, each against one decode step."""
    seconds = forward_seconds(model, prompt, rounds)
    step = seconds[1]
    print(f"(a) single-row decode step: {1e3 * step:.1f} ms (median of {rounds} rounds)")
    for k in range(1, DRAFTS + 1):
        rows = seconds[k + 1]
        print(f"    verify forward, k = {k} ({k + 1} rows): {1e3 * rows:6.1f} ms = "
              f"{rows / step:.2f}x a decode step")
    drafting = draft_seconds(model, prompt, rounds)
    print(f"    draft pass (5 proposals): {1e3 * drafting:6.1f} ms = "
          f"{drafting / step:.2f}x a decode step", flush=True)


class Mode:
    """One way to generate --tokens tokens after the prompt: its timings and last stream."""

    def __init__(self, name: str, **draft):
        self.name, self.draft, self.seconds = name, draft, []
        self.stream, self.stats = [], DraftStats()

    def run(self, model, prompt: list, tokens: int, record: bool = True) -> list:
        logits, cache = fresh(model, prompt)
        stats = DraftStats()
        tic = time.perf_counter()
        if self.draft:
            steps = speculative_steps(model, logits, cache, sampling=Sampling(),
                                      max_tokens=tokens, stats=stats, **self.draft)
            stream = [token for token, _, _ in steps]
        else:
            stream = [token for token, _ in generate_step(model, logits, cache,
                                                          max_tokens=tokens)]
        if record:
            self.seconds.append(time.perf_counter() - tic)
            self.stream, self.stats = stream, stats
        return stream


def report(modes: list, tokens: int) -> None:
    plain = tokens / statistics.median(modes[0].seconds)
    for mode in modes:
        rate, stats = tokens / statistics.median(mode.seconds), mode.stats
        drafted = (f"acceptance {100 * stats.accepted / max(stats.proposed, 1):5.1f} % "
                   f"({stats.accepted}/{stats.proposed}), {stats.tokens_per_cycle:.2f} "
                   f"tokens/cycle over {stats.cycles} cycles" if mode.draft else
                   "acceptance    -, 1.00 tokens/step")
        print(f"{mode.name:38s} {rate:6.2f} tok/s = {rate / plain:.2f}x plain   {drafted}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=CHECKPOINT,
                        help="checkpoint folder with the mtp.* drafter (default: the schedule "
                             "golden, random weights)")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    parser.add_argument("--tokens", type=int, default=48, help="tokens generated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=8,
                        help="timed forwards per row count in (a)")
    args = parser.parse_args()
    model = mlx_v41.load_model(args.model, dspark=True)
    vocab = model.cfg.vocab_size
    prompt = np.random.default_rng(0).integers(3, vocab, args.prompt).tolist()
    print(f"{args.model}: prompt {args.prompt}, {args.tokens} tokens, greedy, median of "
          f"{args.repeats}; mlx {mx.__version__}, device {mx.default_device()}", flush=True)
    verify_costs(model, prompt, args.rounds)

    plain = Mode("plain generate_step")
    greedy = plain.run(model, prompt, args.tokens, record=False)  # warm-up and oracle stream
    oracle = OracleDrafter(greedy, args.prompt, vocab)
    modes = [plain,
             Mode("(b) DSpark drafter, k = 5", num_draft_tokens=5),
             Mode("(b) DSpark drafter, k = 5, conf 0.5", num_draft_tokens=5,
                  draft_confidence=0.5),
             Mode("(c) oracle drafter, k = 5", num_draft_tokens=5, drafter=oracle)]
    for mode in modes[1:]:
        mode.run(model, prompt, min(args.tokens, 8), record=False)  # warm-up
    for repeat in range(args.repeats):
        for mode in modes:
            mode.run(model, prompt, args.tokens)
            print(f"  repeat {repeat + 1} {mode.name:38s} {mode.seconds[-1]:6.2f} s", flush=True)
    report(modes, args.tokens)
    for mode in modes[1:]:
        assert mode.stream == greedy, f"{mode.name}: stream differs from plain greedy decoding"
    print(f"greedy exactness: all {len(modes) - 1} speculative streams equal the plain one "
          f"({args.tokens} tokens)")


if __name__ == "__main__":
    main()
