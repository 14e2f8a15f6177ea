"""Compute kernels: native AVX2/OpenMP code behind one dispatch (`ops`), torch as the reference.

Import `tokenmill.kernels.ops` to use them; this package itself loads nothing, so the install
step can import `build` without loading the extension first.
"""
