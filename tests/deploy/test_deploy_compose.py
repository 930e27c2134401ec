"""docker-compose.yml and the Dockerfile, checked without a Docker engine (CI has none).

* The compose file validates against the Compose Specification's JSON schema (the copy
  that the check-jsonschema package ships), then the semantics: every gpulet service
  runs the one image with the right subcommand, depends_on targets exist and can
  satisfy their condition, each service's NATS user and password match the NATS
  server's, every bind-mounted file exists, and the privileges are the DaemonSet's.
* The Dockerfile: multi-stage, non-root, ``gpulet`` as entrypoint (tests/image builds
  and runs it for real with IMAGE_TESTS=1); its build context
  (what .dockerignore admits) is enough to build gpulet's wheel, and that wheel holds
  the data files the containers need (mock scenarios, kubelet API stubs).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import zipfile
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from gpulet.cli import build_parser
from gpulet_common.mock_nvml.scenario import list_scenarios
from support.deploy import COMPOSE_FILE, NATS_USERS, ROOT, inbox_prefix, password_variable

GPULET_SERVICES = ("collector", "health", "reporter", "allocator", "device-plugin")
NOT_GPULET = {"nats", "k3s", "k3s-setup"}
NODE = "gpu-node-1"
_DEFAULT = re.compile(r"\$\{(?P<name>[A-Z0-9_]+)(?::-(?P<default>[^}]*))?\}")


def _compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(COMPOSE_FILE.read_text())
    return loaded


def _interpolate(value: str) -> str:
    """What `docker compose` makes of ``${VAR:-default}`` with VAR unset."""
    return _DEFAULT.sub(lambda m: m.group("default") or "", value)


def _gpulet_services() -> dict[str, dict[str, Any]]:
    return {n: s for n, s in _compose()["services"].items() if n not in NOT_GPULET}


def test_compose_file_matches_the_compose_specification() -> None:
    try:
        schema_file = (
            resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
        )
        schema = json.loads(schema_file.read_text())
    except ModuleNotFoundError:
        pytest.skip("the compose-spec schema comes from the check-jsonschema package (test extra)")
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(_compose()), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_every_variable_has_a_default() -> None:
    # `docker compose up` must work with no .env file; `$$` is an escaped dollar.
    text = COMPOSE_FILE.read_text().replace("$$", "")
    for match in re.finditer(r"\$\{[^}]*\}|\$[A-Za-z_]", text):
        found = _DEFAULT.fullmatch(match.group(0))
        assert found is not None, match.group(0)
        assert found.group("default"), match.group(0)


def test_services_run_the_one_image_with_their_subcommand() -> None:
    gpulet = _gpulet_services()
    assert set(GPULET_SERVICES) <= set(gpulet)
    assert {"alerts", "tools"} <= set(gpulet)
    assert len({s["image"] for s in gpulet.values()}) == 1
    commands = {"watch", "alerts", "serve"}
    parser = build_parser()
    for name, service in gpulet.items():
        command = service["command"]
        if name == "tools":
            assert service["entrypoint"] == []
            assert command[0] == "gpulet"
            continue
        assert "entrypoint" not in service, name  # the image's: gpulet
        assert command[0] in commands, name
        if name in GPULET_SERVICES:
            # What the image's entrypoint makes of the command: this service, run alone.
            args = parser.parse_args([_interpolate(a) for a in command])
            assert (args.command, args.service) == ("serve", name)
    for name in ("collector", "health"):
        nvml = [a for a in gpulet[name]["command"] if a.startswith("--nvml=")]
        scenario = _interpolate(nvml[0]).removeprefix("--nvml=mock:")
        assert scenario in set(list_scenarios())


def test_depends_on_targets_exist_and_can_meet_their_condition() -> None:
    compose = _compose()["services"]
    for name, service in compose.items():
        depends = service.get("depends_on", {})
        for target, spec in depends.items():
            assert target in compose, (name, target)
            condition = spec["condition"]
            if condition == "service_healthy":
                assert "healthcheck" in compose[target], (name, target)
            elif condition == "service_completed_successfully":
                assert compose[target].get("restart") == "no", (name, target)
    for name in _gpulet_services():
        assert "nats" in compose[name]["depends_on"], name


def test_nats_users_and_passwords_agree() -> None:
    compose = _compose()["services"]
    server_env = {k: _interpolate(v) for k, v in compose["nats"]["environment"].items()}
    assert set(server_env) == {password_variable(u) for u in NATS_USERS}
    for name, service in _gpulet_services().items():
        env = {k: _interpolate(str(v)) for k, v in service["environment"].items()}
        user = env["GPULET_NATS__USER"]
        assert user in NATS_USERS, name
        assert env["GPULET_NATS__PASSWORD"] == server_env[password_variable(user)], name
        assert env["GPULET_NATS__INBOX_PREFIX"] == inbox_prefix(user), name
        if name in GPULET_SERVICES or name == "alerts":
            assert user == name
            assert env.get("NODE_NAME") == NODE
    # The mock variant of the permissions: `gpulet mock inject` must reach the mocks.
    mounts = compose["nats"]["volumes"]
    assert "./deploy/nats/mock/auth.conf:/etc/nats/auth.conf:ro" in mounts
    assert "./deploy/nats/node.conf:/etc/nats/node.conf:ro" in mounts


def test_bind_mounted_files_exist() -> None:
    for name, service in _compose()["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("."):
                assert (ROOT / source).is_file(), (name, source)


def test_k3s_runs_the_node_that_the_services_report() -> None:
    compose = _compose()["services"]
    assert f"--node-name={NODE}" in compose["k3s"]["command"]
    manifests = [v for v in compose["k3s"]["volumes"] if "server/manifests" in v]
    assert {Path(m.split(":")[0]).name for m in manifests} == {
        "scheduling.koordinator.sh_devices.yaml",
        "namespace.yaml",
        "rbac.yaml",
    }
    reporter = compose["reporter"]
    assert reporter["environment"]["GPULET_REPORTER__MODE"] == "cluster"
    # The reporter sees its own kubeconfig only, not k3s's admin one.
    assert not any(v.startswith("kubeconfig:") for v in reporter["volumes"])
    assert "k3s-setup" in reporter["depends_on"]
    plugin = compose["device-plugin"]
    assert "device-plugins:/var/lib/kubelet/device-plugins" in plugin["volumes"]
    assert "device-plugins:/var/lib/kubelet/device-plugins" in compose["k3s"]["volumes"]


def test_containers_have_least_privilege() -> None:
    compose = _compose()["services"]
    for name, service in compose.items():
        if name in ("k3s", "k3s-setup"):
            continue
        assert service.get("read_only") is True, name
        assert service.get("cap_drop") == ["ALL"], name
        assert "no-new-privileges:true" in service.get("security_opt", []), name
        assert not service.get("privileged", False), name
        # Root only where kubelet's directory needs it.
        assert (service.get("user") == "0:0") == (name == "device-plugin"), name
    assert compose["k3s"]["privileged"] is True  # a kubelet in a container
    for name, service in compose.items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), (name, port)


# --- Dockerfile ------------------------------------------------------------------------


def _dockerfile() -> list[str]:
    lines = (ROOT / "Dockerfile").read_text().replace("\\\n", " ").splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def test_dockerfile_is_multi_stage_non_root_with_gpulet_entrypoint() -> None:
    lines = _dockerfile()
    stages = [ln for ln in lines if ln.startswith("FROM ")]
    # builder, the NATS sidecar, and gpulet last (the default target), all on the one
    # base image, python:3.11-slim unless the build names another.
    assert [s.split()[-1] for s in stages] == ["builder", "nats", "gpulet"]
    assert all(s.startswith("FROM ${BASE_IMAGE} AS ") for s in stages)
    assert "ARG BASE_IMAGE=python:3.11-slim" in lines[: lines.index(stages[0])]
    final = lines[lines.index(stages[-1]) :]
    assert "USER 65532:65532" in final
    assert 'ENTRYPOINT ["gpulet"]' in final
    assert any(ln.startswith("COPY --from=builder /opt/gpulet") for ln in final)
    # What gpulet runs with comes from the lock's export, every file's hash checked;
    # then gpulet's own wheel, without dependencies.
    locked = next(ln for ln in lines if "pip install" in ln and "requirements/all.txt" in ln)
    assert "--require-hashes" in locked
    install = next(ln for ln in lines if "pip install" in ln and "gpulet-*.whl" in ln)
    assert "--no-deps" in install


def _build_context(tmp_path: Path) -> Path:
    """The files .dockerignore admits: "*" then a few "!" entries, caches excluded."""
    rules = [
        ln.strip()
        for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    assert rules[0] == "*"
    admitted = [r[1:].rstrip("/") for r in rules if r.startswith("!")]
    ignored = [r.removeprefix("**/") for r in rules[1:] if not r.startswith("!")]
    context = tmp_path / "context"
    context.mkdir()
    for entry in admitted:
        source = ROOT / entry
        if source.is_dir():
            shutil.copytree(source, context / entry, ignore=shutil.ignore_patterns(*ignored))
        else:
            shutil.copy(source, context / entry)
    copied = [
        ln.split()[1] for ln in _dockerfile() if ln.startswith("COPY ") and "--from" not in ln
    ]
    for name in copied:
        assert (context / name.rstrip("/")).exists(), f"COPY {name} is not in the context"
    return context


@pytest.mark.slow
def test_image_build_context_builds_the_wheel_with_its_data_files(tmp_path: Path) -> None:
    context = _build_context(tmp_path)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--quiet",
            "--wheel-dir",
            str(tmp_path / "wheels"),
            str(context),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if (
        result.returncode != 0
        and "hatchling" in result.stderr
        and "No matching distribution" in result.stderr
    ):
        pytest.skip("pip cannot fetch hatchling (no package index): " + result.stderr[-300:])
    assert result.returncode == 0, result.stderr
    (wheel,) = (tmp_path / "wheels").glob("gpulet-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "gpulet/cli.py" in names
    for package in (
        "gpulet_common",
        "gpulet_collector",
        "gpulet_health",
        "gpulet_reporter",
        "gpulet_allocator",
    ):
        assert f"{package}/__init__.py" in names
    assert "gpulet_common/mock_nvml/scenarios/dgx-h100.toml" in names
    assert any(n.endswith("deviceplugin/v1beta1/api_pb2.py") for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "gpulet = gpulet.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
