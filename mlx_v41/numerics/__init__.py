"""The reference's arithmetic, the bottom of the stack: FP8/FP4 formats and rounding, the FP8
activation rounding, RoPE, RMSNorm's summation order and the mHC mixes. Imports nothing else of
the package."""
