"""convert(): check the input and the settings, plan every output file, then write them one by
one into `<mlx-path>.partial` (resuming finished ones) and rename it into place."""

from __future__ import annotations

import errno
import io
import json
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
from tqdm import tqdm

from mlx_v41.checkpoint.converted import MANIFEST
from mlx_v41.checkpoint.for_mlx_lm import (ENTRY_FILE, ENTRY_SOURCE, entry_config,
                                           entry_tokenizer_config)
from mlx_v41.checkpoint.streaming import AUTO, plan_experts, working_set
from mlx_v41.model.engram_hash import EngramHasher, build_token_map
from mlx_v41.model.memory import human_bytes, recipe_bytes

from .plan import Plan, make_plan
from .recipes import make_recipe
from .source import ConvertError, Source, resolve
from .writer import Workspace, file_digest, write_atomic, write_file

DEFAULT_SHARD_SIZE = 5 * 10**9  # bytes per output file (mlx-lm's default)
TOKEN_MAP = "engram/token_map.npy"
INDEX = "model.safetensors.index.json"
TOKENIZER_CONFIG = "tokenizer_config.json"


def convert(hf_path, mlx_path="mlx_model", *, quantize: bool = False,
            q_bits: Optional[int] = None, q_group_size: Optional[int] = None,
            q_mode: str = "affine", quant_predicate: Optional[str] = None,
            dtype: Optional[str] = None, drop_vision: bool = False, drop_dspark: bool = False,
            shard_size: int = DEFAULT_SHARD_SIZE, revision: Optional[str] = None,
            dry_run: bool = False, progress: bool = True,
            log: Callable[[str], None] = print) -> Path:
    """Convert a published DeepSeek V4.1 Flash checkpoint into an MLX model folder.

    Args:
        hf_path: local folder in the published layout, or a Hugging Face repo id.
        mlx_path: output folder; must not exist or be empty. Work happens in the sibling
            `<mlx_path>.partial`, renamed into place at the end; re-running the same command
            after an interruption resumes there.
        quantize, q_bits, q_group_size, q_mode: requantize every quantized module (mlx-lm's
            names and defaults); the default keeps the official FP8/FP4 precision bit-exactly.
        quant_predicate: a mixed preset ("mixed_3_8": routed experts at 3 bits in q_mode,
            the rest at the official 8-bit FP8); implies quantize.
        dtype: storage dtype of the BF16 float tensors ("bfloat16", "float16", "float32").
        drop_vision, drop_dspark: leave out the vision tower (otherwise kept verbatim in
            extras/) / the DSpark drafter (otherwise converted with the recipe, like the
            backbone, into dspark-*.safetensors).
        shard_size: bytes per output file.
        revision: Hub revision (repo ids only).
        dry_run: check and plan only; print the sizes, write nothing.
        progress: show a tqdm progress bar over bytes.
        log: receives one line per message.
    Returns:
        The output folder.
    Raises:
        ConvertError, mlx_v41.CheckpointError, mlx_v41.ConfigError: bad input or settings,
            with a one-line message; nothing is left at `mlx_path`.
    """
    out = Path(mlx_path).expanduser()
    _check_output(out)
    if shard_size < 1:
        raise ConvertError(f"the shard size must be positive, got {shard_size}")
    keep = {g for g, dropped in (("vision", drop_vision), ("dspark", drop_dspark)) if not dropped}
    source = Source(resolve(str(hf_path), revision, keep), keep)
    token_map = _token_map(source)
    recipe = make_recipe(source.skeleton(), quantize, q_bits, q_group_size, q_mode,
                         quant_predicate, dtype)
    plan = make_plan(source, recipe, shard_size)
    for line in _summary(source, plan, out):
        log(line)
    if dry_run:
        return out
    start = time.monotonic()
    work = Workspace(out, plan.fingerprint)
    _write_all(work, source, plan, progress, log)
    _finish(work, source, plan, token_map, str(hf_path), revision)
    log(f"done: {out} ({_human(plan.sizes()['total'])}) in {time.monotonic() - start:.1f} s")
    return out


def _check_output(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConvertError(f"{out} already exists and is not empty; choose another --mlx-path "
                           "or remove it")


def _token_map(source: Source) -> Optional[np.ndarray]:
    """The Engram compressed token map (official inference/engram.py L17–61), built from
    tokenizer.json now so that loading needs no tokenizer work; checked against the config
    before anything is written."""
    cfg = source.args.text_config
    if not cfg.engram_layer_ids:
        return None
    tokenizer = source.folder / "tokenizer.json"
    fallback = source.folder / "engram_token_map.json"
    try:
        if tokenizer.is_file():
            token_map = build_token_map(tokenizer, cfg.engram_compressed_vocab_size)
        elif fallback.is_file():
            token_map = np.array(json.loads(fallback.read_text()), dtype=np.int32)
        else:
            raise ConvertError(f"{source.folder}: the Engram token map needs tokenizer.json")
        EngramHasher.from_config(cfg, token_map)
    except ConvertError:
        raise
    except Exception as e:  # tokenizers raises bare Exceptions on a bad file
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConvertError(f"{tokenizer}: {first}") from None
    return token_map.astype(np.int32)


def _write_all(work: Workspace, source: Source, plan: Plan, progress: bool, log) -> None:
    planned = {f.name: f.size for f in plan.files}
    total = sum(planned.values())
    name = None
    try:
        with tqdm(desc="verify", unit="B", unit_scale=True, leave=False,
                  disable=not progress or not work.path.exists()) as bar:
            reused = work.open(planned, bar.update)
        if reused:
            log(f"resuming {work.path}: {len(reused)} of {len(planned)} files already written "
                "and verified")
        done = sum(planned[n] for n in reused)
        work.check_space(total - done)
        with tqdm(total=total, initial=done, desc="convert", unit="B", unit_scale=True,
                  disable=not progress) as bar:
            for f in plan.files:
                if f.name not in reused:
                    name = f.name
                    work.record(f.name, write_file(work.path / f.name, f, source, bar.update))
    except OSError as e:
        raise _write_error(e, work, name) from None


def _write_error(e: OSError, work: Workspace, name: Optional[str]) -> ConvertError:
    """One line; an unfinished folder is kept only when it holds finished files to resume."""
    finished = len(work.manifest["files"])
    where = work.path / name if name else work.path
    what = "no space left on device" if e.errno == errno.ENOSPC else (e.strerror or str(e))
    if finished == 0:
        work.discard()
        return ConvertError(f"{what} while writing {where}; nothing was kept")
    return ConvertError(f"{what} while writing {where}; the {finished} finished files stay in "
                        f"{work.path}: fix this and re-run the same command to resume")


def _finish(work: Workspace, source: Source, plan: Plan, token_map, hf_path, revision) -> None:
    """The small files (config, index, tokenizer, token map, README), then the final rename."""
    files = dict(_small_files(source, plan, token_map))
    try:
        for name, data in files.items():
            path = work.path / name
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, data)
            work.manifest["files"][name] = {"bytes": len(data),
                                            "sha256": file_digest(path, lambda n: None)}
        work.finish(_manifest_fields(source, plan, token_map, hf_path, revision))
    except OSError as e:
        raise _write_error(e, work, None) from None


def _small_files(source: Source, plan: Plan, token_map):
    config = dict(source.config)
    config["quantization"] = plan.quantization
    config["quantization_config"] = plan.quantization  # as mlx-lm writes it
    yield "config.json", json.dumps(entry_config(config), indent=2).encode()
    weights = plan.group("model-") + plan.group("dspark-")
    index = {"metadata": {"total_size": sum(t.nbytes for f in weights for t in f.tensors),
                          "format": "mlx"},
             "weight_map": {t.name: f.name for f in weights for t in f.tensors}}
    yield INDEX, json.dumps(index, indent=2).encode()
    for path in source.tokenizer_files() + [source.folder / "LICENSE"]:
        if path.is_file() and path.name != TOKENIZER_CONFIG:
            yield path.name, path.read_bytes()
    yield from _mlx_lm_entry(source)
    if token_map is not None:
        buffer = io.BytesIO()
        np.save(buffer, token_map)
        yield TOKEN_MAP, buffer.getvalue()
    yield "README.md", _readme(source, plan).encode()


def _mlx_lm_entry(source: Source):
    """The files mlx-lm's commands load the folder through (mlx_v41.checkpoint.for_mlx_lm):
    the entry module, and tokenizer_config.json naming its tokenizer class."""
    yield ENTRY_FILE, ENTRY_SOURCE.encode()
    if (source.folder / "tokenizer.json").is_file():
        tokenizer_config = source.folder / TOKENIZER_CONFIG
        yield TOKENIZER_CONFIG, entry_tokenizer_config(
            tokenizer_config.read_bytes() if tokenizer_config.is_file() else None)


def _manifest_fields(source: Source, plan: Plan, token_map, hf_path, revision) -> dict:
    dropped = {}
    for reason in plan.dropped.values():
        dropped[reason] = dropped.get(reason, 0) + 1
    return {
        "source": {"path": hf_path, "revision": revision, "folder": str(source.folder)},
        "recipe": {**plan.recipe.describe(), "quantization": plan.quantization},
        "sizes": plan.sizes(),
        "weights": [f.name for f in plan.group("model-")],
        "dspark": [f.name for f in plan.group("dspark-")],  # empty: the drafter is absent
        "engram": {"tables": plan.tables,
                   "token_map": TOKEN_MAP if token_map is not None else None},
        "extras": {g: [f.name for f in plan.group(f"extras/{g}")]
                   for g in sorted(set(source.extras.values()))},
        "dropped": dropped,
    }


def _summary(source: Source, plan: Plan, out: Path) -> list:
    recipe, sizes = plan.recipe, plan.sizes()
    requantized = recipe.describe()["requantized_modules"]
    lines = [f"mlx_v41.convert: {source.folder} -> {out}",
             f"recipe {recipe.name}: {requantized} of {len(recipe.layouts)} quantized modules "
             f"requantized, the rest as published (mxfp8 / mxfp4); float tensors "
             f"{recipe.dtype or 'as stored'}"]
    if recipe.kept_official:
        lines.append(f"  {len(recipe.kept_official)} modules kept as published: their input "
                     f"width is not a multiple of the group size (e.g. {recipe.kept_official[0]})")
    extras = ", ".join(sorted(set(source.extras.values()))) or "none"
    drafter = _human(sizes["dspark"]) if source.has_dspark else "left out"
    lines.append(f"output: {len(plan.files)} files, {_human(sizes['total'])} = weights "
                 f"{_human(sizes['weights'])} + DSpark drafter {drafter} + Engram tables "
                 f"{_human(sizes['engram_tables'])} + extras ({extras}) "
                 f"{_human(sizes['extras'])}")
    return lines + _memory_lines(source, plan)


def _memory_lines(source: Source, plan: Plan) -> list:
    """The output's weights as a load holds them, and what `expert_memory="auto"` makes of
    them on this machine (docs/memory.md)."""
    sizes = recipe_bytes(source.args, plan.recipe.name, plan.quantization)
    lines = [f"memory: {human_bytes(sizes.resident)} resident + routed experts "
             f"{human_bytes(sizes.experts)} ({human_bytes(sizes.expert)} each; the text model "
             "without the drafter and the vision tower)"]
    try:
        auto = plan_experts(AUTO, sizes.experts, sizes.resident, sizes.minimum,
                            source.args.text_config, working_set())
    except ValueError as e:
        return lines + [f"this machine: {e}"]
    return lines + [f"this machine: {auto.line()}"]


def _readme(source: Source, plan: Plan) -> str:
    sizes, recipe = plan.sizes(), plan.recipe
    return "\n".join([
        "# DeepSeek V4.1 Flash for mlx_v41", "",
        f"Converted by `mlx_v41.convert` from `{source.folder.name}` with recipe "
        f"**{recipe.name}** (float tensors: {recipe.dtype or 'as stored'}).", "",
        "```python", "import mlx_v41", "model = mlx_v41.load_model(\"path/to/this/folder\")",
        "```", "",
        f"mlx-lm's commands run it through `{ENTRY_FILE}` (mlx_v41 installed): "
        "`mlx_lm.generate --model path/to/this/folder --trust-remote-code -p \"Hello\"`, "
        "likewise `mlx_lm.chat` and `mlx_lm.server`.", "",
        f"* weights: {_human(sizes['weights'])} in `model-*.safetensors` (layouts in "
        "config.json `quantization`, mlx-lm's form)",
        f"* DSpark drafter: {_human(sizes['dspark'])} in `dspark-*.safetensors` (same "
        "recipe; `load_model(path, dspark=True)`)" if source.has_dspark else
        "* DSpark drafter: left out (`load_model(path, dspark=True)` refuses this folder)",
        f"* Engram tables: {_human(sizes['engram_tables'])} in `engram/` (packed FP8 rows + "
        "E8M0 scales, memory-mapped at load), token map `engram/token_map.npy`",
        f"* extras: {_human(sizes['extras'])} in `extras/` (the vision tower, verbatim BF16 "
        "under its published names; `load_model` reads it unless `vision=False`)",
        f"* every file with its size and sha256: `{MANIFEST}`", ""])


def _human(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
