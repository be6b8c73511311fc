"""Exit 0 when the local tritonserver is ready (`python -m specdec.serving.healthcheck`): the image's
HEALTHCHECK and the chart's readiness probe.

Ready means /v2/health/ready answers 200 (with --strict-readiness: every model is loaded) and the server is
not draining: after SIGTERM the launcher raises a marker and lets the streams in flight finish, and
readiness must drop at once so that new requests go elsewhere. The port comes from HTTP_PORT (default 8000).
"""

from __future__ import annotations

import os
import sys
import tempfile
import urllib.request
from pathlib import Path


def ready_url(http_port: int, host: str = "127.0.0.1") -> str:
    return f"http://{host}:{http_port}/v2/health/ready"


def drain_marker(http_port: int) -> Path:
    """The file whose existence says the server on http_port is draining (written by the launcher)."""
    return Path(tempfile.gettempdir()) / f"specdec-draining-{http_port}"


def is_ready(http_port: int, timeout_s: float = 4.0) -> bool:
    """True when the server on http_port reports ready and is not draining; any failure to answer is
    'not ready'."""
    if drain_marker(http_port).exists():
        return False
    try:
        with urllib.request.urlopen(ready_url(http_port), timeout=timeout_s) as response:
            return response.status == 200
    except OSError:
        return False


def main() -> int:
    port = int(os.environ.get("HTTP_PORT", "8000"))
    if is_ready(port):
        return 0
    draining = " (draining)" if drain_marker(port).exists() else ""
    print(f"not ready{draining}: {ready_url(port)}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
