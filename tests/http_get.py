"""One HTTP GET as the tests read the launcher's and Triton's endpoints: (status, body), never raising."""

import urllib.error
import urllib.request


def get(url: str, timeout_s: float = 10.0) -> tuple[int, str]:
    """(status, body); an error status with its body; (0, the error) when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, str(exc)
