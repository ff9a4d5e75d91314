"""The README's configuration table, generated from the pydantic fields of
:class:`sfi_vllm.config.SFIConfig` and its nested models (their defaults, constraints and
descriptions; "set per" is ``engine`` for the fields of :class:`sfi_vllm.config.EngineSettings`,
``request`` for those of :class:`sfi_vllm.config.Policy`), so the manual cannot drift from the code.

    sfi-vllm config --markdown             # print the table
    python -m sfi_vllm.tools.config_table README.md   # rewrite the table between the README's markers

``tests/test_packaging.py`` fails when the README's table differs from :func:`markdown_table`.
"""

from __future__ import annotations

import sys
import typing
from pathlib import Path
from typing import Any

BEGIN = "<!-- config-table:begin (generated: python -m sfi_vllm.tools.config_table README.md) -->"
END = "<!-- config-table:end -->"


def _allowed(field: Any) -> str:
    ann = field.annotation
    choices: list[str] = []
    kinds: list[str] = []
    union = typing.get_origin(ann) in (typing.Union, getattr(__import__("types"), "UnionType", None))
    for arg in typing.get_args(ann) if union else (ann,):
        if typing.get_origin(arg) is typing.Literal:
            choices += [str(a) for a in typing.get_args(arg)]
        elif arg is type(None):
            continue
        elif isinstance(arg, type):
            kinds.append({"int": "integer", "float": "number", "bool": "true / false", "str": "text"}.get(
                arg.__name__, arg.__name__))
        elif typing.get_origin(arg) is list:
            kinds.append("list of integers")
        elif typing.get_origin(arg) is typing.Annotated or hasattr(arg, "__metadata__"):
            kinds.append("integer >= 0")
    lo = hi = ""
    for m in field.metadata:
        if getattr(m, "ge", None) is not None:
            lo = f"{m.ge} <= "
        if getattr(m, "gt", None) is not None:
            lo = f"{m.gt} < "
        if getattr(m, "le", None) is not None:
            hi = f" <= {m.le}"
        if getattr(m, "lt", None) is not None:
            hi = f" < {m.lt}"
    parts = [" / ".join(f"`{c}`" for c in choices)] if choices else []
    if lo or hi:
        parts.append(f"{lo}x{hi}")
    elif kinds:
        parts.append(" or ".join(dict.fromkeys(kinds)))
    return ", ".join(parts)


def _default(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    return f"`{value}`"


def _rows(model: Any, prefix: str = "", outer_scope: str | None = None) -> list[str]:
    from sfi_vllm.config import engine_fields

    defaults = model()
    rows = []
    for name, field in model.model_fields.items():
        scope = outer_scope or ("engine" if name in engine_fields() else "request")
        sub = getattr(field.annotation, "model_fields", None)
        if sub is not None:
            rows += _rows(field.annotation, f"{prefix}{name}.", scope)
            continue
        desc = " ".join((field.description or "").split()).replace("|", "\\|")
        rows.append(f"| `{prefix}{name}` | {_default(getattr(defaults, name))} | {_allowed(field)} | {scope} | {desc} |")
    return rows


def markdown_table() -> str:
    from sfi_vllm.config import SFIConfig

    lines = ["| field | default | allowed | set per | meaning |", "|---|---|---|---|---|", *_rows(SFIConfig)]
    return "\n".join(lines) + "\n"


def replace_table(text: str) -> str:
    """``text`` with the block between :data:`BEGIN` and :data:`END` replaced by the table."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n" + markdown_table() + text[end:]


def readme_table(text: str) -> str:
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[start:end].strip("\n") + "\n"


if __name__ == "__main__":
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "README.md")
    path.write_text(replace_table(path.read_text()))
    print(f"updated the configuration table in {path}")
