"""The V4.1 network: config, layer schedule, blocks (attention, compressor, indexer, MoE, mHC,
Engram), the model wiring and the prefill strategies. Submodules are imported directly.
"""
