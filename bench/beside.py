"""What other requests see while something else runs on the server: plain streamed requests (target-only)
and the gaps between their responses. Shared by `structured_bench.py --stall` (guides compiling) and
`prefix_bench.py --stall` (long prompts)."""

from __future__ import annotations

import threading
import time
from typing import Callable

from client import Client, GenerationParams

PLAIN_PROMPT = "Tell me a long story about a lighthouse keeper."


def _plain_stream(url: str, max_tokens: int, stop: threading.Event, gaps: list[float]) -> None:
    """One client sending plain streamed requests back to back until `stop`; each gap between two of a
    request's responses goes to `gaps` (seconds)."""
    client = Client(url, timeout_s=600)
    while not stop.is_set():
        last = None

        def seen(_delta):
            nonlocal last
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now

        client.generate(PLAIN_PROMPT, GenerationParams(max_tokens=max_tokens, num_draft_tokens=0, ignore_eos=True),
                        stream=True, on_text=seen)


def phase(url: str, streams: int, max_tokens: int, seconds: float,
          beside: Callable[[threading.Event], None] | None = None) -> list[float]:
    """`streams` plain streams for `seconds`, with `beside(stop)` running on a thread of its own until
    `stop` is set (None: the streams alone). Returns their response gaps in seconds, sorted."""
    stop, gaps = threading.Event(), []
    workers = [threading.Thread(target=_plain_stream, args=(url, max_tokens, stop, gaps)) for _ in range(streams)]
    if beside is not None:
        workers.append(threading.Thread(target=beside, args=(stop,)))
    for worker in workers:
        worker.start()
    time.sleep(seconds)
    stop.set()
    for worker in workers:
        worker.join()
    return sorted(gaps)


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0 < q < 1) of values, nearest rank below."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def gap_ms(gaps: list[float]) -> tuple[float, float, float]:
    """Median, p99 and max of gaps, in ms."""
    return percentile(gaps, 0.5) * 1e3, percentile(gaps, 0.99) * 1e3, max(gaps) * 1e3
