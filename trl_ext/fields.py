"""Config fields documented once: each field's help text (its ``metadata["help"]``) is its one doc.

- `mirror_field`: a field that mirrors a field of a settings dataclass (a trainer config's ``repl_<name>`` fields
  mirror `SandboxLimits`, its scaffold fields `RLMScaffoldConfig`, its ``judge_<name>`` endpoint fields
  `EndpointSettings`), so that the setting's default and help text live in the settings class.
- `documented`: a field with its help text (and the section it is listed under).
- `document_fields`: a class decorator that writes the ``Parameters:`` section of a config's docstring from those
  help texts (the Hugging Face docstring layout), so the docstring and ``--help`` never disagree, and makes an
  unknown keyword a `TypeError` that names it and the closest field names (`unknown_keywords_message`).
"""

from __future__ import annotations

import difflib
import functools
import textwrap
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import MISSING, field, fields
from typing import Any

__all__ = ["document_fields", "documented", "mirror_field", "unknown_keywords_message"]

_SAME = object()


class FieldDoc(Mapping):
    """A field's metadata: ``{"help": text}`` as TRL's and transformers' argument parsers read it, plus the
    ``section`` it is listed under in the docstring.

    `transformers.HfArgumentParser` passes every metadata key it iterates to ``argparse.add_argument``, which
    refuses unknown keywords; so the section is readable (``metadata.get("section")``) but never iterated, and so is
    the mark ``metadata.get("trl_ext")`` (True: a field trl-ext documents, which `document_fields` lists).
    """

    def __init__(self, help: str, section: str | None = None):
        self.help, self.section = help, section

    def __getitem__(self, key: str) -> Any:
        if key == "help":
            return self.help
        if key == "section" and self.section is not None:
            return self.section
        if key == "trl_ext":  # marks a field trl-ext documents (`document_fields` lists it)
            return True
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(("help",))

    def __len__(self) -> int:
        return 1

    def copy(self) -> dict[str, Any]:
        """What the argument parsers take (``field.metadata.copy()``): the help text only."""
        return {"help": self.help}


def documented(default: Any = MISSING, help: str = "", *, section: str | None = None, **kwargs: Any) -> Any:
    """A `dataclasses.field` whose one doc is ``help`` (``--help`` and the docstring's ``Parameters:`` section);
    ``section`` names the heading it is listed under; other keywords go to `dataclasses.field`."""
    if default is not MISSING:
        kwargs["default"] = default
    return field(metadata=FieldDoc(help, section), **kwargs)


def mirror_field(
    source: type,
    name: str,
    label: str,
    *,
    default: Any = _SAME,
    default_factory: Callable[[], Any] | None = None,
    note: str = "",
    section: str | None = None,
) -> Any:
    """A `dataclasses.field` with the default of ``source``'s field ``name`` (or ``default``, or
    ``default_factory`` for a mutable one) and its help text, prefixed with ``label`` (``"REPL sandbox: ..."``)
    and followed by ``note`` when given."""
    setting = source.__dataclass_fields__[name]
    help_text = f"{label}: {setting.metadata['help']}" + (f" {note}" if note else "")
    if default_factory is None and default is _SAME:
        if setting.default is not MISSING:
            default = setting.default
        elif setting.default_factory is not MISSING:
            default_factory = setting.default_factory
        else:
            raise TypeError(f"{source.__name__}.{name} has no default; pass default= to mirror it.")
    if default_factory is not None:
        return documented(help=help_text, section=section, default_factory=default_factory)
    return documented(default, help_text, section=section)


def document_fields(cls: type) -> type:
    """Append a ``Parameters:`` section to the docstring of ``cls``, built from the help texts of every field trl-ext
    declares for it (its own and those of the trl-ext classes it inherits, such as a method's settings mixin; not
    TRL's), and refuse unknown keywords by name (`refuse_unknown_keywords`). A field ``cls`` itself declares
    without a help text fails here: every field gets its one doc."""
    annotations = cls.__dict__.get("__annotations__", {})
    for item in fields(cls):
        if item.name in annotations and not item.metadata.get("help"):
            raise TypeError(f"{cls.__name__}.{item.name} has no help text: declare it with documented(...).")
    own = [item for item in fields(cls) if item.metadata.get("trl_ext")]
    lines = ["", "    Parameters:"]
    section = None
    for item in own:
        help_text = item.metadata["help"]
        if item.metadata.get("section") and item.metadata["section"] != section:
            section = item.metadata["section"]
            lines += ([""] if len(lines) > 2 else []) + [f"        > {section}", ""]
        if item.default is not MISSING or item.default_factory is not MISSING:
            value = repr(item.default if item.default is not MISSING else item.default_factory())
            default = f"*optional*, defaults to `{value if len(value) <= 60 else value[:57] + '...'}`"
        else:
            default = "required"
        kind = item.type if isinstance(item.type, str) else getattr(item.type, "__name__", str(item.type))
        lines.append(f"        {item.name} (`{kind}`, {default}):")
        lines += textwrap.wrap(
            help_text, width=120, initial_indent=" " * 12, subsequent_indent=" " * 12, break_on_hyphens=False
        )
    if own:
        cls.__doc__ = (cls.__doc__ or "").rstrip() + "\n" + "\n".join(lines) + "\n"
    return refuse_unknown_keywords(cls)


def refuse_unknown_keywords(cls: type) -> type:
    """Wrap the dataclass ``__init__`` of ``cls`` so that a keyword that is not one of its fields raises a
    `TypeError` naming it and the closest field names (``did you mean 'max_staleness'?``), where the plain dataclass
    error names the keyword only. The signature (``inspect.signature``), the fields and so `HfArgumentParser` /
    ``--help`` are unchanged; a dataclass subclass gets its own ``__init__`` (wrapped again if it is decorated too)."""
    init = cls.__dict__.get("__init__")
    if init is None or getattr(init, "_refuses_unknown_keywords", False):
        return cls
    names = frozenset(item.name for item in fields(cls) if item.init)

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        unknown = kwargs.keys() - names
        if unknown:
            raise TypeError(unknown_keywords_message(cls.__name__, [key for key in kwargs if key in unknown], names))
        init(self, *args, **kwargs)

    __init__._refuses_unknown_keywords = True
    cls.__init__ = __init__
    return cls


def unknown_keywords_message(owner: str, unknown: Iterable[str], known: Collection[str]) -> str:
    """``"<owner>.__init__() got an unexpected keyword argument 'max_stalenes' (did you mean 'max_staleness'?)"``:
    Python's wording, with the closest of the ``known`` names (`difflib.get_close_matches`) for each."""
    unknown = list(unknown)
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, known, n=3)
        if close:
            hints.append(f"{key!r} (did you mean {' or '.join(repr(name) for name in close)}?)")
        else:
            hints.append(f"{key!r} (no field has a similar name; help({owner}) lists them)")
    plural = "s" if len(unknown) > 1 else ""
    return f"{owner}.__init__() got {'' if plural else 'an '}unexpected keyword argument{plural} {', '.join(hints)}"
