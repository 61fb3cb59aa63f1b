"""Nested pydantic models for the tests of schemas with `$ref`s into `$defs` (what every nested
model makes): an enum, a bounded integer, a short list of nested models, an optional short
string. No other keys are allowed, so a random model cannot write keys for ever."""

from __future__ import annotations

import enum
from typing import Optional

import pydantic


class Colour(str, enum.Enum):
    red = "red"
    green = "green"


class Point(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    x: int = pydantic.Field(ge=0, le=9)
    colour: Colour


class Place(pydantic.BaseModel):
    """A place: a nested model, a short list of them, an enum and an optional short
    string."""
    model_config = pydantic.ConfigDict(extra="forbid")
    centre: Point
    corners: list[Point] = pydantic.Field(max_length=2)
    label: Optional[str] = pydantic.Field(default=None, max_length=4)
