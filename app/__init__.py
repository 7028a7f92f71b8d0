"""TensorWasm: multi-tenant WebAssembly functions with guest-launched GPU kernels."""

from pathlib import Path

__version__ = "0.1.0"

# An installed wheel carries the std kernels and the migrations as app.kernels and app.migrations
# (setup.py maps them). A source checkout keeps them at the top level, as the layout fixes them:
# there, let this package's submodules be found next to it too.
_checkout = Path(__file__).resolve().parent.parent
if not (Path(__file__).parent / "kernels").is_dir() and (_checkout / "kernels" / "std.cu").is_file():
    __path__.append(str(_checkout))
