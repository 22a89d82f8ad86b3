"""`mirror_field`: a trainer-config field that mirrors a field of a settings dataclass (`SandboxArguments` mirrors
`SandboxLimits`, `ScaffoldArguments` mirrors `RLMScaffoldConfig`), so that each setting's default and help text
live in one place."""

from __future__ import annotations

from dataclasses import MISSING, field
from typing import Any

_SAME = object()


def mirror_field(source: type, name: str, label: str, *, default: Any = _SAME, note: str = "") -> Any:
    """A `dataclasses.field` with the default of ``source``'s field ``name`` (or ``default``) and its help text,
    prefixed with ``label`` (``"REPL sandbox: ..."``) and followed by ``note`` when given."""
    setting = source.__dataclass_fields__[name]
    if default is _SAME:
        if setting.default is MISSING:
            raise TypeError(f"{source.__name__}.{name} has no plain default; pass default= to mirror it.")
        default = setting.default
    help_text = f"{label}: {setting.metadata['help']}" + (f" {note}" if note else "")
    return field(default=default, metadata={"help": help_text})
