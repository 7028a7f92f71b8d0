"""The `std` kernel library: CUDA sources (std.cu) and their NumPy twins (std_numpy.py)."""
