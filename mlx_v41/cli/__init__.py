"""Command-line entry points (argparse only): generate, chat, inspect, demo.
"""
