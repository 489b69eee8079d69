"""The C extensions: the collector's OTLP → RowBinary decoder (collectors/render.py), the timeline's
per-token stamps (instrumentation/hotpath/timeline.py), the span builder's OTLP encoder (instrumentation/pipeline/otlp_fast.py) and its token gaps (phases.py), the
span shipper's frame packer (instrumentation/process/wire.py), the ingress middleware's send guard
(instrumentation/server/asgi.py), the vLLM plugin's per-output hooks (integrations/vllm/hooks.py); they
need a C compiler and the Python headers. Everything else is in pyproject.toml; the extensions are declared here because pyproject's `[tool.setuptools] ext-modules` is still experimental.

`phaselens.faults` (the fault-injection harness of tests/test_faults.py and benchmarks/faults.py) is
left out of built wheels: it is test support. The editable install (`setup.sh`) maps it from
pyproject's package list, so tests and benchmarks import it as before."""

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

TEST_SUPPORT = frozenset({"phaselens.faults"})


class build_py_without_test_support(build_py):
    """A wheel's build_py copies every package but the test support; an editable build (its
    `editable_mode`) keeps the full list, which its import finder maps to the folders."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if not self.editable_mode:
            self.packages = [p for p in self.packages if p not in TEST_SUPPORT]


setup(
    cmdclass={"build_py": build_py_without_test_support},
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
            depends=["instrumentation/hotpath/_timeline_core.h"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-missing-field-initializers"],
        ),
        Extension(
            "phaselens.instrumentation.pipeline._handoff",
            ["instrumentation/pipeline/_handoff.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-missing-field-initializers"],
        ),
        Extension(
            "phaselens.instrumentation.pipeline._token_gaps",
            ["instrumentation/pipeline/_token_gaps.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-missing-field-initializers"],
        ),
        Extension(
            "phaselens.instrumentation.server._send_guard",
            ["instrumentation/server/_send_guard.c"],
            depends=["instrumentation/hotpath/_timeline_core.h", "instrumentation/hotpath/_awaiting.h"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-missing-field-initializers"],
        ),
        Extension(
            "phaselens.integrations.vllm._outputs",
            ["integrations/vllm/_outputs.c"],
            depends=["instrumentation/hotpath/_timeline_core.h", "instrumentation/hotpath/_awaiting.h"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-missing-field-initializers"],
        ),
        Extension(
            "phaselens.instrumentation.process._wire_pack",
            ["instrumentation/process/_wire_pack.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-missing-field-initializers"],
        ),
    ],
)
