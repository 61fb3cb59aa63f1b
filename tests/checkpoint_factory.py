"""Random checkpoints for tests: `mlx_v41.random_checkpoint`, with the goldens' tokenizer.

The generator lives in the package (the demo needs it installed); this wrapper gives
512-token checkpoints the tiny golden's tokenizer files (so their Engram token maps match the
goldens'). Everything else is imported from `mlx_v41.random_checkpoint` directly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from mlx_v41.checkpoint.random_checkpoint import tiny_text_config
from mlx_v41.checkpoint.random_checkpoint import write_checkpoint as _write_checkpoint

GOLDENS = Path(__file__).parent / "data" / "goldens"
TINY_HF = GOLDENS / "tiny" / "hf"
TOKENIZER_VOCAB = 512  # vocabulary of the goldens' synthetic tokenizer


def write_checkpoint(folder, text_config: Optional[dict] = None, **kwargs) -> Path:
    """`mlx_v41.checkpoint.random_checkpoint.write_checkpoint`; a 512-token vocabulary gets the tiny
    golden's tokenizer files unless `tokenizer_dir` is given."""
    vocab = (text_config or tiny_text_config())["vocab_size"]
    if vocab == TOKENIZER_VOCAB:
        kwargs.setdefault("tokenizer_dir", TINY_HF)
    return _write_checkpoint(folder, text_config, **kwargs)
