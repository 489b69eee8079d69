"""The vLLM general plugin (entry point `vllm.general_plugins: phaselens`; docs/vllm.md).

vLLM calls `register()` in each of its processes (API server, EngineCore, workers) when the plugin
is installed and allowed (`VLLM_PLUGINS` unset, or naming `phaselens`). It checks the vLLM version
and the shape of the classes it hooks (`compat.py`); on a match it wraps methods of the output
processor and of its per-request stream (`hooks.py`), otherwise it logs one line and leaves vLLM
exactly as it was.
"""

from __future__ import annotations

import logging

from . import compat

_logger = logging.getLogger("vllm.phaselens")  # vLLM's handlers print it in its log format


def register() -> bool:
    """Install the hooks; True when installed. Never raises: vLLM must start either way."""
    try:
        return _register()
    except Exception as e:  # noqa: BLE001 — an import error inside vLLM, a renamed module: not our server to break
        _logger.warning(
            "phaselens: vLLM plugin not installed (%s: %s); vLLM serves without phaselens spans", type(e).__name__, e
        )
        return False


def _register() -> bool:
    import vllm

    spec = compat.supported_range()
    problem = compat.version_problem(vllm.__version__, spec)
    if problem is None:
        from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector
        from vllm.v1.metrics.stats import RequestStateStats

        problem = compat.interface_problem(OutputProcessor, RequestStateStats, RequestOutputCollector)
    if problem is not None:
        _logger.warning(
            "phaselens: %s; the vLLM plugin stays off and vLLM serves unchanged "
            "(set %s to a range that includes it to try anyway)",
            problem,
            compat.ENV_SUPPORTED,
        )
        return False
    from . import hooks

    hooks.install(OutputProcessor, RequestOutputCollector)
    _logger.info(
        "phaselens: vLLM %s plugin installed (phaselens span tree per request, llm.engine_step per output batch)",
        vllm.__version__,
    )
    return True
