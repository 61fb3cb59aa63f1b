"""Image preprocessing and span layout: the spec's resize-plan table, odd aspect ratios, tiny
images, mode conversion, every input form, and one-line errors for bad input."""

import base64
import io

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from mlx_v41.model.config import VisionConfig
from mlx_v41.model.vision import ImageError, expand_spans, load_image, plan_image_grid, \
    prepare_image
from mlx_v41.model.vision.preprocess import image_reference
from vision_fixtures import IMAGES

CFG = VisionConfig()  # the released values

# (W, H) -> (best_w, best_h, vit_h, vit_w, llm_h, llm_w, span tokens): the spec's test vectors.
TABLE = {
    (100, 100): (546, 546, 39, 39, 13, 13, 184),
    (544, 544): (546, 546, 39, 39, 13, 13, 184),
    (640, 480): (644, 490, 35, 46, 12, 16, 206),
    (1024, 768): (1036, 770, 55, 74, 19, 25, 496),
    (1344, 1344): (1302, 1302, 93, 93, 31, 31, 994),
    (1920, 1080): (1708, 966, 69, 122, 23, 41, 968),
    (4000, 3000): (1512, 1134, 81, 108, 27, 36, 1001),
    (3000, 100): (3010, 112, 8, 215, 3, 72, 221),
    (100, 3000): (112, 3010, 215, 8, 72, 3, 290),
    # Derived by hand: x25.934 gives 518.68 x 570.55, truncated to 518 (= 37 patches; rounding
    # would give 519 -> 532) x 570 (-> 574).
    (20, 22): (518, 574, 41, 37, 14, 13, 198),
}


def normalized(value: int) -> float:
    """A pixel value after the reference's normalisation, rounded to bf16."""
    return mx.array((value / 255 - 0.5) / 0.5).astype(mx.bfloat16).item()


@pytest.mark.parametrize("size", sorted(TABLE))
def test_plan_table(size):
    g = plan_image_grid(*size, CFG)
    assert (g.width, g.height, g.vit_h, g.vit_w, g.llm_h, g.llm_w, g.span_tokens) == TABLE[size]


@pytest.mark.parametrize("size", [(1, 1), (2, 3), (100000, 10), (10, 100000), (5000, 4999),
                                  (545, 543), (1345, 1343), (42882, 42)])
def test_plan_limits(size):
    """Every plan fits 1024 positions on whole patches; the most extreme ratios hit the
    one-row (1 x 1021 cells) and one-column (511 x 1) layouts of exactly 1024."""
    g = plan_image_grid(*size, CFG)
    assert g.span_tokens <= CFG.max_image_tokens
    assert (g.width, g.height) == (g.vit_w * 14, g.vit_h * 14)
    assert (g.llm_h, g.llm_w) == (-(-g.vit_h // 3), -(-g.vit_w // 3))
    if size[0] >= 50 * size[1]:
        assert (g.llm_h, g.llm_w, g.span_tokens) == (1, 1021, 1024)
    if size[1] >= 50 * size[0]:
        assert (g.llm_h, g.llm_w, g.span_tokens) == (511, 1, 1024)


@pytest.mark.parametrize("size", [(3000, 100), (100, 3000)])
def test_odd_aspect_ratios(size):
    """The image keeps its aspect inside the padded size; the bars are the grey (127) pad."""
    image = Image.new("RGB", size, (250, 0, 0))
    prepared = prepare_image(image, CFG)
    g = prepared.grid
    assert prepared.patches.shape == (g.vit_h * g.vit_w, 588)
    pixels = np.array(prepared.patches.reshape(g.vit_h, g.vit_w, 3, 14, 14)
                      .transpose(2, 0, 3, 1, 4).reshape(3, g.height, g.width).astype(mx.float32))
    grey, red = normalized(127), normalized(250)
    if size[0] < size[1]:  # tall: bars left and right, so look at columns
        pixels = pixels.transpose(0, 2, 1)
    assert np.all(pixels[:, 0] == grey) and np.all(pixels[:, -1] == grey)
    assert np.all(pixels[0, pixels.shape[1] // 2] == red)


def test_tiny_image():
    prepared = prepare_image(Image.new("RGB", (1, 1), (10, 200, 30)), CFG)
    assert prepared.patches.shape == (39 * 39, 588)
    values = np.array(prepared.patches.astype(mx.float32)).reshape(-1, 3, 196)
    assert np.all(values[:, 1] == normalized(200))  # scaled up to 546 x 546, no bars


@pytest.mark.parametrize("mode,pixel,rgb", [("L", 77, (77, 77, 77)),
                                            ("RGBA", (200, 10, 20, 0), (200, 10, 20)),
                                            ("P", 1, (5, 250, 9))])
def test_modes_become_rgb(mode, pixel, rgb):
    """Grayscale, RGBA (alpha dropped, not composited) and palette images become RGB."""
    image = Image.new(mode, (546, 546), pixel)
    if mode == "P":
        image.putpalette([0, 0, 0, 5, 250, 9] + [0] * 762)
    values = np.array(prepare_image(image, CFG).patches.astype(mx.float32)).reshape(-1, 3, 196)
    for channel, value in enumerate(rgb):
        assert np.all(values[:, channel] == normalized(value))


def test_input_forms_agree(tmp_path):
    """A path, bytes, a data URI, a PIL image and chat blocks all decode to the same patches."""
    data = IMAGES[1].read_bytes()
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    forms = [IMAGES[1], str(IMAGES[1]), data, uri, Image.open(io.BytesIO(data)),
             {"type": "image", "image": str(IMAGES[1])},
             {"type": "image_url", "image_url": {"url": uri}}, image_reference(data)]
    first = prepare_image(forms[0], CFG)
    for form in forms[1:]:
        again = prepare_image(form, CFG)
        assert mx.array_equal(again.patches, first.patches).item()
        assert again.sha256 == first.sha256
    other = prepare_image(IMAGES[0], CFG)
    assert other.sha256 != first.sha256


def test_bad_images(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("not an image")
    deep = tmp_path / ("folder" * 15) / "junk.png"  # a long path is named whole
    deep.parent.mkdir()
    deep.write_text("not an image")
    cases = [(text, "notes.txt: not a readable image"),
             (deep, f"{deep}: not a readable image"),
             (str(deep), f"{deep}: not a readable image"),
             ("data:image/png;base64," + "A" * 100, "data:image/png;base64,A+\\.\\.\\.:"),
             (tmp_path / "missing.png", "missing.png: cannot read the image file"),
             ("data:image/png;base64,@@@", "invalid base64"),
             (b"\x89PNG broken", "image bytes (11 bytes): not a readable image (unknown format)"),
             ("http://127.0.0.1:9/cat.png", "http://127.0.0.1:9/cat.png: cannot fetch"),
             ({"type": "image"}, "has no image"),
             (3.5, "cannot read an image from float")]
    for source, message in cases:
        with pytest.raises(ImageError, match=message.replace("(", r"\(").replace(")", r"\)")) \
                as error:
            load_image(source)
        assert "\n" not in str(error.value)


def test_span_layout_and_counts():
    grid = plan_image_grid(100, 40, CFG)           # scaled to 860 x 344 -> 868 x 350
    ids, types, starts = expand_spans([0, 7, 9, 7, 5], 7, [grid, grid])
    span = grid.span_tokens
    assert (grid.llm_h, grid.llm_w, span) == (9, 21, 9 * 22 + 2)
    assert ids == [0] + [7] * span + [9] + [7] * span + [5] and starts == [1, 2 + span]
    row = [1] * 21 + [2]
    assert types.tolist() == [-1] + [0] + row * 9 + [3] + [-1] + [0] + row * 9 + [3] + [-1]
    for images in ([grid], [grid] * 3):
        with pytest.raises(ValueError, match=rf"2 image placeholder\(s\).*{len(images)} image"):
            expand_spans([0, 7, 9, 7, 5], 7, images)
