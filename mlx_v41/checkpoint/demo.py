"""The demo checkpoint: the reference's `tiny` shape (12 + 3 layers with every layer role,
Engram and DSpark, hidden 128), written once in the published layout to ~/.cache/mlx_v41/ with a
tiny byte-level BPE tokenizer trained here, the chat tokens at the ids its config uses. Its
weights are random, so its text is random: it shows the machinery, not a language model.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..chat import format as cf


DEMO_VERSION = 1  # bump when the demo checkpoint's recipe changes


VOCAB_SIZE = 512  # the tiny config's vocabulary


LEADING_SPECIALS = (cf.BOS, cf.EOS, cf.PAD)  # ids 0, 1, 2 as in the published vocabulary


# The chat tokens close the vocabulary (504-511): System is the DSpark noise id 504 and the
# image placeholder the image_token_id 511 of the tiny config, as in the published layout.
CHAT_SPECIALS = (cf.SYSTEM, cf.USER, cf.ASSISTANT, cf.THINK_START, cf.THINK_END, cf.DSML,
                 cf.LATEST_REMINDER, cf.IMAGE_PLACEHOLDER)


MARKER = "DEMO.txt"  # written last: a folder holding it is complete


CORPUS = """\
The quick brown fox jumps over the lazy dog. A model reads tokens and writes tokens.
DeepSeek V4.1 Flash runs in MLX on Apple silicon: attention, experts, memory and caches.
Hello! How are you today? I am fine, thank you. What is two plus two? Two plus two is four.
Please answer the question, then explain the reasoning step by step in a short paragraph.
The cache keeps the keys and values of every token, so the next turn only runs new tokens.
Sparse attention selects the blocks that matter; the window keeps the most recent tokens.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2026. Symbols: ( ) [ ] { } < > = + - * / , . ; :
Café, naïve, résumé, Zürich, über, façade, crème brûlée, 東京, 北京, こんにちは, 你好, 世界.
Thinking mode writes its reasoning first and closes it before the answer to the user.
A tiny random checkpoint has the right shapes and layout, but its weights mean nothing.
def main(): return print("hello world") if True else None  # code, strings and comments
Once upon a time there was a small program that wanted to talk with everyone it met.
"""


def demo_folder() -> Path:
    """Where the demo checkpoint lives: $XDG_CACHE_HOME (or ~/.cache)/mlx_v41/demo-v<N>."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "mlx_v41" / f"demo-v{DEMO_VERSION}"


def write_demo_tokenizer(folder) -> None:
    """Train a byte-level BPE tokenizer on CORPUS with the tokenizers library and write
    tokenizer.json / tokenizer_config.json: BOS/EOS/PAD at 0-2, merges, chat tokens at 504-511."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE - len(CHAT_SPECIALS),
                                  special_tokens=list(LEADING_SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer)
    tokenizer.add_special_tokens(list(CHAT_SPECIALS))
    expected = {t: i for i, t in enumerate(LEADING_SPECIALS)}
    expected.update({t: VOCAB_SIZE - len(CHAT_SPECIALS) + i for i, t in enumerate(CHAT_SPECIALS)})
    actual = {t: tokenizer.token_to_id(t) for t in expected}
    if actual != expected or tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"demo tokenizer: special ids {actual}, expected {expected}")
    folder = Path(folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"add_bos_token": False, "add_eos_token": False, "bos_token": cf.BOS,
              "eos_token": cf.EOS, "pad_token": cf.PAD, "clean_up_tokenization_spaces": False,
              "model_max_length": 1048576, "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2,
                                                             ensure_ascii=False))


def build_demo_checkpoint(folder) -> Path:
    """Write the demo checkpoint (tokenizer, config, shards) into `folder`."""
    from .random_checkpoint import tiny_text_config, write_checkpoint

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_demo_tokenizer(folder)
    write_checkpoint(folder, tiny_text_config())
    (folder / MARKER).write_text("A tiny random checkpoint made by mlx_v41.demo: its weights "
                                 "are random, so its text is random.\n")
    return folder


def ensure_demo_checkpoint(folder=None, rebuild: bool = False) -> Path:
    """The demo checkpoint folder, built on first use (atomically: concurrent first runs are
    safe)."""
    folder = Path(folder) if folder is not None else demo_folder()
    if (folder / MARKER).is_file() and not rebuild:
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = folder.parent / f".{folder.name}.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    build_demo_checkpoint(staging)
    if folder.exists() and (rebuild or not (folder / MARKER).is_file()):
        shutil.rmtree(folder, ignore_errors=True)
    try:
        staging.rename(folder)
    except OSError:  # another process finished first
        shutil.rmtree(staging, ignore_errors=True)
    return folder
