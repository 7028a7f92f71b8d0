"""TensorWasm: multi-tenant WebAssembly functions with guest-launched GPU kernels."""

__version__ = "0.1.0"
