"""Weights in: safetensors reading, the rename/drop table and strict load of the published
layout, converted folders, the demo checkpoint and where a model comes from (folder, demo, Hub).
"""
