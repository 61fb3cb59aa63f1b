"""The Metal simulator's kernel factories, and kernels made to fail for the self-check tests
(kernels/check.py: a kernel that does not compile or gives a wrong result on its probe is
replaced by its ops, with one RuntimeWarning naming the kernel and the reason).

* `sim`: the simulator, strict, outputs poisoned; `checked`: the same with races and coverage
  checked.
* `not_compiling(factory)`: a factory whose kernels' source does not compile
  (MetalCompileError).
* `returning(change, factory)`: a factory whose kernels run and return `change(outputs)`
  (KernelMismatch); `zeros` returns zeros.
* `warnings_of(build, ...)`: what `build(...)` returns and the messages of the warnings it
  raised (those of category RuntimeWarning, the self-check's, by default).
"""

from __future__ import annotations

import functools
import warnings

import mlx.core as mx

from tests.metal_sim import SimOptions, metal_kernel

sim = functools.partial(metal_kernel, options=SimOptions())
checked = functools.partial(metal_kernel, options=SimOptions(check_races=True,
                                                             check_coverage=True))


def not_compiling(factory=sim):
    """A kernel factory like `factory` whose kernels' source has a line that is not Metal."""
    def not_compiling(**spec):
        return factory(**{**spec, "source": spec["source"] + "\nthis is not Metal;"})
    return not_compiling


def returning(change, factory=sim, name: str | None = None):
    """A kernel factory like `factory` whose kernels run and return `change(outputs)` (named
    `name`, in test ids, or `change`'s name)."""
    def build(**spec):
        kernel = factory(**spec)
        return lambda **call: change(kernel(**call))
    build.__name__ = name or change.__name__
    return build


zeros = returning(lambda outputs: [mx.zeros_like(out) for out in outputs], name="zeros")


def warnings_of(build, *args, category=RuntimeWarning, **kwargs) -> tuple:
    """(`build(*args, **kwargs)`, the messages of the warnings of exactly `category` it raised;
    of every warning where `category` is None), none filtered as a repeat."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = build(*args, **kwargs)
    return result, [str(w.message) for w in caught
                    if category is None or w.category is category]
