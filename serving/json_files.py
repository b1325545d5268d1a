"""A checkpoint folder's JSON files (config.json, tokenizer_config.json, generation_config.json, the safetensors
index, preprocessor_config.json), read in one place so that a damaged one is a ``ValueError`` naming the file, its
line and column, not a bare ``JSONDecodeError`` or an ``AttributeError`` from the first ``.get`` on a list."""

import json
from pathlib import Path
from typing import Any


def read_json(path: str | Path, *, missing: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON object in ``path``; ``missing`` where the file does not exist, if given (else FileNotFoundError).
    A file that is not UTF-8 JSON, or holds another value than an object, is a ValueError naming it."""
    path = Path(path)
    if missing is not None and not path.is_file():
        return missing
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a JSON {type(value).__name__}: expected an object")
    return value
