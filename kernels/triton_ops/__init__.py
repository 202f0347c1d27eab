"""Triton GPU kernels, one op per file (`<op>_triton` entry points called by the wrappers in
kernels/<op>.py). Importing any of these modules imports triton: only the wrappers' CUDA branch
(and the interpreter tests) do. See kernels/_triton.py for availability and TRITON_INTERPRET."""
