"""Pipeline parallel over real processes: `mlx.launch` (ring backend over localhost) runs
tests/distributed_worker.py, mlx_v41.generate or mlx_v41.chat on 2-3 ranks; the logits (the
last rank's) must equal one process's bit for bit, and the sampled text and chat transcript
too. Failures: a rank that cannot load, mismatched weights, a rank killed mid-generation end
every rank with one line naming the rank; Ctrl-C in the chat ends every rank."""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mlx_v41.checkpoint.load import load_model
from mlx_v41.checkpoint.loader import data_start
from mlx_v41.checkpoint.safetensors_io import SafetensorsFile
from mlx_v41.cli.generate import main as generate_main

from conftest import (RANK_PRIORITY, free_port_run, golden_checkpoint, mlx_launch,
                      writable_copy)
from distributed_worker import scenario

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("distributed_worker.py")
TIMEOUT = 120


def launch(n: int, *command, timeout: int = TIMEOUT) -> subprocess.CompletedProcess:
    cmd = [*mlx_launch(n), *map(str, command)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def reference(checkpoint: Path) -> dict:
    return scenario(lambda mode: load_model(checkpoint, prefill_mode=mode, dspark=False),
                    checkpoint)


def run_worker(n: int, checkpoint, split: str, out: Path) -> list:
    result = launch(n, WORKER, checkpoint, split, out)
    assert (out / "logits.npz").is_file(), result.stdout + result.stderr
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


def check_exact(out: Path, expected: dict) -> None:
    got = np.load(out / "logits.npz")
    for name, value in expected.items():
        assert got[name].shape == value.shape, name
        assert np.array_equal(got[name], value), f"{name}: max |diff| " \
            f"{np.abs(got[name] - value).max()}"


@pytest.mark.slow
def test_three_ranks_split_inside_owner_groups(tmp_path):
    """Schedule (40 layers, the published roles): ranks [0, 10) [10, 26) [26, 40). Layer 10
    reads owner 8's rows, 26/27 reuse index layer 24's top-k and owner 20's rows, Engram 1 and
    14 sit on different ranks, and the CED encoder/decoder boundary (20) is inside rank 1."""
    checkpoint = golden_checkpoint("schedule")
    reports = run_worker(3, checkpoint, "10,26", tmp_path)
    assert reports[0]["ranges"] == [[0, 10], [10, 26], [26, 40]]
    check_exact(tmp_path, reference(checkpoint))


@pytest.mark.slow
def test_two_ranks_exact_and_memory(tmp_path):
    """Tiny (12 layers, decoder from 7), the split chosen by weight bytes; each rank holds
    only its share of the parameters, and the shares add up to the whole model."""
    checkpoint = golden_checkpoint("tiny")
    reports = run_worker(2, checkpoint, "auto", tmp_path)
    check_exact(tmp_path, reference(checkpoint))
    model = load_model(checkpoint, dspark=False, vision=False)  # what the ranks load
    from mlx.utils import tree_flatten
    whole = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    shares = [r["params"] for r in reports]
    assert sum(shares) == whole
    assert max(shares) < 0.62 * whole, shares  # measured 0.53 / 0.47
    for r in reports:  # resident memory follows the share (plus rings, RoPE tables)
        assert r["active"] < 1.6 * r["params"] + 2 ** 20, r
    # Bytes per decode token, boundary: one row of streams (hc x D bf16) + pre (hc fp32) +
    # headers + the new rows of the kv owners rank 1 reads; then the sampled token (one
    # int32 per rank), no logits.
    cfg = model.cfg
    row = cfg.hc_mult * cfg.hidden_size * 2 + cfg.hc_mult * 4
    sent, reduced = reports[0]["sent"]["decode"]
    assert row < sent < row + 600, sent
    assert reduced == 4


@pytest.mark.slow
def test_image_prompt_over_a_pipeline_equals_one_process(tmp_path, capsys):
    """The vision golden's checkpoint (small spans) split at layer 3: the tower on rank 0
    alone, Engram layer 5, the CED boundary (7) and the halo on rank 1. An image prompt's
    logits (full prefill, chunked CED prefill with chunk boundaries inside the span, decode
    steps) equal one process's bit for bit, and `generate --pipeline --image` prints the
    one-process text. Rank 0 sends the image mask with the rows: one byte per position."""
    from distributed_worker import generate_args, image_scenario
    from vision_fixtures import SMALL_MIN_PIXELS, twin_images, vision_checkpoint

    folder = vision_checkpoint(tmp_path / "hf", SMALL_MIN_PIXELS)
    images = twin_images(tmp_path)  # the prompt has two placeholders
    result = launch(2, WORKER, folder, "3", tmp_path / "out", "--image", images[0], "--image",
                    images[1])
    assert (tmp_path / "out" / "logits.npz").is_file(), result.stdout + result.stderr
    reports = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in range(2)]
    assert reports[0]["ranges"] == [[0, 3], [3, 12]]
    assert [r["vision"] for r in reports] == [True, False]  # the tower on rank 0 only
    expected, _ = image_scenario(load_model(folder, dspark=False), images)
    records = str(np.load(tmp_path / "out" / "logits.npz")["records"])
    assert records == str(expected.pop("records"))  # rank 0's span records on rank 1
    check_exact(tmp_path / "out", expected)
    sent = reports[0]["sent"]  # one crossing per full prefill: the mask's bytes more
    assert sent["image_full_all"] - sent["text_full_all"] == int(expected["rows"]), sent
    assert generate_main([str(a) for a in generate_args(folder, images)]) == 0
    one = capsys.readouterr().out.split("=" * 10)[1]
    code, text = reports[0]["generate"]
    assert code == 0 and text.split("=" * 10)[1] == one, text


def _file_layers(path: Path, layers) -> dict:
    """The arrays and records of `layers` in a prompt-cache file."""
    import mlx.core as mx

    arrays, info = mx.load(str(path), format="safetensors", return_metadata=True)
    records = json.loads(info["layers"])
    return {i: (records[i], {k: np.array(v) for k, v in arrays.items()
                             if k.split(".")[0] == str(i)}) for i in layers}


def _same_layers(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[i][0] == b[i][0] and a[i][1].keys() == b[i][1].keys() and
        all(np.array_equal(a[i][1][k], b[i][1][k]) for k in a[i][1]) for i in a)


@pytest.mark.slow
def test_generate_cli_pipeline_matches_one_process(tmp_path, capsys):
    """`mlx.launch -n 2 -- -m mlx_v41.generate --pipeline 7 --prompt-cache-file F`: rank 0
    alone prints, and the sampled text (temperature 0.8, seed 3) is the one-process text. Each
    rank saved its share of the prompt cache (F on rank 0, F.rank1-of-2 on rank 1), bit for bit
    one process's layers; a new group loads them and, reusing the shared prefix, continues as
    one process does from its own file."""
    args = ["--model", golden_checkpoint("tiny"), "-m", "10", "--temp", "0.8", "--seed", "3"]
    first, second = ["-p", "hello"], ["-p", "hello there"]
    (tmp_path / "one").mkdir(), (tmp_path / "two").mkdir()
    one_file, two_file = tmp_path / "one" / "F", tmp_path / "two" / "F"
    result = launch(2, "-m", "mlx_v41.generate", *args, *first, "--pipeline", "7",
                    "--prompt-cache-file", two_file)
    expected = []
    for prompt in (first, second):
        assert generate_main([str(a) for a in args + prompt] +
                             ["--prompt-cache-file", str(one_file)]) == 0
        out, err = capsys.readouterr()
        expected.append((out.split("=" * 10)[1], err))
    assert result.stdout.count("=" * 10) == 2, result.stdout + result.stderr  # one rank printed
    assert result.stdout.split("=" * 10)[1] == expected[0][0]
    assert sorted(p.name for p in two_file.parent.iterdir()) == ["F", "F.rank1-of-2"]
    assert _same_layers(_file_layers(two_file, range(7)), _file_layers(one_file, range(7)))
    assert _same_layers(_file_layers(tmp_path / "two" / "F.rank1-of-2", range(7, 12)),
                        _file_layers(one_file, range(7, 12)))
    result = launch(2, "-m", "mlx_v41.generate", *args, *second, "--pipeline", "7",
                    "--prompt-cache-file", two_file)
    assert result.stdout.split("=" * 10)[1] == expected[1][0], result.stderr
    reuse = [ln for ln in expected[1][1].splitlines() if ln.startswith("prompt cache: reusing")]
    assert len(reuse) == 1 and 0 < int(reuse[0].split()[3]) < int(reuse[0].split()[5])
    assert result.stderr.count(reuse[0]) == 2, result.stderr  # both ranks reused as much


def _flip_embedding_byte(folder: Path) -> None:
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    shard = folder / index["embed.weight"]
    begin = SafetensorsFile(shard).entries["embed.weight"]["data_offsets"][0]
    data = bytearray(shard.read_bytes())
    data[data_start(shard) + begin + 1] ^= 0x01
    shard.write_bytes(bytes(data))


@pytest.mark.slow
def test_mismatched_weights_and_load_failure_named(tmp_path):
    """Rank 1 with other weights, then rank 1 with no folder: every rank exits with one line
    naming rank 1 and the cause."""
    (tmp_path / "0").symlink_to(golden_checkpoint("tiny").resolve())
    _flip_embedding_byte(writable_copy(golden_checkpoint("tiny"), tmp_path / "1"))
    result = launch(2, WORKER, tmp_path / "{rank}", "auto", tmp_path / "out")
    lines = [ln for ln in result.stderr.splitlines() if "rank 1's weights differ" in ln]
    assert len(lines) == 2, result.stderr  # one line from each rank
    import shutil
    shutil.rmtree(tmp_path / "1")
    result = launch(2, WORKER, tmp_path / "{rank}", "auto", tmp_path / "out")
    lines = [ln for ln in result.stderr.splitlines() if "rank 1 could not load" in ln]
    assert len(lines) == 2 and "model folder not found" in lines[0], result.stderr
    assert not (tmp_path / "out").exists()


def _free_ports(n: int) -> list:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def by_hand(tmp_path, *command) -> list:
    """Two ranks started without a launcher (nothing else to clean up or to end them), at
    `RANK_PRIORITY`."""
    hostfile = tmp_path / "hosts.json"
    base = free_port_run(2)  # the ring's ports, as mlx_launch picks them
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in (base, base + 1)]))
    procs = []
    for rank in range(2):
        env = dict(os.environ, MLX_HOSTFILE=str(hostfile), MLX_RANK=str(rank),
                   PYTHONUNBUFFERED="1")
        procs.append(subprocess.Popen([*RANK_PRIORITY, sys.executable, *map(str, command)],
                                      cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    return procs


@pytest.mark.slow
@pytest.mark.parametrize("split", ["auto", "tensor"])
def test_killed_rank_ends_the_others(tmp_path, split):
    """Rank 1 kills itself during decoding; rank 0 must exit by itself, soon, with one line
    naming rank 1 (pipeline and tensor parallel)."""
    procs = by_hand(tmp_path, WORKER, golden_checkpoint("tiny"), split, tmp_path / "out",
                    "--kill-rank", "1")
    tic = time.monotonic()
    _, err = procs[0].communicate(timeout=TIMEOUT)
    procs[1].wait(timeout=TIMEOUT)
    assert procs[1].returncode == -9
    assert procs[0].returncode == 1, err
    lines = [ln for ln in err.splitlines() if "lost rank 1" in ln]
    assert len(lines) == 1 and lines[0].startswith("rank 0: lost rank 1 while"), err
    assert time.monotonic() - tic < 60


@pytest.mark.slow
@pytest.mark.parametrize("switch", ["--pipeline", "--tensor-parallel"])
def test_stuck_rank_ends_the_others(tmp_path, switch):
    """`mlx_v41.generate` on two ranks; rank 1 is stopped (alive, but it never answers again)
    once rank 0 streams text: rank 0 ends within --distributed-timeout of its last progress,
    with one line, instead of waiting in a collective forever."""
    import signal
    import threading

    timeout = 8
    procs = by_hand(tmp_path, "-m", "mlx_v41.generate", "--model", golden_checkpoint("tiny"),
                    "-m", "400", "-p", "Hello", switch, "--distributed-timeout", timeout)
    streamed = threading.Event()
    chars = []

    def read():
        while ch := procs[0].stdout.read(1):
            chars.append(ch)
            if len(chars) > 20:
                streamed.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert streamed.wait(TIMEOUT), procs[0].stderr.read()
        os.kill(procs[1].pid, signal.SIGSTOP)
        tic = time.monotonic()
        procs[0].wait(timeout + 30)
        waited = time.monotonic() - tic
        err = procs[0].stderr.read()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(TIMEOUT)
    assert procs[0].returncode == 1, err
    lines = [ln for ln in err.splitlines() if "no progress" in ln]
    assert lines == [f"mlx_v41: rank 0: no progress from the group for {timeout} s while "
                     "generating a reply: a rank is stuck or the link is down "
                     "(--distributed-timeout)"], err
    assert timeout - 1 < waited


# ---------------------------------------------------------------- mlx_v41.chat over the ranks

# Chunked prompts (progress on stderr); the drafter loaded, switched on by `/dspark on`.
CHAT_FLAGS = ["-m", "5", "--prefill-step-size", "32", "--dspark"]
CHAT_SCRIPT = ["Hello", "/thinking off", "/dspark on", "Again", "/stats", "/reset",
               "Grüße, 世界", "/thinking on"]  # UTF-8
REFUSED = {8: "/image {tmp}/missing.png"}


def vision_chat(tmp_path: Path, script: list, at: int) -> tuple:
    """The vision golden's checkpoint (small spans) and `script` with `/image` of a twin
    image inserted at `at` (the next message carries it)."""
    from vision_fixtures import SMALL_MIN_PIXELS, twin_images, vision_checkpoint

    folder = vision_checkpoint(tmp_path / "hf", SMALL_MIN_PIXELS)
    image = twin_images(tmp_path)[0]
    return folder, script[:at] + [f"/image {image}"] + script[at:]


def one_process_chat(script, capsys, monkeypatch, model: Path) -> str:
    import io
    from mlx_v41.cli.chat import main as chat_main

    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(f"{line}\n" for line in script)))
    assert chat_main(["--model", str(model), *CHAT_FLAGS]) == 0
    out, err = capsys.readouterr()
    assert "error" not in err, err
    return out


def comparable(transcript: str) -> str:
    """A transcript less its rates and memory sizes (timings; a rank holds a share)."""
    import re

    return re.sub(r"[\d.]+ (tokens/s|GB|MiB)", "#", transcript).rstrip("\n")


class Launched:
    """`mlx.launch` in a session of its own (so a Ctrl-C reaches it and every rank, as a
    terminal's does), fed and read line by line."""

    def __init__(self, n: int, *command):
        import signal

        cmd = [*mlx_launch(n), *map(str, command)]
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.text = {self.proc.stdout.fileno(): b"", self.proc.stderr.fileno(): b""}

    def send(self, lines) -> None:
        self.proc.stdin.write("".join(f"{line}\n" for line in lines).encode())
        self.proc.stdin.flush()

    @property
    def out(self) -> str:
        return self.text[self.proc.stdout.fileno()].decode(errors="replace")

    @property
    def err(self) -> str:
        return self.text[self.proc.stderr.fileno()].decode(errors="replace")

    def read_until(self, done, timeout=TIMEOUT) -> None:
        import select

        deadline = time.monotonic() + timeout
        while not done(self):
            assert time.monotonic() < deadline, f"timed out: {self.out!r} {self.err!r}"
            assert self.proc.poll() is None, f"exited {self.proc.returncode}: {self.err}"
            for fd in select.select(list(self.text), [], [], 0.5)[0]:
                self.text[fd] += os.read(fd, 65536)

    def wait_gone(self, timeout: float) -> float:
        """Seconds until no process of the session is left (launcher and ranks)."""
        tic = time.monotonic()
        while time.monotonic() - tic < timeout:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return time.monotonic() - tic
            self.proc.poll()
            time.sleep(0.2)
        raise AssertionError(f"ranks still running {timeout} s after: {self.err}")

    def kill(self) -> None:
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


@pytest.mark.slow
def test_chat_over_a_pipeline_equals_one_process_and_ctrl_c_ends_every_rank(
        tmp_path, capsys, monkeypatch):
    """`mlx.launch -n 2 -- -m mlx_v41.chat --pipeline --dspark` fed on stdin: rank 0 alone
    prints, the transcript is one process's (greedy; an `/image` turn on the vision golden's
    checkpoint, whose span later turns reuse, decoded by DSpark switched on by /dspark, its
    draft counts in /stats; the cache rolled back by /thinking, reused, reset), the commands a
    pipeline cannot run, and an image rank 0 cannot read, are refused in one line each and
    change nothing (the one-process script lacks them). Then Ctrl-C (SIGINT to the launcher's
    process group, as a terminal sends it) while a long prompt is being prefilled ends every
    rank, soon, instead of leaving one waiting in a collective. (--tensor-parallel runs the
    same REPL code.)"""
    folder, script = vision_chat(tmp_path, CHAT_SCRIPT, 2)
    expected = comparable(one_process_chat(script, capsys, monkeypatch, folder))
    assert "attached to the next message" in expected
    assert "[dspark on]" in expected and "drafts: " in expected
    for at, command in sorted(REFUSED.items(), reverse=True):
        script.insert(at, command.format(tmp=tmp_path))
    chat = Launched(2, "-m", "mlx_v41.chat", "--model", folder, *CHAT_FLAGS, "--pipeline")
    try:
        chat.send(script)
        chat.read_until(lambda c: c.out.endswith("[thinking on]\n") and
                        c.err.count("error: ") == len(REFUSED))  # two pipes: either first
        assert comparable(chat.out) == expected
        refusals = [ln for ln in chat.err.splitlines() if "error: " in ln]
        assert refusals == [f"error: {tmp_path}/missing.png: cannot read the image file (No "
                            "such file or directory)"]
        if sys.platform.startswith("linux"):  # reads /proc
            # while rank 0 waits for its user, rank 1 sleeps (not polling MLX's ring socket)
            assert _cpu_seconds_over(_rank_pid(chat.proc.pid, 1), 3.0) < 0.6
        start = len(chat.err)
        chat.send(["word " * 300])  # ~300 tokens: ten chunks of 32
        chat.read_until(lambda c: "prefill " in c.err[start:])
        import signal

        os.killpg(chat.proc.pid, signal.SIGINT)
        assert chat.wait_gone(30) < 30
    finally:
        chat.kill()


@pytest.mark.slow
def test_chat_under_tensor_parallel_equals_one_process_and_quits(tmp_path, capsys,
                                                                 monkeypatch):
    """`--tensor-parallel`: the same replies as one process to an `/image` turn (the vision
    golden's checkpoint: the tower on rank 0, its span rows shared), then to a DSpark turn (its
    draft counts in /stats), a refusal naming the flag, and /quit ends every rank with status
    0 (mlx.launch never passes the end of its stdin on)."""
    folder, script = vision_chat(tmp_path, ["Hello", "/dspark on", "Again", "/stats"], 0)
    expected = comparable(one_process_chat(script, capsys, monkeypatch, folder))
    assert "drafts: " in expected
    done = subprocess.run(
        [*mlx_launch(2), "-m", "mlx_v41.chat", "--model", str(folder), *CHAT_FLAGS,
         "--tensor-parallel"],
        input="".join(f"{line}\n" for line in script) + "/bogus\n/quit\n",
        cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    assert comparable(done.stdout) == expected
    assert [ln for ln in done.stderr.splitlines() if "error" in ln] == [
        "error: unknown command '/bogus' (/help lists them)"]


@pytest.mark.slow
def test_chat_under_tensor_parallel_saves_loads_and_quits(tmp_path, capsys, monkeypatch):
    """`--tensor-parallel`: the transcript is one process's through /save and, after /reset,
    /load of the group's files (each rank its own: s.bin, s.bin.rank1-of-2). A /load that a
    rank cannot do (rank 1's file missing; a one-process file on rank 0) is refused in one line
    on every rank, the session unchanged (the next reply is one process's). /quit ends every
    rank with status 0 (mlx.launch never passes the end of its stdin on)."""
    import shutil

    session = tmp_path / "s.bin"
    script = ["Hello", f"/save {session}", "Again", "/reset", f"/load {session}", "More"]
    expected = comparable(one_process_chat(script, capsys, monkeypatch, golden_checkpoint("tiny")))
    session.rename(tmp_path / "one.bin")  # a one-process file
    chat = Launched(2, "-m", "mlx_v41.chat", "--model", golden_checkpoint("tiny"), *CHAT_FLAGS,
                    "--tensor-parallel")
    try:
        chat.send(script[:2])
        chat.read_until(lambda c: "[saved to" in c.out)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["one.bin", "s.bin",
                                                              "s.bin.rank1-of-2"]
        shutil.copyfile(session, tmp_path / "half.bin")  # rank 1 has no half.bin.rank1-of-2
        chat.send([f"/load {tmp_path}/half.bin", f"/load {tmp_path}/one.bin", *script[2:]])
        chat.read_until(lambda c: c.err.count("error: ") == 2 and
                        c.out.count("\n") >= expected.count("\n") + 1)
        assert comparable(chat.out) == expected
        refusals = [ln for ln in chat.err.splitlines() if "error: " in ln]
        assert refusals[0].startswith(f"error: rank 1: {tmp_path}/half.bin.rank1-of-2: not a "
                                      "readable prompt-cache file"), refusals
        assert refusals[1] == f"error: rank 0: {tmp_path}/one.bin: the cache was made by one " \
            "process; this is rank 0 of 2 (tensor parallel x2)"
        chat.send(["/quit"])
        assert chat.proc.wait(timeout=TIMEOUT) == 0, chat.err
    finally:
        chat.kill()


# ---------------------------------------------------------------- mlx_v41.server over the ranks

def _rank_pid(launcher: int, rank: int) -> int:
    """The pid of `rank` among the launcher's children (Linux: read from /proc)."""
    tasks = Path(f"/proc/{launcher}/task").glob("*/children")  # each thread's own children
    for child in " ".join(t.read_text() for t in tasks).split():
        if f"MLX_RANK={rank}".encode() in Path(f"/proc/{child}/environ").read_bytes().split(b"\0"):
            return int(child)
    raise AssertionError(f"no rank {rank} under the launcher")


def _cpu_seconds_over(pid: int, seconds: float) -> float:
    """The CPU seconds (user and system, all threads) process `pid` uses in the next `seconds`
    (Linux: read from /proc)."""
    def used() -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    before = used()
    time.sleep(seconds)
    return used() - before


def _wait_for_health(server: Launched, port: int) -> None:
    import http.client

    deadline = time.monotonic() + TIMEOUT
    while True:
        assert server.proc.poll() is None, server.proc.stderr.read().decode()
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.3)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_server_under_tensor_parallel_equals_one_process(tmp_path):
    """`mlx.launch -n 2 -- -m mlx_v41.server --tensor-parallel --dspark` on the vision golden's
    checkpoint: rank 0 serves raw HTTP, and the replies (greedy; greedy with an image part,
    decoded and run through the tower on rank 0, its span rows shared; seeded sampling with a
    penalty and a stop string; greedy with logprobs, which every rank holds) are one drafting
    process's, with its prompt reuse. A client that disconnects mid-stream cancels on every
    rank (the next reply is still one process's); Ctrl-C on rank 0 stops every rank. (The
    pipeline's server: the prompt-reuse test below.)"""
    import http.client
    import signal

    import mlx_v41
    from server_harness import LiveServer, post
    from test_server_vision import image_message
    from vision_fixtures import SMALL_MIN_PIXELS, TWIN_SPAN, twin_images, vision_checkpoint

    folder = vision_checkpoint(tmp_path / "hf", SMALL_MIN_PIXELS)
    greedy = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5,
              "temperature": 0}
    sampled = {**greedy, "temperature": 0.8, "seed": 3, "repetition_penalty": 1.3,
               "max_tokens": 8, "stop": ["ll"]}
    image = {**greedy, "messages": [image_message("Which is red?", twin_images(tmp_path)[0])]}
    bodies = (greedy, image, sampled, {**greedy, "logprobs": True, "top_logprobs": 2})
    one = LiveServer(*mlx_v41.load(folder, dspark=True), draft="dspark")
    try:
        expected = [post(one.port, "/v1/chat/completions", body)[1] for body in bodies]
    finally:
        one.close()
    assert expected[1]["usage"]["prompt_tokens"] > expected[0]["usage"]["prompt_tokens"] + \
        TWIN_SPAN
    port = _free_ports(1)[0]
    server = Launched(2, "-m", "mlx_v41.server", "--model", folder,
                      "--port", port, "--tensor-parallel", "--dspark", "--log-level", "WARNING")
    try:
        _wait_for_health(server, port)
        for body, want in zip(bodies, expected):
            status, got = post(port, "/v1/chat/completions", body)
            assert status == 200, got
            assert (got["choices"], got["usage"]) == (want["choices"], want["usage"])
            # a streamed reply whose client goes away after its first event
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("POST", "/v1/chat/completions",
                         json.dumps({**greedy, "max_tokens": 400, "stream": True}))
            assert conn.getresponse().read(6) == b"data: "
            conn.close()
        assert expected[3]["choices"][0]["logprobs"]["content"]
        os.kill(_rank_pid(server.proc.pid, 0), signal.SIGINT)  # uvicorn's graceful stop
        assert server.proc.wait(timeout=30) == 0, server.err  # rank 1 told, not lost
    finally:
        server.kill()


SERVER_CACHE_BYTES = 80_000  # one tiny-model entry fits, not two, both for one process
# (~61 KB a cache) and for the pipeline's largest share (rank 0's, ~47 KB); rank 1's share
# (~14 KB) alone would keep five, so a rank deciding by its own bytes reuses another prefix


def _reuse_lines(text: str) -> dict:
    """{rank: [cached tokens per request]} from the ranks' per-request log lines."""
    import re

    out: dict = {0: [], 1: []}
    for rank, cached in re.findall(r"rank (\d+): \d+ prompt tokens \((\d+) cached", text):
        out[int(rank)].append(int(cached))
    return out


def _logged(count: int):
    """`read_until`'s condition: both ranks logged `count` requests (the launcher forwards
    each rank's stderr on its own, so either may come first)."""
    return lambda server: all(len(v) >= count for v in _reuse_lines(server.err).values())


def _logged_after(count: int, ending: str):
    """`read_until`'s condition: both ranks logged more than `count` requests and the last
    one's line ends with `ending`."""
    import re

    def done(server) -> bool:
        lines = re.findall(r"rank \d: \d+ prompt tokens .*", server.err)
        per_rank = {r: [line for line in lines if line.startswith(f"rank {r}:")] for r in "01"}
        return all(len(v) > count and v[-1].rstrip().endswith(ending)
                   for v in per_rank.values())

    return done


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_server_prompt_reuse_over_a_pipeline_equals_one_process(tmp_path):
    """`mlx.launch -n 2 -- -m mlx_v41.server --pipeline` (plain decoding, tiny checkpoint): the
    replies (greedy; seeded sampling with a penalty and a stop string) are one process's,
    with the same prompt reuse (`cached_tokens`) under a byte bound that evicts: every rank
    logs the same reused prefix for every request (rank 0 decides for all). A client that
    disconnects mid-stream cancels on every rank (the next reply is still one process's);
    logprobs are refused under a pipeline (rank 0 holds no logits); Ctrl-C on rank 0 stops
    every rank. With
    --prompt-cache-dir every rank wrote its share of each kept entry, and a restarted group
    loads them and reuses them on every rank."""
    import http.client
    import signal

    from server_harness import LiveServer, post, tiny

    greedy = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5,
              "temperature": 0}
    sampled = {**greedy, "temperature": 0.8, "seed": 3, "repetition_penalty": 1.3,
               "max_tokens": 8, "stop": ["ll"]}
    other = {**greedy, "messages": [{"role": "user", "content": "Bye now"}]}
    bodies = (greedy, sampled, other, greedy)  # the last: Hello's entry was evicted
    one = LiveServer(*tiny(), cache_bytes=SERVER_CACHE_BYTES)
    try:
        expected = [post(one.port, "/v1/chat/completions", body)[1] for body in bodies]
    finally:
        one.close()
    cached = [e["usage"]["prompt_tokens_details"]["cached_tokens"] for e in expected]
    assert cached[0] == 0 and cached[1] == expected[1]["usage"]["prompt_tokens"] - 1
    assert 0 < cached[3] < cached[1]  # the scenario evicts (the template's start is reused)
    port, folder = _free_ports(1)[0], tmp_path / "prompts"
    flags = ["--model", golden_checkpoint("tiny"), "--port", port, "--pipeline", "--log-level",
             "DEBUG", "--prompt-cache-bytes", SERVER_CACHE_BYTES, "--prompt-cache-dir", folder]
    server = Launched(2, "-m", "mlx_v41.server", *flags)
    try:
        _wait_for_health(server, port)
        for k, (body, want) in enumerate(zip(bodies, expected)):
            status, got = post(port, "/v1/chat/completions", body)
            assert status == 200, got
            assert (got["choices"], got["usage"]) == (want["choices"], want["usage"])
            server.read_until(_logged(k + 1))
        assert _reuse_lines(server.err) == {0: cached, 1: cached}
        # Between requests rank 1 sleeps: inside MLX's ring collective it would poll its
        # socket for the whole wait (2.2 CPU seconds in these 3 s, measured; 0.11 asleep).
        assert _cpu_seconds_over(_rank_pid(server.proc.pid, 1), 3.0) < 0.6
        # a streamed reply whose client goes away after its first event
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/v1/chat/completions",
                     json.dumps({**greedy, "max_tokens": 400, "stream": True}))
        assert conn.getresponse().read(6) == b"data: "
        conn.close()
        status, got = post(port, "/v1/chat/completions", sampled)
        assert status == 200 and got["choices"] == expected[1]["choices"], got
        # The dropped reply may have been cancelled before it started (e.g. while the worker
        # still wrote the last entry to --prompt-cache-dir): then no rank logs it. Wait for the
        # sampled reply's line, the last one whatever happened to the dropped one.
        server.read_until(_logged_after(len(bodies), "8 generated, length"))
        reuse = _reuse_lines(server.err)
        assert reuse[0] == reuse[1], reuse
        status, got = post(port, "/v1/chat/completions", {**greedy, "logprobs": True})
        assert status == 400 and "logprobs are not available under --pipeline" in \
            got["error"]["message"]
        os.kill(_rank_pid(server.proc.pid, 0), signal.SIGINT)  # uvicorn's graceful stop
        assert server.proc.wait(timeout=30) == 0, server.err  # rank 1 told, not lost
    finally:
        server.kill()
    # the entries kept, each as a file per rank; a restarted group loads them and reuses
    names = sorted(p.name for p in folder.iterdir())
    assert names and sorted(n for n in names if ".rank" not in n) == \
        sorted(n[:-len(".rank1-of-2")] for n in names if n.endswith(".rank1-of-2")), names
    server = Launched(2, "-m", "mlx_v41.server", *flags)
    try:
        _wait_for_health(server, port)
        status, got = post(port, "/v1/chat/completions", greedy)
        assert status == 200 and got["choices"] == expected[0]["choices"], got
        prompt = got["usage"]["prompt_tokens"]
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt - 1
        server.read_until(_logged(1))
        assert _reuse_lines(server.err) == {0: [prompt - 1], 1: [prompt - 1]}
    finally:
        server.kill()


class _ThreadLink:
    """Two ranks' `Link.all_sum` between two threads (a barrier and a sum); `check(total)`
    runs once both ranks have met, before either goes on."""

    def __init__(self, check):
        import threading

        self.values, self.check = [None, None], check
        self.barrier = threading.Barrier(2)

    def rank(self, rank: int):
        import types

        import mlx.core as mx

        def all_sum(x, what):
            self.values[rank] = np.array(x)
            self.barrier.wait(timeout=10)
            total = self.values[0] + self.values[1]
            if rank == 0:
                self.check(total)
            self.barrier.wait(timeout=10)
            return mx.array(total)

        return types.SimpleNamespace(rank=rank, all_sum=all_sum)


def test_idle_ranks_agree_on_every_interval():
    """`IdleWait` on two ranks: at every empty tick both have counted the same ticks, so they
    sleep the same interval, also after work rank 0 took and dropped unsent (a request
    cancelled before it started); the line rank 0 then shares reaches the other."""
    import queue
    import threading

    from mlx_v41.distributed.lines import IDLE, IdleWait

    mismatches = []

    def check(total) -> None:  # at each empty tick: the ticks each rank has counted
        if total.tolist() == [IDLE] and rank0.ticks != other.ticks:
            mismatches.append((rank0.ticks, other.ticks))

    link = _ThreadLink(check)
    rank0, other = IdleWait(link.rank(0)), IdleWait(link.rank(1))
    script = iter([None, None, None, "dropped", None, None, "hello"])  # None: nothing yet

    def get(timeout):
        item = next(script)
        if item is None:
            time.sleep(timeout)
            raise queue.Empty
        return item

    got = []
    follower = threading.Thread(target=lambda: got.append(other.line()))
    follower.start()
    assert rank0.wait(get) == "dropped"
    assert rank0.share(rank0.wait(get)) == "hello"
    follower.join(timeout=10)
    assert got == ["hello"] and not mismatches, mismatches
    assert rank0.ticks == other.ticks == 0


@pytest.mark.slow
def test_a_rank_lost_between_requests_fails_the_next_request(tmp_path):
    """A group server without a launcher (which would end rank 0 too): rank 1 killed while
    the server waits for work. Rank 0 notices at its next idle tick, logs it, and goes on
    serving: the next request gets the lost rank as its error, at once (were the tick to end
    rank 0's worker, it would never be answered)."""
    import signal

    from server_harness import post

    port = _free_ports(1)[0]
    procs = by_hand(tmp_path, "-m", "mlx_v41.server", "--model", golden_checkpoint("tiny"),
                    "--port", port, "--pipeline", "--log-level", "WARNING")
    try:
        body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3}
        deadline = time.monotonic() + TIMEOUT
        while True:
            assert procs[0].poll() is None and time.monotonic() < deadline
            try:
                status, got = post(port, "/v1/chat/completions", body, timeout=30)
                if status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.3)
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait(timeout=30)
        time.sleep(1.0)  # ticks every 100 ms at most: one has failed by now
        status, got = post(port, "/v1/chat/completions", body, timeout=30)
        assert status == 500 and "lost rank 1" in got["error"]["message"], (status, got)
        assert procs[0].poll() is None
    finally:
        for proc in procs:
            proc.kill()
    err = procs[0].communicate()[1]
    assert "ERROR rank 0: lost rank 1 while sharing an input line" in err, err


DSPARK_WORKER = Path(__file__).with_name("dspark_ranks_worker.py")


@functools.lru_cache(maxsize=1)
def dspark_one_process() -> tuple:
    """The tiny prompt, its plain greedy continuation and one process's DSpark runs."""
    from dspark_ranks_worker import STEPS, greedy_dspark
    from distributed_worker import prompt

    checkpoint = golden_checkpoint("tiny")
    ids = prompt(checkpoint)
    plain = load_model(checkpoint, dspark=False)
    cache = plain.make_cache()
    logits = plain(ids, cache, last_only=True)
    truth = []
    for _ in range(STEPS + 5):
        token = int(np.argmax(np.array(logits[0, -1])))
        truth.append(token)
        logits = plain(np.array([[token]], np.int32), cache)
    one = load_model(checkpoint, dspark=True)
    expected = {"drafter": greedy_dspark(one, ids), "oracle": greedy_dspark(one, ids, truth, 2),
                "sampled": greedy_dspark(one, ids, sampled=True)}
    return ids.shape[1], truth, expected


@pytest.mark.slow
@pytest.mark.parametrize("split", ["10", "tensor"])
def test_dspark_across_ranks_equals_one_process(tmp_path, split):
    """Tiny over 2 ranks. Split at 10: target layer 9's taps come from rank 0, 10 and 11's are
    rank 1's, and the drafter (rank 1) drafts; tensor parallel: every rank drafts with its
    half of the drafter's heads and experts. Greedy DSpark yields plain greedy's tokens (the
    model's drafter, then an oracle that gets 2 of 5 drafts right, so accepted drafts and
    partial trims happen), every cache entry ends at the same offset on both ranks, and the
    drafter's rings hold one process's rows bit for bit. Sampled DSpark (temperature 1, a
    seed) yields one process's tokens, acceptances and rejections, and leaves every rank's
    random state where one process's is (checked by breaking it: a rank that takes one more
    key per cycle fails)."""
    from dspark_ranks_worker import STEPS

    rows, truth, expected = dspark_one_process()
    result = launch(2, DSPARK_WORKER, golden_checkpoint("tiny"), split, tmp_path,
                    "--truth", ",".join(map(str, truth)), "--right", "2")
    assert (tmp_path / "rank1.json").is_file(), result.stdout + result.stderr
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert expected["oracle"]["accepted"] > 0
    sampled = expected["sampled"]
    assert 0 < sampled["accepted"] < sampled["cycles"] and sampled["tokens"] != truth[:STEPS]
    for name, want in expected.items():
        for report in ranks:
            got = report[name]
            assert got["tokens"] == want["tokens"], name
            assert (got["accepted"], got["cycles"]) == (want["accepted"], want["cycles"]), name
            assert got["offsets"] == [rows + STEPS] * len(want["offsets"]), name
            assert got["state"] == want["state"], name
        for report in ranks[1:] if split != "tensor" else ranks:  # the ranks that draft
            assert report[name]["rings"] == want["rings"], name
        assert name == "sampled" or want["tokens"] == truth[:STEPS]


def test_dspark_pipeline_shares():
    """Loaded as rank 0 or 1 of 2 (split 10, no collective runs): only the last rank holds
    the drafter (and, for it, the embedding) and the logits; every rank keeps one ring slot
    per stage; greedy and sampled DSpark settings are accepted."""
    from types import SimpleNamespace

    from mlx_v41.distributed.pipeline import PipelinePlacement
    from mlx_v41.generation.speculative import Sampling, check_draft_settings

    def share(rank):
        link = SimpleNamespace(rank=rank, size=2)
        return load_model(golden_checkpoint("tiny"), dspark=True, vision=False,
                          placement=PipelinePlacement(link, "10"))

    first, last = share(0), share(1)
    assert "dspark" not in first and "dspark" in last and "embed_tokens" in last.model
    assert first.drafting and last.drafting
    assert not first.group.has_logits and last.group.has_logits
    cfg = first.cfg
    assert len(first.make_cache()) == len(last.make_cache()) == \
        cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    for model in (first, last):
        for sampling in (Sampling(), Sampling(temp=0.8)):
            assert check_draft_settings(model, sampling, 5) == sampling
