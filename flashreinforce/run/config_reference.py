"""Every config field with its type, default and doc, read from config.py's models: what `flashreinforce config
[SECTION]` prints and what docs/config.md holds (`flashreinforce config --markdown > docs/config.md`; a test
keeps the two equal). The doc of a field is the string under it in config.py, so there is one place to write it.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from flashreinforce.config import RunConfig


@dataclass(frozen=True)
class FieldDoc:
    name: str
    """Dotted, as an override spells it: trainer.lora.r."""
    type: str
    default: str
    doc: str


def field_docs(model: type[BaseModel] = RunConfig, prefix: str = "") -> Iterator[FieldDoc]:
    """Depth first, in the order config.py declares them. A section with a default (model, trainer...) is only a
    heading for its fields; an optional one (algo.hints, trainer.lora...) is also a field, off by default."""
    for name, info in model.model_fields.items():
        dotted = f"{prefix}{info.alias or name}"  # as a recipe spells it: stages[i].from
        section, member = _section_of(info.annotation)
        if section is None or info.default is None:
            yield FieldDoc(dotted, describe_type(info), _default_text(info), " ".join((info.description or "").split()))
        if section is not None:
            yield from field_docs(section, f"{dotted}{member}.")


def _section_of(annotation: object) -> tuple[type[BaseModel] | None, str]:
    """The model a field holds and how its fields are spelled below it: directly or optionally (""), as the
    values of a mapping (".<name>") or the items of a list ("[i]"); else (None, "")."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate, ""
        origin, members = typing.get_origin(candidate), {dict: ".<name>", list: "[i]"}
        if origin in members:
            value = typing.get_args(candidate)[-1]
            if isinstance(value, type) and issubclass(value, BaseModel):
                return value, members[origin]
    return None, ""


def describe_type(info: FieldInfo) -> str:
    """`int, >= 1`; `fp32 | bf16 | fp8`; `HintConfig | None`."""
    bounds = {annotated_types.Ge: (">=", "ge"), annotated_types.Gt: (">", "gt"), annotated_types.Le: ("<=", "le"),
              annotated_types.Lt: ("<", "lt")}
    limits = [f"{bounds[type(m)][0]} {getattr(m, bounds[type(m)][1])}" for m in info.metadata if type(m) in bounds]
    return ", ".join([_type_text(info.annotation), *limits])


def _type_text(annotation: object) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_text(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type_text(a) for a in args)}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def _default_text(info: FieldInfo) -> str:
    if info.default is PydanticUndefined:
        return "required"
    if isinstance(info.default, BaseModel):
        return "(section)"
    return repr(info.default) if isinstance(info.default, str) else str(info.default)


def sections() -> list[str]:
    return [name for name, info in RunConfig.model_fields.items() if _section_of(info.annotation)[0] is not None]


def select(docs: list[FieldDoc], section: str | None) -> list[FieldDoc]:
    """The fields under `section` (a section, a sub-section or one field); an unknown name lists the sections."""
    if section is None:
        return docs
    chosen = [d for d in docs if d.name == section or d.name.startswith((f"{section}.", f"{section}["))]
    if not chosen:
        raise ValueError(f"no config field or section {section!r}; sections: {', '.join(sections())}, and the "
                         f"top-level fields {', '.join(d.name for d in docs if '.' not in d.name)}")
    return chosen


def as_text(docs: list[FieldDoc]) -> str:
    """For a terminal: `name: type = default`, the doc indented under it."""
    lines = []
    for doc in docs:
        lines.append(f"{doc.name}: {doc.type} = {doc.default}")
        if doc.doc:
            lines.append(f"    {doc.doc}")
    return "\n".join(lines) + "\n"


def as_markdown(docs: list[FieldDoc]) -> str:
    """docs/config.md: one table per top-level section."""
    out = ["# Config reference", "",
           "Every field of a run's config, with its type, default and meaning: the recipe YAML's sections, and what "
           "a dotted override such as `trainer.lr=1e-5` sets. Generated from `flashreinforce/config.py` by "
           "`flashreinforce config --markdown`; `flashreinforce config SECTION` prints one section in a terminal.", ""]
    top = [d for d in docs if "." not in d.name]
    for title, rows in [("Top level", top), *((f"`{s}`", select(docs, s)) for s in sections())]:
        out += [f"## {title}", "", "| field | type | default | what it does |", "|---|---|---|---|"]
        out += [f"| `{d.name}` | {_cell(d.type)} | {_cell(d.default)} | {_cell(d.doc)} |" for d in rows]
        out.append("")
    return "\n".join(out)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")
