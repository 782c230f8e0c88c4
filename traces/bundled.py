"""Data shipped with the package: the real Azure 2023 traces, a sample of Mooncake's
conversation trace (with prefix block hashes) and the workloads' length tables.

The files live in ``traces/data/`` (sources and licences in its ``NOTICE.md``) and are package
data, so a fresh clone and an installed wheel both have them. ``data_path(name)`` is a bundled
file's path; ``resolve_trace(path)`` lets a trace argument name a bundled trace
(``hawk simulate --trace azure-llm-2023-conv.csv``) when no file exists where it points.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

#: bundled request traces (timestamps + token counts; the Mooncake one with ``hash_ids``, so
#: its prompts share prefixes), by file name
TRACES = ("azure-llm-2023-conv.csv", "azure-llm-2023-code.csv", "mooncake-conversation.jsonl")
#: bundled length tables (``input_tokens,output_tokens``), by file name
LENGTH_TABLES = ("sharegpt-chatbot-lengths.csv", "arxiv-summarization-lengths.csv")


def data_dir() -> Path:
    """The folder of the bundled files (``traces/data`` of the installed package)."""
    return Path(str(resources.files("traces").joinpath("data")))


def data_path(name: str) -> Path:
    """The path of bundled file ``name`` (one of ``TRACES`` or ``LENGTH_TABLES``)."""
    if name not in TRACES + LENGTH_TABLES:
        raise ValueError(f"{name!r} is not a bundled data file; bundled: "
                         f"{list(TRACES + LENGTH_TABLES)}")
    return data_dir() / name


def resolve_trace(path) -> Path:
    """``path``, or the bundled trace it names when it is a bare file name that does not exist.

    An existing file always wins, and a path with a folder is never redirected, so
    ``--trace runs/azure-llm-2023-conv.csv`` still fails plainly when that file is missing.
    The name may omit its suffix (``azure-llm-2023-conv``, ``mooncake-conversation``).
    """
    path = Path(path)
    if path.exists() or path.parent != Path("."):
        return path
    for name in TRACES:
        if path.name in (name, Path(name).stem):
            return data_path(name)
    return path
