"""Reading local data files (JSONL, JSON, Parquet) into rows, with errors that name the file and line.

Every data reader of the project (math prompts, coding problems, benchmarks, ``mugrpo score``'s
responses) goes through ``read_rows``, so a malformed line is reported the same way everywhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatron_mugrpo.errors import InputError


class PromptDataError(InputError, ValueError):
    """A data file cannot be read or has no usable row; the message names the file and the line or fields."""


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a local .jsonl / .json / .parquet file.

    JSONL is parsed here, line by line, so a malformed line is reported with its number; .json and
    .parquet go through the `datasets` library.
    """
    path = Path(path)
    builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(path.suffix)
    if builder is None:
        raise PromptDataError(f"{path}: unsupported file type {path.suffix!r}; use .jsonl, .json or .parquet")
    if not path.is_file():
        raise PromptDataError(f"{path} does not exist")
    if path.stat().st_size == 0:
        raise PromptDataError(f"{path} is empty: expected one JSON object (or table row) per problem")
    if path.suffix == ".jsonl":
        return read_jsonl(path)
    from datasets import load_dataset

    try:
        dataset = load_dataset(builder, data_files=str(path), split="train")
    except Exception as exc:  # datasets raises many types for malformed files
        raise PromptDataError(f"{path} could not be read as {builder}: {str(exc) or type(exc).__name__}") from exc
    return list(dataset)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """One JSON object per non-blank line; a bad line is an error naming the file and line number."""
    rows = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:  # JSONDecodeError, or UnicodeDecodeError from the file
                raise PromptDataError(f"{path}:{number}: not a JSON object ({exc}); fix or delete that line") from exc
            if not isinstance(row, dict):
                raise PromptDataError(
                    f"{path}:{number}: expected a JSON object with the problem and answer fields, "
                    f"got {type(row).__name__}"
                )
            rows.append(row)
    if not rows:
        raise PromptDataError(f"{path} holds only blank lines: expected one JSON object per problem")
    return rows
