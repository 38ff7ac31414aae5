"""CUDA C kernels (guard + PCM conversion) and the small pycuda loader that runs them.

Importing this package touches no CUDA; see loader.py.
"""
