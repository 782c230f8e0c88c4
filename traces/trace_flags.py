"""Trace flags shared by the commands that read trace files (``hawk simulate``, ``compare``,
``replay``), importing nothing heavy until a value is given: a command's parser is built
before its first event, and the loaders come later."""

from __future__ import annotations

import argparse


def add_columns_arg(p: argparse.ArgumentParser) -> None:
    """``--columns``: which columns of a csv/jsonl/parquet trace hold arrival and lengths."""

    def columns(text: str):
        from traces.formats import ColumnMapping

        try:
            return ColumnMapping.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    p.add_argument("--columns", type=columns, metavar="FIELD=COLUMN,...",
                   help="columns of a csv/jsonl/parquet trace (default arrival_at, "
                   "num_prompt_tokens, num_output_tokens, seconds), e.g. "
                   "arrival_at=ts,num_prompt_tokens=in,num_output_tokens=out,time_unit=ms")
