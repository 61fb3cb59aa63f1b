"""Routed experts streamed from the model folder under a memory budget (`expert_memory`): the
logits are the resident model's bits at every budget, from one slot (every call in waves of one
expert) to all experts, for chunked CED prefill, decode, batches of mixed lengths, DSpark
verification, converted folders (official and 2-bit recipes); a damaged shard fails the call
with one line naming the file and tensor; `auto` chooses both ways; bad budgets get one line.
Bit equality holds on MLX's CPU backend (the `cpu` fixture)."""

from __future__ import annotations

import re
import shutil

import mlx.core as mx
import numpy as np
import pytest

import mlx_v41
from conftest import golden_checkpoint, reference_ops, writable_copy
from mlx_v41.checkpoint.loader import read_index
from mlx_v41.checkpoint.safetensors_io import SafetensorsFile
from mlx_v41.checkpoint.streaming import (KV_RESERVE_TOKENS, ExpertPlan, parse_memory_size,
                                          plan_experts)
from mlx_v41.model.memory import session_bytes
from mlx_v41.model.batch import batch_forward
from mlx_v41.model.expert_reader import ExpertReadError
from mlx_v41.model.expert_store import ExpertStats, StreamedSwitchMLP

pytestmark = pytest.mark.usefixtures("cpu")

STEP = 16  # prefill chunk: the 70-token prompt takes five
# The tiny golden's routed experts: 108 (its MoE modules' tables), one layout of this size.
EXPERT_BYTES = 13056
ALL_EXPERTS = 108


def load(path=None, **kwargs):
    return reference_ops(mlx_v41.load_model(path or golden_checkpoint("tiny"), **kwargs))


@pytest.fixture(scope="module")
def resident():
    return load(expert_memory="resident")


def tokens(n: int, seed: int = 0) -> list:
    return np.random.default_rng(seed).integers(0, 400, n).tolist()


def run_logits(model, prompt: list, follow: list, step=STEP) -> list:
    """Logits of a chunked prefill's last row, then of each decode step."""
    cache = model.make_cache()
    out = [np.array(model.prefill(mx.array([prompt]), cache, step_size=step)[0, -1])]
    for t in follow:
        out.append(np.array(model(mx.array([[t]]), cache=cache)[0, -1]))
    return out


def budgets() -> list:
    """One slot (every call in waves of one expert), five, half, all; the middle two run in
    the full suite."""
    slow = pytest.mark.slow
    return [pytest.param(EXPERT_BYTES, id="one-slot"),
            pytest.param(5 * EXPERT_BYTES, id="five", marks=slow),
            pytest.param(ALL_EXPERTS // 2 * EXPERT_BYTES, id="half", marks=slow),
            pytest.param(ALL_EXPERTS * EXPERT_BYTES, id="all")]


def test_the_tiny_checkpoints_expert_sizes(resident):
    """One expert: 3 projections of hidden x inter weights, mxfp4 (half a byte a weight) with
    one E8M0 byte per 32 weights (the published FP4 layout)."""
    plan = resident.expert_plan
    cfg = resident.cfg
    weights = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    assert plan.minimum == weights // 2 + weights // 32 == EXPERT_BYTES
    assert plan.expert_bytes == ALL_EXPERTS * EXPERT_BYTES
    assert not plan.streamed and resident.expert_store is None


@pytest.mark.parametrize("budget", budgets())
@pytest.mark.slow
def test_prefill_and_decode_are_the_resident_bits(resident, budget):
    prompt, follow = tokens(70), tokens(12, seed=1)
    expected = run_logits(resident, prompt, follow)
    model = load(expert_memory=budget)
    got = run_logits(model, prompt, follow)
    for step, (a, b) in enumerate(zip(expected, got)):
        assert np.array_equal(a, b), step
    store = model.expert_store
    assert store.slots == budget // EXPERT_BYTES and store.nbytes <= budget
    assert store.stats.loads == store.stats.routed - store.stats.hits
    if budget < 6 * EXPERT_BYTES:  # a prefill chunk routes to more experts than the slots
        assert store.stats.waves > 0


def test_a_prefill_chunk_reads_each_expert_once(resident):
    """All slots: a 64-token chunk runs one call per MoE module and reads each routed expert
    once, though 64 tokens x k route to each module."""
    model = load(expert_memory=ALL_EXPERTS * EXPERT_BYTES)
    modules = sum(isinstance(m, StreamedSwitchMLP) and p.startswith("model.layers.")
                  for p, m in model.named_modules())  # the drafter's are not in a prefill
    cache = model.make_cache()
    model.prefill(mx.array([tokens(64)]), cache, step_size=64)
    stats = model.expert_store.stats.snapshot()
    assert stats.calls == modules and stats.hits == 0
    assert stats.loads == stats.routed <= ALL_EXPERTS
    assert stats.bytes_read == stats.loads * EXPERT_BYTES
    model.prefill(mx.array([tokens(64)]), model.make_cache(), step_size=64)
    again = model.expert_store.stats.since(stats)  # the same tokens: all resident now
    assert again.loads == 0 and again.hits == again.routed == stats.routed


@pytest.mark.slow
def test_a_batch_of_mixed_lengths_is_the_resident_bits(resident):
    """Six sequences decode together with 5 slots: each step routes to more experts than the
    slots (waves), and every sequence's logits stay the resident batch's."""
    lengths = [1, 7, 16, 33, 70, 2]
    texts = [tokens(n, seed=i) for i, n in enumerate(lengths)]
    follow = [tokens(6, seed=10 + i) for i in range(len(lengths))]
    model = load(expert_memory=5 * EXPERT_BYTES)

    def steps(m):
        caches = []
        for ids in texts:
            caches.append(m.make_cache())
            m.prefill(mx.array([ids]), caches[-1], step_size=STEP)
        return [np.array(batch_forward(m, mx.array([[f[s]] for f in follow]), caches).logits)
                for s in range(len(follow[0]))]

    for a, b in zip(steps(resident), steps(model)):
        assert np.array_equal(a, b)
    assert model.expert_store.stats.waves > 0


@pytest.mark.slow
def test_dspark_verification_is_the_resident_bits():
    """The drafter's experts stream too: greedy speculative decoding gives the resident
    model's tokens and log-probabilities."""
    tokenizer = mlx_v41.load(golden_checkpoint("tiny"))[1]
    prompt = tokens(40, seed=3)

    def reply(model):
        return [(r.token, np.array(r.logprobs)) for r in mlx_v41.stream_generate(
            model, tokenizer, prompt, max_tokens=12, draft="dspark", prefill_step_size=STEP)]

    expected = reply(load(dspark=True, expert_memory="resident"))
    model = load(dspark=True, expert_memory=3 * EXPERT_BYTES)
    assert any(p.startswith("dspark.") for p, _ in model.named_modules()
               if isinstance(_, StreamedSwitchMLP))
    got = reply(model)
    assert [t for t, _ in got] == [t for t, _ in expected]
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(got, expected))


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [None, "mixed_2_8"])
def test_converted_folders_stream_their_recipe(tmp_path, recipe):
    """A converted folder's stacked experts are read by row ranges: the official recipe's
    mxfp4 and the 2-bit recipe's affine weights, scales and biases."""
    from mlx_v41.convert import convert

    out = convert(golden_checkpoint("tiny"), tmp_path / "mlx", quant_predicate=recipe,
                  progress=False, log=lambda _: None)
    prompt, follow = tokens(40, seed=4), tokens(6, seed=5)
    expected = run_logits(load(out, expert_memory="resident"), prompt, follow)
    model = load(out, expert_memory=4 * model_expert_bytes(out))
    got = run_logits(model, prompt, follow)
    assert all(np.array_equal(a, b) for a, b in zip(expected, got))
    assert model.expert_store.stats.loads > 0


def model_expert_bytes(folder) -> int:
    return load(folder, expert_memory="resident").expert_plan.minimum


# ---------------------------------------------------------------- faults


def expert_file(folder, expert_tensor: str):
    index = read_index(folder)
    path = index[expert_tensor]
    entry = SafetensorsFile(path).entries[expert_tensor]
    return path, SafetensorsFile(path).start + entry["data_offsets"][0]


def test_a_truncated_shard_fails_the_call_naming_file_and_tensor(tmp_path, resident):
    folder = writable_copy(golden_checkpoint("tiny"), tmp_path / "hf")
    model = load(folder, expert_memory=EXPERT_BYTES)
    name = "layers.0.ffn.experts.0.w1.weight"
    path, offset = expert_file(folder, name)
    original = path.read_bytes()
    prompt = tokens(70)
    with open(path, "r+b") as f:
        f.truncate(offset + 10)
    with pytest.raises(ExpertReadError) as info:
        for start in range(0, 400, 2):  # until some call routes to a missing byte
            model(mx.array([tokens(2, seed=start)]), cache=model.make_cache())
    message = str(info.value)
    assert "\n" not in message and str(path) in message and "layers.0.ffn.experts." in message
    assert "truncated" in message
    path.write_bytes(original)  # repaired: the same model serves again, the resident bits
    expected = run_logits(resident, prompt, [])
    assert np.array_equal(run_logits(model, prompt, [])[0], expected[0])


def test_a_nan_scale_byte_is_refused(tmp_path):
    folder = writable_copy(golden_checkpoint("tiny"), tmp_path / "hf")
    model = load(folder, expert_memory=ALL_EXPERTS * EXPERT_BYTES)
    scale = "layers.0.ffn.experts.1.w2.scale"
    path, offset = expert_file(folder, scale)
    with open(path, "r+b") as f:
        f.seek(offset + 3)
        f.write(bytes([255]))
    with pytest.raises(ExpertReadError, match=rf"{scale} holds the E8M0 NaN byte 255"):
        model.prefill(mx.array([tokens(400)]), model.make_cache(), step_size=400)


# ---------------------------------------------------------------- budgets and auto


def test_bad_budgets_get_one_line():
    for value, words in ((EXPERT_BYTES - 1, "below the minimum of 13.06 KB (13056 bytes"),
                         (ALL_EXPERTS * EXPERT_BYTES + 1, "more than all the routed experts"),
                         ("lots", "'lots' is not a memory size"), ("0GB", "not a memory size")):
        with pytest.raises(ValueError, match="expert_memory") as info:
            load(expert_memory=value)
        assert words in str(info.value) and "\n" not in str(info.value)


def test_sizes_parse_in_decimal_and_binary_units():
    assert parse_memory_size("48GB") == 48 * 10**9
    assert parse_memory_size("512MB") == 512 * 10**6
    assert parse_memory_size("40GiB") == 40 * 2**30
    assert parse_memory_size("1e9") == 10**9
    assert parse_memory_size(12345) == 12345


def test_auto_chooses_resident_or_streamed_by_the_working_set(resident):
    cfg = resident.cfg
    experts, other = 300 * 10**9, 10 * 10**9
    roomy = plan_experts("auto", experts, other, 18 * 10**6, cfg, memory=400 * 10**9)
    assert roomy == ExpertPlan(False, experts, experts, other, 18 * 10**6, roomy.reason)
    # 128 GB: 10 % (12.8 GB) kept for caches, 10 GB of other weights -> 105.2 GB of slots
    tight = plan_experts("auto", experts, other, 18 * 10**6, cfg, memory=128 * 10**9)
    assert tight.streamed and tight.budget == 128 * 10**9 - 12_800_000_000 - other
    with pytest.raises(ValueError, match="does not fit this machine even with its experts"):
        plan_experts("auto", experts, other, 18 * 10**6, cfg, memory=11 * 10**9)
    with pytest.raises(ValueError, match="do not fit this machine's 128.00 GB working set "
                                         "resident: use --expert-memory SIZE"):
        plan_experts("resident", experts, other, 18 * 10**6, cfg, memory=128 * 10**9)


def test_auto_follows_the_mlx_memory_limit(resident):
    """`mx.set_memory_limit` below the weights: auto streams, and says so in one line."""
    plan = resident.expert_plan
    reserve = session_bytes(resident.cfg, KV_RESERVE_TOKENS)  # more than 10 % here
    previous = mx.set_memory_limit(plan.other_bytes + reserve + plan.expert_bytes // 2)
    try:
        model = load()
    finally:
        mx.set_memory_limit(previous)
    assert model.expert_plan.streamed and model.expert_store is not None
    assert model.expert_store.slots == ALL_EXPERTS // 2
    assert model.expert_plan.line().startswith("experts: streamed from SSD, ")
    assert load().expert_plan.line().startswith("experts: resident (")


def test_cli_flag_and_stats(capsys):
    from mlx_v41.cli import generate as generate_cli

    folder = str(golden_checkpoint("tiny"))
    code = generate_cli.main(["--model", folder, "-p", "hi", "-m", "4", "--no-thinking",
                              "--expert-memory", str(5 * EXPERT_BYTES), "--expert-prefetch",
                              "16"])
    out = capsys.readouterr()
    assert code == 0
    assert "experts: streamed from SSD, 65.28 KB of 1.25 MB in memory" in out.err
    assert re.search(r"^Experts: hit rate [\d.]+ % of \d+ routed, [\d.]+ [KMG]?B read( \(\+"
                     r"[\d.]+ [KMG]?B read ahead unused\))? at [\d.]+ [KMG]?B/s, [\d.]+ s "
                     r"waiting on reads$", out.out, re.M)
    with pytest.raises(SystemExit):
        generate_cli.main(["--model", folder, "--expert-memory", "many"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--expert-memory: 'many' is not a memory size" in err[0]
    with pytest.raises(SystemExit):
        generate_cli.main(["--model", folder, "--expert-prefetch", "-1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--expert-prefetch: '-1' is not an integer in 0..256" in err[0]
    code = generate_cli.main(["--model", folder, "--expert-memory", "1KB"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[-1].startswith("error: expert_memory: 1.00 KB is below the min")


def test_a_deleted_folder_fails_with_one_line(tmp_path):
    """Streamed experts are read from the folder while the model runs."""
    folder = writable_copy(golden_checkpoint("tiny"), tmp_path / "hf")
    model = load(folder, expert_memory=EXPERT_BYTES)
    shutil.rmtree(folder)
    with pytest.raises(ExpertReadError, match="cannot be read|truncated"):
        model.prefill(mx.array([tokens(70)]), model.make_cache(), step_size=STEP)


# ---------------------------------------------------------------- one damaged expert in a batch


def routed_in_decode(model, texts, follow_steps: int) -> tuple:
    """({(module, expert)} each sequence's decode steps route to, those its prefill routes to),
    recorded from the store's calls (a decode call has one row per sequence)."""
    from mlx_v41.generation.batch import BatchGenerator

    store, calls = model.expert_store, []
    original = store.run

    def recording(index, x, ids, weights):
        calls.append((index, np.array(ids)))
        return original(index, x, ids, weights)

    store.run = recording
    generator = BatchGenerator(model, stop_tokens=(), max_tokens=follow_steps,
                               prefill_step_size=STEP)
    uids = generator.insert(texts)
    while len(generator):
        generator.next()
    del store.run
    per_seq, prefill = [set() for _ in uids], set()
    for index, ids in calls:
        if ids.shape[0] == len(texts):
            for b in range(len(texts)):
                per_seq[b] |= {(index, int(e)) for e in ids[b]}
        else:
            prefill |= {(index, int(e)) for e in ids.reshape(-1)}
    return uids, per_seq, prefill


@pytest.mark.slow
def test_a_damaged_expert_fails_only_the_sequences_routed_to_it(tmp_path, resident):
    from mlx_v41.generation.batch import BatchGenerator
    from test_batch import run

    folder = writable_copy(golden_checkpoint("tiny"), tmp_path / "hf")
    model = load(folder, expert_memory=EXPERT_BYTES)  # one slot: every call reads again
    texts = [tokens(n, seed=20 + n) for n in (9, 14, 21)]
    _, per_seq, prefill = routed_in_decode(model, texts, 6)
    counts = {}
    for used in per_seq:
        for key in used - prefill:
            counts[key] = counts.get(key, 0) + 1
    key = next(k for k, n in sorted(counts.items()) if n < len(texts))
    region = next(r for r in model.expert_store.regions[key[0]][key[1]] if r.e8m0)
    with open(region.path, "r+b") as f:
        f.seek(region.offset)
        f.write(bytes([255]))
    outputs = []
    for m in (resident, model):
        generator = BatchGenerator(m, stop_tokens=(), max_tokens=6, prefill_step_size=STEP)
        uids = generator.insert(texts)
        out = run(generator)
        outputs.append([out[uid] for uid in uids])
    expected, got = outputs
    for b, used in enumerate(per_seq):
        if key in used:  # failed alone, naming the damaged tensor
            assert isinstance(got[b], ExpertReadError) and region.tensor in str(got[b])
        else:  # the others ran on, with the resident tokens
            assert got[b] == expected[b]


@pytest.mark.slow
def test_the_server_fails_the_request_in_its_shape_and_serves_on(tmp_path):
    import openai

    from server_harness import LiveServer

    folder = writable_copy(golden_checkpoint("tiny"), tmp_path / "hf")
    model, tokenizer = mlx_v41.load(folder, dspark=False, expert_memory=EXPERT_BYTES)
    regions = [r for per_expert in model.expert_store.regions[0] for r in per_expert if r.e8m0]
    originals = []
    for region in regions:  # every expert of the first MoE layer: any request routes there
        with open(region.path, "r+b") as f:
            f.seek(region.offset)
            originals.append(f.read(1))
            f.seek(region.offset)
            f.write(bytes([255]))
    live = LiveServer(model, tokenizer)
    try:
        client = live.client()
        messages = [{"role": "user", "content": "hello"}]
        with pytest.raises(openai.InternalServerError) as info:
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=3)
        text = info.value.body["message"]
        assert "ExpertReadError" in text and "holds the E8M0 NaN byte 255" in text
        assert "layers.0.ffn.experts." in text and "\n" not in text
        for region, byte in zip(regions, originals):  # repaired: the server serves again
            with open(region.path, "r+b") as f:
                f.seek(region.offset)
                f.write(byte)
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3)
        assert reply.usage.completion_tokens >= 1
    finally:
        live.close()


@pytest.mark.slow
@pytest.mark.parametrize("split", [["--tensor-parallel"], ["--pipeline", "7"]],
                         ids=["tensor", "pipeline"])
def test_ranks_stream_their_experts(split, capsys):
    """`mlx.launch -n 2 -- -m mlx_v41.generate ... --expert-memory`: each rank streams its own
    experts (a tensor-parallel rank its share of each table, a pipeline stage its layers);
    the sampled text is one resident process's."""
    from mlx_v41.cli.generate import main as generate_main
    from test_distributed import launch

    args = ["--model", str(golden_checkpoint("tiny")), "-p", "hello", "-m", "10", "--temp",
            "0.8", "--seed", "3"]
    result = launch(2, "-m", "mlx_v41.generate", *args, *split, "--expert-memory",
                    str(2 * EXPERT_BYTES))
    assert "=" * 10 in result.stdout, (result.stdout, result.stderr)
    assert generate_main(args + ["--expert-memory", "resident"]) == 0
    one = capsys.readouterr().out.split("=" * 10)[1]
    assert result.stdout.split("=" * 10)[1] == one, result.stderr
    assert "experts: streamed from SSD, 26.11 KB" in result.stderr
    assert "Experts: hit rate" in result.stdout


@pytest.mark.slow
def test_image_prompts_are_the_resident_bits(tmp_path):
    """An image span's positions route with `bias_vl`: streamed, the same logits."""
    from mlx_v41.model.vision import prepare_prompt
    from vision_fixtures import IMAGES, SMALL_MIN_PIXELS, vision_checkpoint

    folder = vision_checkpoint(tmp_path / "hf", SMALL_MIN_PIXELS)
    tokenizer = mlx_v41.load(folder, expert_memory="resident")[1]
    ids = tokenizer.encode_prompt("Look: <｜deepseek_image｜> - what?")

    def logits(model):
        prompt = prepare_prompt(model, ids, IMAGES[:1])
        cache = model.make_cache()
        out = [np.array(model.prefill(mx.array([prompt.ids]), cache, step_size=STEP,
                                      images=prompt.inputs(model))[0, -1])]
        for _ in range(4):
            out.append(np.array(model(mx.array([[int(out[-1].argmax())]]), cache=cache)[0, -1]))
        return out

    resident_model = load(folder, expert_memory="resident")
    expected = logits(resident_model)
    budget = 3 * resident_model.expert_plan.minimum
    assert all(np.array_equal(a, b) for a, b in zip(expected, logits(load(
        folder, expert_memory=budget))))


# ---------------------------------------------------------------- read-ahead


@pytest.mark.slow
def test_read_ahead_is_taken_and_changes_no_bits(resident):
    prompt, follow = tokens(40, seed=7), tokens(20, seed=8)
    runs = {}
    for prefetch in (0, 16):
        model = load(expert_memory=20 * EXPERT_BYTES, expert_prefetch=prefetch)
        runs[prefetch] = (run_logits(model, prompt, follow), model.expert_store)
    for a, b in zip(runs[0][0], runs[16][0]):
        assert np.array_equal(a, b)
    assert runs[0][1].stats.read_ahead == 0 and runs[0][1].ahead.issued == 0
    ahead = runs[16][1]
    assert 0 < ahead.stats.read_ahead == ahead.ahead.used <= ahead.ahead.issued
    assert ahead.stats.loads == runs[0][1].stats.loads  # the same experts, read earlier


class FixedRouter:
    """A router that always picks `ids` (what a prediction reads)."""

    def __init__(self, ids):
        self.ids = ids

    def select(self, x):
        return mx.array([[self.ids]], dtype=mx.uint32), None


def test_a_failed_read_ahead_fails_only_the_call_that_needs_it(tmp_path):
    from mlx_v41.model.expert_prefetch import ReadAhead
    from mlx_v41.model.expert_reader import FileReader, Region

    good, bad = tmp_path / "good", tmp_path / "bad"
    good.write_bytes(bytes(range(64)))
    bad.write_bytes(bytes(8))
    regions = [[], [[Region(str(good), 16, 8, "ok.weight")], [Region(str(bad), 4, 8, "x.scale")]]]
    parts = [type("Part", (), {"nbytes": 8})()]
    pool = type("Pool", (), {"slot_of": {}})()
    ahead = ReadAhead(FileReader(2), regions, [None, (FixedRouter([0, 1]), 0)], capacity=4)
    ahead.begin(0), ahead.begin(1), ahead.begin(0)  # learned: module 1 follows module 0
    ahead.predict(0, mx.zeros((1, 4)), pool, parts)
    assert set(ahead.pending) == {(1, 0), (1, 1)}
    ahead.end(0)
    ahead.begin(1)
    assert bytes(ahead.take((1, 0))[0]) == bytes(range(16, 24))
    with pytest.raises(ExpertReadError, match="x.scale is truncated"):
        ahead.take((1, 1))  # needed: the call fails as a direct read would
    ahead.stats = ExpertStats()
    ahead.predict(0, mx.zeros((1, 4)), pool, parts)  # module 0 is followed by 1 again...
    for key in list(ahead.pending):  # (the reads end before the next call)
        [f.exception() for f in ahead.pending[key][0]]
    ahead.begin(0)  # ...but the next call is module 0's: module 1's reads are dropped unseen
    assert ahead.pending == {} and ahead.stats.ahead_unused_bytes == 2 * 8  # and counted


@pytest.mark.slow
def test_a_chat_session_shows_the_expert_counters(resident):
    from mlx_v41.chat.session import ChatSession, format_stats

    tokenizer = mlx_v41.load(golden_checkpoint("tiny"), expert_memory="resident")[1]
    turns = []
    for model in (resident, load(expert_memory=7 * EXPERT_BYTES)):
        session = ChatSession(model, tokenizer, thinking=False, max_tokens=6)
        turns.append([r.token for r in session.reply("hello there")])
        shown = format_stats(session)
    assert turns[0] == turns[1]
    assert "experts (since loading): hit rate " in shown
    assert "experts (since" not in format_stats(ChatSession(resident, tokenizer))
