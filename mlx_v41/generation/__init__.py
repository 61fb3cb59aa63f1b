"""Generation in mlx-lm's conventions (prefill, decode steps, streams) and prompt reuse.
"""
