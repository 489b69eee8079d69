"""The C extensions: the collector's OTLP → RowBinary decoder (collectors/render.py), the timeline's
per-token stamps (instrumentation/hotpath/timeline.py), the span builder's OTLP encoder (instrumentation/pipeline/otlp_fast.py) and its token gaps (phases.py), the
span shipper's frame packer (instrumentation/process/wire.py); they
need a C compiler and the Python headers. Everything else is in pyproject.toml; the extensions are declared here because pyproject's `[tool.setuptools] ext-modules` is still experimental."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "phaselens.collectors._otlp_rows",
            ["collectors/_otlp_rows.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-missing-field-initializers"],
        ),
        Extension(
            "phaselens.instrumentation.pipeline._otlp_encode",
            ["instrumentation/pipeline/_otlp_encode.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-missing-field-initializers"],
        ),
        Extension(
            "phaselens.instrumentation.hotpath._stamps",
            ["instrumentation/hotpath/_stamps.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-missing-field-initializers"],
        ),
        Extension(
            "phaselens.instrumentation.pipeline._token_gaps",
            ["instrumentation/pipeline/_token_gaps.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-missing-field-initializers"],
        ),
        Extension(
            "phaselens.instrumentation.process._wire_pack",
            ["instrumentation/process/_wire_pack.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-missing-field-initializers"],
        ),
    ]
)
