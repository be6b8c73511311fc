"""Exit 0 when the local tritonserver is ready (`python -m specdec.serving.healthcheck`): the image's HEALTHCHECK.

Ready means /v2/health/ready answers 200, which with --strict-readiness means every model is loaded.
The port comes from HTTP_PORT (default 8000).
"""

from __future__ import annotations

import os
import sys
import urllib.request


def ready_url(http_port: int, host: str = "127.0.0.1") -> str:
    return f"http://{host}:{http_port}/v2/health/ready"


def is_ready(http_port: int, timeout_s: float = 4.0) -> bool:
    """True when the server on http_port reports ready; any failure to answer is 'not ready'."""
    try:
        with urllib.request.urlopen(ready_url(http_port), timeout=timeout_s) as response:
            return response.status == 200
    except OSError:
        return False


def main() -> int:
    port = int(os.environ.get("HTTP_PORT", "8000"))
    if is_ready(port):
        return 0
    print(f"not ready: {ready_url(port)}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
