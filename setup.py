"""The collector's OTLP → RowBinary decoder (collectors/render.py), a C extension: it needs a C
compiler and the Python headers. Everything else is in pyproject.toml; the extension is declared
here because pyproject's `[tool.setuptools] ext-modules` is still experimental."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "phaselens.collectors._otlp_rows",
            ["collectors/_otlp_rows.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-missing-field-initializers"],
        )
    ]
)
