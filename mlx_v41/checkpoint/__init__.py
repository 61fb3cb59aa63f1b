"""Weights in: safetensors reading, the rename/drop table and strict load of the published
layout, converted folders (and mlx-lm's entry into them), the demo checkpoint and where a model
comes from (folder, demo, Hub).
"""
