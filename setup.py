"""Package layout: the repository keeps kernels/ and migrations/ at the top level, the wheel
installs them inside the app package (app.kernels, app.migrations) so nothing generic lands at
the top of site-packages. Everything else is declared in pyproject.toml."""

from setuptools import find_packages, setup

MAPPED = {
    "app.kernels": "kernels", "app.migrations": "migrations", "app.migrations.versions": "migrations/versions",
    # the guest header and examples: `tensorwasm new` copies the header from here
    "app.examples": "examples",
}

setup(
    packages=find_packages(include=["app", "app.*"]) + list(MAPPED),
    package_dir=MAPPED,
)
