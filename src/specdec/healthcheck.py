"""Exit 0 when the local tritonserver is ready (`python -m specdec.healthcheck`): the image's HEALTHCHECK.

Ready means /v2/health/ready answers 200, which with --strict-readiness means every model is loaded.
The port comes from HTTP_PORT (default 8000).
"""

from __future__ import annotations

import os
import sys
import urllib.request


def main() -> int:
    url = f"http://127.0.0.1:{os.environ.get('HTTP_PORT', '8000')}/v2/health/ready"
    try:
        with urllib.request.urlopen(url, timeout=4) as response:
            return 0 if response.status == 200 else 1
    except OSError as exc:
        print(f"not ready: {url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
