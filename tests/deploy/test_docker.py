"""docker/Dockerfile and docker/compose.yaml: hadolint clean and consistent with what the tests run.

No Docker engine runs here, so the image is checked statically: lint, the base image's Triton and the
interpreter against the ones the tests use, the install from the same requirement files as `make setup`,
and the container's command line parsed by the launcher it runs.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import yaml

from specdec.serving import launcher
from specdec.serving.pairs import REPO_ROOT

DOCKERFILE = REPO_ROOT / "docker" / "Dockerfile"
COMPOSE = REPO_ROOT / "docker" / "compose.yaml"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_hadolint_clean():
    hadolint = shutil.which("hadolint") or str(REPO_ROOT / ".venv" / "bin" / "hadolint")
    result = subprocess.run([hadolint, "--failure-threshold", "info", str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def base_image_release() -> str:
    """The NGC release (YY.MM) of the Dockerfile's tritonserver base image."""
    (base,) = [args for word, args in instructions() if word == "FROM"]
    match = re.fullmatch(r"nvcr\.io/nvidia/tritonserver:(\d\d\.\d\d)-py3", base)
    assert match, base
    return match.group(1)


def ngc_release(server_version: str) -> str:
    """The NGC release whose tritonserver reports this version: monthly releases, 2.51 = 24.10."""
    months = int(server_version.split(".")[1]) - 51 + 24 * 12 + 10 - 1
    return f"{months // 12:02d}.{months % 12 + 1:02d}"


def test_release_arithmetic():
    assert ngc_release("2.51.0") == "24.10" and ngc_release("2.53.0") == "24.12"
    assert ngc_release("2.54.0") == "25.01" and ngc_release("2.50.0") == "24.09"


def test_python_matches_the_tests_and_installs_the_setup_requirements():
    runs = " ".join(args for word, args in instructions() if word == "RUN")
    (version,) = re.findall(r"uv python install (\d+\.\d+\.\d+)", runs)
    assert version.rsplit(".", 1)[0] == f"{sys.version_info.major}.{sys.version_info.minor}"
    assert "pip install --no-cache-dir -r requirements.txt -c constraints.txt" in runs
    copies = [args for word, args in instructions() if word == "COPY"]
    assert "requirements.txt constraints.txt ./" in copies and "model_repository ./model_repository" in copies
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert "-r requirements.txt" in makefile and "-c constraints.txt" in makefile  # the same files


def test_runs_as_uid_1000_with_a_readiness_healthcheck():
    words = dict(instructions())
    assert words["USER"].split(":")[0] == "1000"
    assert '"specdec.serving.healthcheck"' in words["HEALTHCHECK"]


def test_container_command_is_one_the_launcher_accepts():
    entry = json.loads(dict(instructions())["ENTRYPOINT"])
    cmd = json.loads(dict(instructions())["CMD"])
    assert entry[:3] == ["python", "-m", "specdec.serving.launcher"]
    args = launcher.parse_args(entry[3:] + cmd)
    assert args.triton_root == "/opt/tritonserver" and args.target == "/models/target" and args.device == "gpu"
    assert "--model-control-mode=none" in args.server_args


def test_compose_reserves_a_gpu_and_shared_memory():
    service = yaml.safe_load(COMPOSE.read_text())["services"]["triton"]
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"] and device["count"] == 1
    assert service["shm_size"] and any(v.endswith(":/models:ro") for v in service["volumes"])
    assert service["read_only"] is True and service["healthcheck"]["test"][-1] == "specdec.serving.healthcheck"
    command = [re.sub(r"\$\{(\w+):-([^}]*)\}", r"\2", arg) for arg in service["command"]]
    args = launcher.parse_args(command)
    assert args.target == "/models/target" and args.draft == "/models/draft" and args.device == "gpu"


def test_dockerignore_keeps_the_build_context_small():
    ignored = (REPO_ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".cache" in ignored
