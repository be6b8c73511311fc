"""What the benchmark scripts share: a description of the machine they ran on, their tables printed as
GitHub Markdown, and the dated result page a run can write under docs/results/."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys
from pathlib import Path

from tabulate import tabulate

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"


def cpu_name() -> str:
    """The CPU's model name (Linux), else the architecture."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def machine() -> str:
    """The machine in one line: its GPU where torch sees one, its CPU, cores, torch and Python."""
    import torch

    gpu = f"{torch.cuda.get_device_name()}, " if torch.cuda.is_available() else ""
    return (f"{gpu}{cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
            f"CPython {platform.python_version()}")


def table(rows: list, columns: list[str]) -> str:
    return tabulate(rows, columns, tablefmt="github", disable_numparse=True)


def print_table(header: str, rows: list, columns: list[str], out: str | None = None) -> str:
    """Print a benchmark's table under its header (which names the machine); with `out`, write it there
    too. Returns the text."""
    text = f"{header}\n\n{table(rows, columns)}"
    emit(text, out)
    return text


def emit(text: str, out: str | None = None) -> None:
    print(text)
    if out:
        Path(out).write_text(text + "\n")


def write_results(name: str, title: str, text: str, directory: Path = RESULTS) -> Path:
    """A dated result page, docs/results/YYYY-MM-DD-NAME.md: the title, the machine, the command that ran,
    then `text`. An existing page of the same day and name is replaced."""
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"--results wants a page name such as cpu-default-pair, got {name!r}")
    path = directory / f"{datetime.date.today().isoformat()}-{name}.md"
    command = shlex.join(["python", *sys.argv]) if sys.argv and sys.argv[0] else "python"
    path.write_text(f"# {title}\n\nMachine: {machine()}.\n\nCommand: `{command}`\n\n{text.strip()}\n")
    print(f"wrote {path}", file=sys.stderr)
    return path
