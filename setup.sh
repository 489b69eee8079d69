#!/usr/bin/env bash
# Sets up phaselens in ./.venv on a fresh machine. `--test` adds the test tools and two Debian
# packages the tests use: chromium (the HTML report renders) and docker-compose (validates the
# compose file; no Docker engine is needed for `config`).
set -euo pipefail
cd "$(dirname "$0")"
if ! command -v cc >/dev/null && ! command -v gcc >/dev/null; then
    echo "setup.sh: a C compiler is needed to build the collector's decoder (Debian: apt-get install gcc python3-dev)" >&2
    exit 1
fi
python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
# The CPU wheel of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
.venv/bin/pip install -q torch==2.13.0
if [[ "${1:-}" == "--test" ]]; then
    .venv/bin/pip install -q -e '.[test]'
    if ! command -v chromium >/dev/null || ! command -v docker-compose >/dev/null; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium docker-compose >/dev/null
    fi
else
    .venv/bin/pip install -q -e .
fi
