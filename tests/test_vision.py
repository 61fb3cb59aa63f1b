"""The vision golden, stage by stage: token layout and patches exact; the ViT and the aligner
within a bf16 tolerance; the merge exact; the LLM on the golden's own aligner rows (`bias_vl`
routing, Engram's dead spans) against the reference, and the whole chain by statistics.

The official vision.py is unpublished: the golden's tower is a third-party reconstruction
(tests/data/vision/README.md). Its ViT runs torch's CPU attention kernel, ours MLX's, so after
one block about 40 % of the bf16 values differ by an ulp or more (relative error 3e-3); the
README's independent fp32 implementation lands at 6e-3 on `vit_out`, as ours does. The text
model downstream is chaotic (see test_golden.py): the aligner's 0.7 % difference moves late
logits by O(1), so the LLM is checked on the golden's own rows, the chain statistically.
"""

import hashlib

import mlx.core as mx
import numpy as np
import pytest

import mlx_v41
from conftest import reference_ops
from mlx_v41.model.engram import engram_rows
from mlx_v41.model.vision import ImageInputs, prepare_prompt
from mlx_v41.model.vision.prompt import delimiters
from vision_fixtures import IMAGES, manifest, prompt_before_expansion, reference, \
    vision_checkpoint

pytestmark = pytest.mark.usefixtures("cpu")

EXACT = 2e-2  # as in test_golden.py


def rel(a, b) -> float:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.linalg.norm(a - b) / mx.linalg.norm(b)).item()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return vision_checkpoint(tmp_path_factory.mktemp("vision") / "hf")


@pytest.fixture(scope="module")
def model(folder):
    return reference_ops(mlx_v41.load_model(folder))


@pytest.fixture(scope="module")
def ref():
    return reference()


@pytest.fixture(scope="module")
def prompt(model):
    return prepare_prompt(model, prompt_before_expansion(), IMAGES)


def golden_rows(ref) -> mx.array:
    return mx.concatenate([ref["image.0.aligner_out"], ref["image.1.aligner_out"]])


def run(model, prompt, images, **kwargs):
    captured = {}
    logits = model(mx.array([prompt.ids]), images=images, capture=captured, **kwargs)[0]
    return logits, captured


@pytest.fixture(scope="module")
def golden_run(model, prompt, ref):
    """The prefill on the golden's aligner rows."""
    return run(model, prompt, ImageInputs(prompt.token_types, golden_rows(ref)))


def test_token_layout(prompt, ref):
    assert prompt.ids == ref["prompt_ids"].tolist()
    assert np.array_equal(prompt.token_types, np.array(ref["token_types"]))
    images = manifest()["vision"]["images"]
    assert prompt.starts == [image["span_start"] for image in images]
    assert [p.grid.span_tokens for p in prompt.images] == [i["span_tokens"] for i in images]


def test_patches_exact(prompt, ref):
    for k, image in enumerate(prompt.images):
        patches = image.patches
        digest = hashlib.sha256(np.array(patches.view(mx.uint16)).tobytes()).hexdigest()
        assert mx.array_equal(patches[:16], ref[f"image.{k}.patches_head"]).item()
        assert digest == manifest()["patches_sha256"][k]


# Measured: block 0 3.0e-3 / 3.1e-3, vit_out 5.6e-3 / 6.3e-3 (images 0 / 1); a wrong RoPE
# axis order or layout gives 0.5-0.9 on block 0's update.
@pytest.mark.slow
def test_vit(model, prompt, ref):
    for k, image in enumerate(prompt.images):
        captured = {}
        out = model.vision(image.patches, image.grid.vit_h, image.grid.vit_w, captured)
        assert rel(captured["vit.blocks.0.out"], ref[f"image.{k}.vit.blocks.0.out"]) <= 5e-3
        assert rel(out, ref[f"image.{k}.vit_out"]) <= 1e-2


def test_attention_blocks_change_no_bits(model, prompt):
    """Query blocks (forced small here) compute every row as one call does."""
    image = prompt.images[0]
    grid = image.grid
    whole = model.vision(image.patches, grid.vit_h, grid.vit_w, block=grid.vit_h * grid.vit_w)
    blocked = model.vision(image.patches, grid.vit_h, grid.vit_w, block=333)
    assert mx.array_equal(whole, blocked).item()


# Measured: on the golden's vit_out 1e-5 / 1.8e-4; after our ViT 6.9e-3 / 7.5e-3.
@pytest.mark.slow
def test_aligner(model, prompt, ref):
    for k, image in enumerate(prompt.images):
        grid = image.grid
        mine = model.aligner(ref[f"image.{k}.vit_out"], grid.vit_h, grid.vit_w)
        assert mine.shape == (grid.llm_h * grid.llm_w, model.cfg.hidden_size)
        assert rel(mine, ref[f"image.{k}.aligner_out"]) <= 1e-3
        chained = model.aligner(model.vision(image.patches, grid.vit_h, grid.vit_w),
                                grid.vit_h, grid.vit_w)
        assert rel(chained, ref[f"image.{k}.aligner_out"]) <= 1.5e-2


def test_merge_exact(model, prompt, ref):
    images = ImageInputs(prompt.token_types, golden_rows(ref))
    merged = images.merge(model.model.embed_tokens(mx.array([prompt.ids])), delimiters(model))
    assert mx.array_equal(merged[0], ref["merged_embeds"]).item()


def test_routing_at_image_positions(golden_run, ref):
    """Layers 0 and 1 choose the reference's experts at every position, image positions
    (with `bias_vl`) included; layer 1 reads Engram's write, which must skip the spans."""
    captured = golden_run[1]
    for layer in (0, 1):
        mine = np.array(captured[f"layers.{layer}.gate.indices"][0])
        theirs = np.array(ref[f"prefill.layers.{layer}.gate.indices"])
        assert all(set(a) == set(b) for a, b in zip(mine, theirs)), layer


# Measured: 16 of 421 positions past 2e-2, one window after an ulp event in attention.
def test_layer0_exact_regime(golden_run, ref):
    mine = golden_run[1]["layers.0.out"][0].astype(mx.float32)
    err = np.array(mx.abs(mine - ref["prefill.layers.0.out_all"]).max(axis=(1, 2)))
    assert (err > EXACT).mean() <= 0.06, np.nonzero(err > EXACT)[0]


# Measured on the golden's rows: mean |dlogit| 0.40, argmax agreement 0.73 (tiny's text
# golden: 0.27 / 0.81); through our tower: 0.98 / 0.39.
@pytest.mark.slow
def test_prompt_logits(model, prompt, ref, golden_run):
    expected = ref["prefill.logits_all"].astype(mx.float32)
    for logits, mean_bound, agree_bound in ((golden_run[0], 0.55, 0.65),
                                            (run(model, prompt, prompt.inputs(model))[0],
                                             1.25, 0.3)):
        assert mx.abs(logits - expected).max(axis=1)[:2].max().item() <= EXACT
        assert mx.abs(logits - expected).mean().item() <= mean_bound
        agree = (np.array(logits.argmax(-1)) == np.array(expected.argmax(-1))).mean()
        assert agree >= agree_bound


# Measured: 8 / 8 (fixed) and 7 / 8 (ref) teacher-forced decode argmaxes agree.
@pytest.mark.parametrize("mode,min_agree", [("fixed", 7), ("ref", 6)])
@pytest.mark.slow
def test_decode_after_images(folder, prompt, ref, mode, min_agree):
    model = reference_ops(mlx_v41.load_model(folder,
                                             compat_reference_index_k_bug=(mode == "ref")))
    cache = model.make_cache()
    model(mx.array([prompt.ids]), cache=cache,
          images=ImageInputs(prompt.token_types, golden_rows(ref)), last_only=True)
    steps = ref[f"decode_{mode}.input_ids"]
    logits = mx.stack([model(steps[s:s + 1][None], cache=cache)[0, 0]
                       for s in range(steps.shape[0])])
    agree = (np.array(logits.argmax(-1)) == np.array(ref[f"decode_{mode}.argmax"])).sum()
    assert agree >= min_agree


def test_engram_hash_dead_spans(model, prompt, ref):
    """The lazy hash over ragged chunks, image positions DEAD, equals the reference's rows; the
    same ids without the mask do not."""
    ids = mx.array([prompt.ids])
    mask = mx.array(prompt.token_types >= 0)[None]
    layers = model.cfg.engram_layer_ids
    for masked in (True, False):
        cache, rows = model.make_cache(), []
        for a, b in ((0, 30), (30, 101), (101, 250), (250, ids.shape[1])):  # cuts inside spans
            rows.append(engram_rows(model.engram_hasher, layers, ids[:, a:b], cache,
                                    mask[:, a:b] if masked else None))
        same = mx.array_equal(mx.concatenate(rows, axis=1)[0], ref["prefill.engram_hash"])
        assert same.item() == masked


@pytest.mark.slow
def test_bias_vl_only_at_image_positions(model, prompt, ref, golden_run):
    """Selecting with `bias` instead of `bias_vl` changes layer 0's experts at image positions
    and nowhere else, and nothing at all before the first span."""
    images = ImageInputs(prompt.token_types, golden_rows(ref))
    gates = [layer.mlp.gate for layer in model.model.layers]
    saved = [g.bias_vl for g in gates]
    try:
        for g in gates:
            g.bias_vl = g.e_score_correction_bias
        swapped = run(model, prompt, images)[1]
    finally:
        for g, bias_vl in zip(gates, saved):
            g.bias_vl = bias_vl
    base = golden_run[1]
    changed = [np.any(np.sort(np.array(swapped[f"layers.{L}.gate.indices"][0]), -1)
                      != np.sort(np.array(base[f"layers.{L}.gate.indices"][0]), -1), -1)
               for L in range(len(gates))]
    is_image = prompt.token_types >= 0
    assert changed[0][is_image].mean() > 0.2 and not changed[0][~is_image].any()
    first = prompt.starts[0]
    assert not any(c[:first].any() for c in changed)
