"""The trainer. Importing any part of it first sets the target numba compiles the kernels for
(`train.codegen`), before numba makes its code generator."""
from train.codegen import configure_codegen

configure_codegen()
