"""Config fields documented once: each field's help text (its ``metadata["help"]``) is its one doc.

- `mirror_field`: a field that mirrors a field of a settings dataclass (a trainer config's ``repl_<name>`` fields
  mirror `SandboxLimits`, its scaffold fields `RLMScaffoldConfig`), so that the setting's default and help text live
  in the settings class.
- `documented`: a field with its help text (and the section it is listed under).
- `document_fields`: a class decorator that writes the ``Parameters:`` section of a config's docstring from those
  help texts (the Hugging Face docstring layout), so the docstring and ``--help`` never disagree.
"""

from __future__ import annotations

from dataclasses import MISSING, field, fields
from typing import Any

__all__ = ["document_fields", "documented", "mirror_field"]

_SAME = object()


def documented(default: Any = MISSING, help: str = "", *, section: str | None = None, **kwargs: Any) -> Any:
    """A `dataclasses.field` whose one doc is ``help`` (``--help`` and the docstring's ``Parameters:`` section);
    ``section`` names the heading it is listed under; other keywords go to `dataclasses.field`."""
    metadata = {"help": help}
    if section:
        metadata["section"] = section
    if default is not MISSING:
        kwargs["default"] = default
    return field(metadata=metadata, **kwargs)


def mirror_field(
    source: type, name: str, label: str, *, default: Any = _SAME, note: str = "", section: str | None = None
) -> Any:
    """A `dataclasses.field` with the default of ``source``'s field ``name`` (or ``default``) and its help text,
    prefixed with ``label`` (``"REPL sandbox: ..."``) and followed by ``note`` when given."""
    setting = source.__dataclass_fields__[name]
    if default is _SAME:
        if setting.default is not MISSING:
            default = setting.default
        elif setting.default_factory is not MISSING:
            return documented(
                help=f"{label}: {setting.metadata['help']}" + (f" {note}" if note else ""),
                section=section,
                default_factory=setting.default_factory,
            )
        else:
            raise TypeError(f"{source.__name__}.{name} has no plain default; pass default= to mirror it.")
    help_text = f"{label}: {setting.metadata['help']}" + (f" {note}" if note else "")
    return documented(default, help_text, section=section)


def document_fields(cls: type) -> type:
    """Append a ``Parameters:`` section, built from the help texts of the fields ``cls`` itself declares, to its
    docstring. A field without help text fails here: every field gets its one doc."""
    own = [item for item in fields(cls) if item.name in cls.__dict__.get("__annotations__", {})]
    lines = ["", "    Parameters:"]
    section = None
    for item in own:
        help_text = item.metadata.get("help")
        if not help_text:
            raise TypeError(f"{cls.__name__}.{item.name} has no help text: declare it with documented(...).")
        if item.metadata.get("section") and item.metadata["section"] != section:
            section = item.metadata["section"]
            lines += [f"        > {section}", ""]
        if item.default is not MISSING:
            default = f"defaults to `{item.default!r}`"
        elif item.default_factory is not MISSING:
            default = f"defaults to `{item.default_factory()!r}`"
        else:
            default = "required"
        kind = item.type if isinstance(item.type, str) else getattr(item.type, "__name__", str(item.type))
        lines.append(f"        {item.name} (`{kind}`, *optional*, {default}):")
        lines.append(f"            {help_text}")
    if own:
        cls.__doc__ = (cls.__doc__ or "").rstrip() + "\n" + "\n".join(lines) + "\n"
    return cls
