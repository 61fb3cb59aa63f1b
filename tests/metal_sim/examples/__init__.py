"""Example Metal text for the simulator's own tests (read through importlib.resources, like
``mlx_v41.metal``). Not production kernels."""
