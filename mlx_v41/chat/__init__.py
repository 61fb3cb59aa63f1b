"""The V4.1 chat format, the tokenizer wrapper and the multi-turn chat session.
"""
