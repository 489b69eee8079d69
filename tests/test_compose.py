"""docker-compose.yml, the Dockerfile and the provisioning agree with each other and with the CLI.

No Docker engine runs here: Debian's docker-compose 1.29 validates the file against the Compose
specification (`config` needs no engine); the rest is checked by reading the files.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from phaselens.cli import build_parser
from phaselens.dashboards import generate
from phaselens.dashboards.datasource import DEFAULT_PORTS

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
PINNED = re.compile(r"^[\w./-]+:\d+(\.\d+)+(-[\w.]+)?$")  # name:1.2[.3…], never latest
NO_HEALTHCHECK = {"otel-collector": "distroless image: no shell or HTTP client to probe with"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _services(compose: dict) -> dict:
    return compose["services"]


def _one_shot(service: dict) -> bool:
    return service.get("restart") == "no"


@pytest.mark.parametrize("profile", [[], ["--profile", "gpu"]])
def test_docker_compose_validates(profile):
    exe = shutil.which("docker-compose")
    assert exe, "docker-compose 1.29 is needed to validate the compose file: apt-get install -y docker-compose"
    proc = subprocess.run(
        [exe, "-f", str(COMPOSE), *profile, "config", "-q"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr


def test_images_pinned(compose):
    for name, svc in _services(compose).items():
        assert PINNED.match(svc["image"]), f"{name}: image {svc['image']!r} is not pinned to a version"


def test_mounted_files_exist(compose):
    for name, svc in _services(compose).items():
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (ROOT / source).exists(), f"{name} mounts {source}, which is not in the repo"
            else:
                assert source in compose["volumes"], f"{name}: {source} is not a named volume"


def test_long_running_services_do_not_run_as_root(compose):
    for name, svc in _services(compose).items():
        if not _one_shot(svc):
            assert str(svc.get("user", "")).split(":")[0] not in {"0", "root"}, f"{name} runs as root"


def test_ports_loopback_and_documented(compose):
    header = COMPOSE.read_text().split("services:")[0]
    documented = set(re.findall(r"^#\s+(\d+)\s+\S", header, re.MULTILINE))
    for name, svc in _services(compose).items():
        for port in svc.get("ports", []):
            host_ip, host_port, _ = port.split(":")
            assert host_ip == "127.0.0.1", f"{name} publishes {port} beyond loopback"
            assert host_port in documented, f"{name}: port {host_port} is not documented in the header"


def test_healthchecks_and_dependencies(compose):
    services = _services(compose)
    for name, svc in services.items():
        if not _one_shot(svc) and name not in NO_HEALTHCHECK:
            assert "healthcheck" in svc, f"long-running {name} has no healthcheck"
        for dep, cond in svc.get("depends_on", {}).items():
            target = services[dep]
            expected = (
                "service_completed_successfully"
                if _one_shot(target)
                else "service_healthy"
                if "healthcheck" in target
                else "service_started"
            )
            assert cond["condition"] == expected, f"{name} → {dep}: {cond}"
            assert set(svc.get("profiles", [])) >= set(target.get("profiles", [])), f"{name} → {dep} profile"


def test_phaselens_commands_parse_with_the_real_cli(compose):
    parser = build_parser()
    commands = {
        name: svc["command"] for name, svc in _services(compose).items() if svc["image"].startswith("phaselens:")
    }
    assert {"schema", "server", "bench", "server-gpu", "bench-gpu"} <= set(commands)
    for name, argv in commands.items():
        args = parser.parse_args([re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", a) for a in argv])
        assert callable(args.func), name
    assert "--device" not in commands["server"]
    gpu = commands["server-gpu"]
    assert gpu[gpu.index("--device") + 1] == "cuda"


def test_gpu_profile_reserves_a_gpu_and_builds_cuda_torch(compose):
    svc = _services(compose)["server-gpu"]
    assert svc["profiles"] == ["gpu"]
    device = svc["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert svc["build"]["args"]["TORCH_INDEX"].startswith("cu")
    assert _services(compose)["server"]["build"]["args"]["TORCH_INDEX"] == "cpu"


def test_servers_send_otlp_to_the_collector(compose):
    for name in ("server", "bench", "server-gpu", "bench-gpu"):
        env = _services(compose)[name]["environment"]
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317", name
        assert env["OTEL_SERVICE_NAME"]


def test_grafana_provisioning_matches_compose(compose):
    grafana = _services(compose)["grafana"]
    mounts = dict(v.split(":")[:2] for v in grafana["volumes"])
    assert mounts["./dashboards/generated"] == generate.GRAFANA_DASHBOARDS_PATH
    assert mounts["./dashboards/provisioning/dashboards"] == "/etc/grafana/provisioning/dashboards"
    assert mounts["./dashboards/provisioning/datasources"] == "/etc/grafana/provisioning/datasources"
    providers = yaml.safe_load((ROOT / "dashboards" / generate.PROVIDERS_YAML).read_text())
    assert providers["providers"][0]["options"]["path"] == generate.GRAFANA_DASHBOARDS_PATH
    ds = yaml.safe_load((ROOT / "dashboards" / generate.DATASOURCES_YAML).read_text())["datasources"][0]
    assert ds["jsonData"]["host"] in _services(compose)
    assert ds["jsonData"]["port"] == DEFAULT_PORTS[ds["jsonData"]["protocol"]]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (ROOT / "dashboards/generated" / Path(home).name).is_file()
    plugin, _, version = grafana["environment"]["GF_PLUGINS_PREINSTALL_SYNC"].partition("@")
    assert plugin == ds["type"] and re.fullmatch(r"\d+\.\d+\.\d+", version)


def test_collector_config_is_mounted_and_targets_clickhouse(compose):
    svc = _services(compose)["otel-collector"]
    source, target = svc["volumes"][0].split(":")[:2]
    assert any(arg == f"--config={target}" for arg in svc["command"])
    assert "clickhouse:" in (ROOT / source).read_text()


def test_dockerfile_and_dockerignore():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim$", text, re.MULTILINE)
    assert re.search(r"^ARG TORCH_INDEX=cpu$", text, re.MULTILINE)
    assert "download.pytorch.org/whl/${TORCH_INDEX}" in text
    assert re.search(r'^ENTRYPOINT \["phaselens"\]$', text, re.MULTILINE)
    assert re.search(r"^USER \w+", text, re.MULTILINE), "the image should not run as root"
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".venv", ".git"} <= ignored
    assert not {"README.md", "pyproject.toml", "setup.py"} & ignored  # `pip install .` needs them
    runs = [shlex.split(cmd) for cmd in text.replace("\\\n", " ").splitlines() if cmd.startswith("RUN ")]
    torch = next(i for i, cmd in enumerate(runs) if "--index-url" in cmd)
    project = next(i for i, cmd in enumerate(runs) if "pip" in cmd and "." in cmd)  # `pip install .`
    assert torch < project  # torch from the PyTorch index, before the project
    assert "gcc" in runs[project]  # the collector's C decoder compiles during `pip install .`
    assert "**/*.so" in ignored  # a decoder built here must not stand in for the image's own
