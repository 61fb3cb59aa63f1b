"""V4.1's vision tower: preprocessing, the ViT, the aligner, image spans in the prompt."""

from .aligner import Aligner
from .preprocess import ImageError, ImageGrid, PreparedImage, load_image, plan_image_grid, \
    prepare_image
from .prompt import ImagePrompt, has_vision, image_rows, prepare_prompt
from .spans import ImageInputs, expand_spans, span_types
from .vit import VisionTransformer

__all__ = ["Aligner", "ImageError", "ImageGrid", "ImageInputs", "ImagePrompt", "PreparedImage",
           "VisionTransformer", "expand_spans", "has_vision", "image_rows", "load_image",
           "plan_image_grid", "prepare_image", "prepare_prompt", "span_types"]
