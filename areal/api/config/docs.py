"""The config reference renderer: Markdown tables from the config dataclasses' ``help`` strings.

Every leaf and section of each experiment config gets a row with its full dotted path (what a
``a.b=c`` override or a YAML key names), its type, its default in that experiment and its help
text. A section (a dataclass-valued field) gets one table of its scalar fields. Sections that are
the same in several experiments (same path, same class, same defaults) are documented once, in a
group headed by the experiments that share them. Tool configs (a command's own config, not an
experiment) follow, each on its own. Which classes docs/config.md documents is decided above
this layer, by :mod:`areal.config_docs` (Core's configs live in ``areal.core``); ``areal
config-docs`` writes the file and a test fails when the committed copy differs.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from areal.api.config.experiments import DPOConfig, GRPOConfig, RWConfig, SFTConfig

# (config class, entry script), in the order the reference documents them.
EXPERIMENTS: list[tuple[type, str]] = [
    (GRPOConfig, "examples/gsm8k_grpo.py"),
    (SFTConfig, "examples/sft.py"),
    (RWConfig, "examples/rm.py"),
    (DPOConfig, "examples/dpo.py"),
]

HEADER = """\
# Config reference

Generated from the config dataclasses by `areal config-docs` (`areal/config_docs.py`, which
lists the classes); do not edit by hand (`tests/test_config_reference.py` fails when this file is
out of date).

Every entry script loads its config class with the same loader: defaults from the dataclasses,
then a YAML file, then dotted overrides, e.g.

<!-- docs-test: skip examples/gsm8k_grpo.yaml trains Qwen2.5-1.5B on 8 GPUs -->
```bash
areal launch local examples/gsm8k_grpo.py --config examples/gsm8k_grpo.yaml \\
    actor.optimizer.lr=5e-6 rollout.max_staleness=2 valid_dataset=null
```

A YAML file holds only what differs from the defaults below. Override values are parsed as YAML
(`[1, 2]` is a list, `null` is None, `1e-5` is a number). Unknown keys, wrong types, values out
of range and broken cross-field rules are all reported at once, with the field path and the fix.
A section whose default is `null` (e.g. `critic`) is off until any of its fields is set; its
table shows the defaults it then gets. `actor.algorithm` fills the knobs of its preset (see
[algorithms.md](algorithms.md)); the `actor` defaults below are the `ppo` preset, and any knob
set explicitly wins over the preset. `areal serve --config YAML` takes the fields of the
`server` section below at its top level (`max_batch_size: 64`, not `server.max_batch_size`).
Old keys and their new spelling: [Renamed keys](#renamed-keys), at the end.
"""


@dataclasses.dataclass
class Section:
    """One dataclass-valued node of a config tree, with the default instance it starts from."""

    path: str  # dotted path; "" for the top level
    cls: type
    instance: Any  # defaults of this section in its experiment
    help: str  # the help of the field holding it ("" for the top level)
    optional: bool  # the field's default is null
    entries: bool = False  # a list of such sections: the table is one entry's fields

    def key(self) -> tuple:
        """Equal for sections that read the same in two experiments."""
        return self.path, self.cls, repr(self.instance)


def _section_class(tp: Any) -> tuple[type | None, bool]:
    """The dataclass a field's type holds (if any) and whether the type admits None."""
    args = get_args(tp) if get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    classes = [a for a in args if isinstance(a, type) and dataclasses.is_dataclass(a)]
    return (classes[0] if classes else None), type(None) in args


def _entry_class(tp: object) -> type | None:
    """The dataclass of a list-of-sections field's entries (``list[X]``), if it is one."""
    if get_origin(tp) not in (list, tuple):
        return None
    classes = [a for a in get_args(tp) if isinstance(a, type) and dataclasses.is_dataclass(a)]
    return classes[0] if classes else None


def iter_sections(cls: type) -> Iterator[Section]:
    """The top level and every nested section of ``cls``, depth first, in field order."""

    def walk(section: Section) -> Iterator[Section]:
        yield section
        hints = typing.get_type_hints(section.cls)
        for f in dataclasses.fields(section.cls):
            path = f"{section.path}.{f.name}" if section.path else f.name
            entry = _entry_class(hints[f.name])
            if entry is not None:  # each entry's fields, at their defaults
                yield from walk(
                    Section(path, entry, entry(), f.metadata.get("help", ""), False, True)
                )
                continue
            sub_cls, optional = _section_class(hints[f.name])
            if sub_cls is None:
                continue
            value = getattr(section.instance, f.name)
            instance = value if value is not None else sub_cls()
            yield from walk(Section(path, sub_cls, instance, f.metadata.get("help", ""), optional))

    yield from walk(Section("", cls, cls(), "", False))


def type_name(tp: Any) -> str:
    """A field type as a reader writes it in YAML terms: ``int or null``, ``one of 'a', 'b'``."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        names = [type_name(a) for a in get_args(tp) if a is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in get_args(tp) else "")
    if origin is Literal:
        return "one of " + ", ".join(f"`{a}`" for a in get_args(tp))
    if origin in (list, tuple):
        inner = get_args(tp)
        return f"list of {type_name(inner[0])}" if inner else "list"
    return getattr(tp, "__name__", str(tp))


def default_text(value: Any) -> str:
    """A default as it would be written in YAML."""
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, (list, tuple)):
        return "`[" + ", ".join(default_text(v).strip("`") for v in value) + "]`"
    return f"`{value!r}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _leaf_rows(section: Section, only: set[str] | None = None) -> list[str]:
    hints = typing.get_type_hints(section.cls)
    rows = []
    for f in dataclasses.fields(section.cls):
        if _section_class(hints[f.name])[0] is not None or (
            only is not None and f.name not in only
        ):
            continue
        path = f"{section.path}.{f.name}" if section.path else f.name
        value = getattr(section.instance, f.name)
        rows.append(
            f"| `{path}` | {_cell(type_name(hints[f.name]))} | {_cell(default_text(value))} "
            f"| {_cell(f.metadata.get('help', ''))} |"
        )
    return rows


def _table(rows: list[str]) -> list[str]:
    return ["| field | type | default | help |", "| --- | --- | --- | --- |", *rows, ""]


def summary(cls: type) -> str:
    """The first paragraph of a class docstring, on one line, with Markdown code spans."""
    paragraph = (cls.__doc__ or "").strip().split("\n\n")[0]
    return " ".join(paragraph.split()).replace("``", "`")


def _section_block(section: Section, helps: dict[str, str]) -> list[str]:
    """Heading, intro and table of one section; ``helps``: experiment -> its field's help."""
    if len(set(helps.values())) == 1:
        role = section.help
    else:  # same section, described differently by each experiment that has it
        role = " ".join(f"In `{name}`: {text}" for name, text in helps.items())
    intro = f"`{section.cls.__name__}`: {role} {summary(section.cls)}".strip()
    if section.optional:
        intro += " Default `null` (off); the table shows the defaults once it is set."
    if section.entries:
        intro += " A list (default empty); the table shows the fields of one entry."
    lines = [f"### `{section.path}`", "", _cell(intro), ""]
    rows = _leaf_rows(section)
    return lines + (_table(rows) if rows else [])


def _group_title(names: list[str], all_names: list[str]) -> str:
    if names == all_names:
        return "Shared by every experiment"
    return " and ".join(f"`{n}`" for n in names) + (" only" if len(names) == 1 else "")


def _top_level_owners(experiments: list[type]) -> dict[tuple, list[str]]:
    """(top-level leaf name, type, default) -> the experiments having exactly that field."""
    owners: dict[tuple, list[str]] = {}
    for cls in experiments:
        root = next(iter_sections(cls))
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if _section_class(hints[f.name])[0] is None:
                key = (f.name, repr(hints[f.name]), repr(getattr(root.instance, f.name)))
                owners.setdefault(key, []).append(cls.__name__)
    return owners


def _tool_block(cls: type, command: str) -> list[str]:
    """A tool's config on its own: heading, summary, its top level and every section."""
    root, *sections = iter_sections(cls)
    lines = [f"## `{cls.__name__}` (`{command}`)", "", _cell(summary(cls)), ""]
    rows = _leaf_rows(root)
    lines += ["### top level", "", *_table(rows)] if rows else []
    for section in sections:
        lines += _section_block(section, {cls.__name__: section.help})
    return lines


def _renamed_block(classes: Sequence[type]) -> list[str]:
    """The old keys of every section's ``RENAMED`` (:data:`~areal.api.config.loader.Renames`),
    each with its new spelling: the docstring of the function that spells it."""
    rows: dict[str, str] = {}
    for cls in classes:
        for section in iter_sections(cls):
            for old, spell in getattr(section.cls, "RENAMED", {}).items():
                path = f"{section.path}.{old}" if section.path else old
                rows[path] = _cell((spell.__doc__ or "").replace("``", "`"))
    if not rows:
        return []
    intro = (
        "A config that sets one of these keys is refused at load, in one line per key naming "
        "its value and the new spelling. The new keys are relative to the old key's section; "
        "each gives the loss weights the old key gave where it applied "
        "(tests/algo/test_off_policy_weighting.py)."
    )
    table = ["| old key | value: new spelling |", "| --- | --- |"]
    return [
        "## Renamed keys",
        "",
        intro,
        "",
        *table,
        *(f"| `{k}` | {v} |" for k, v in rows.items()),
        "",
    ]


def render_config_docs(
    experiments: Sequence[tuple[type, str]] = EXPERIMENTS, tools: Sequence[tuple[type, str]] = ()
) -> str:
    """The whole reference as Markdown (deterministic: same classes, same text): the
    ``experiments`` (config class, entry script) grouped by what they share, then each of the
    ``tools`` (config class, command) on its own."""
    classes = [cls for cls, _ in experiments]
    all_names = [cls.__name__ for cls in classes]
    lines = [
        HEADER,
        "## Experiments",
        "",
        "| config | entry script (example YAMLs next to it) |",
        "| --- | --- |",
    ]
    for cls, script in experiments:
        lines.append(f"| `{cls.__name__}`: {_cell(summary(cls))} | `{script}` |")
    lines.append("")
    sections: dict[tuple, tuple[Section, dict[str, str]]] = {}  # key -> (section, name -> help)
    for cls in classes:
        for section in list(iter_sections(cls))[1:]:
            sections.setdefault(section.key(), (section, {}))[1][cls.__name__] = section.help
    top = _top_level_owners(classes)
    groups: list[list[str]] = []
    for names in [*top.values(), *(list(helps) for _, helps in sections.values())]:
        if names not in groups:
            groups.append(names)
    groups.sort(key=lambda names: (-len(names), [all_names.index(n) for n in names]))
    for names in groups:
        lines += [f"## {_group_title(names, all_names)}", ""]
        leaf_names = {key[0] for key, owners in top.items() if owners == names}
        if leaf_names:
            root = next(iter_sections(next(c for c in classes if c.__name__ == names[0])))
            lines += ["### top level", "", *_table(_leaf_rows(root, leaf_names))]
        for section, helps in sections.values():
            if list(helps) == names:
                lines += _section_block(section, helps)
    for cls, command in tools:
        lines += _tool_block(cls, command)
    lines += _renamed_block(classes)
    return "\n".join(lines).rstrip() + "\n"


def write_config_docs(
    out: str | Path,
    experiments: Sequence[tuple[type, str]] = EXPERIMENTS,
    tools: Sequence[tuple[type, str]] = (),
) -> Path:
    """Write :func:`render_config_docs` to ``out`` (parent dirs created)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_config_docs(experiments, tools))
    return out
