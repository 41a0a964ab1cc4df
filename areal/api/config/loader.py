"""Loading a typed config tree: YAML file + dotted overrides -> frozen dataclasses.

Every config section is a ``@dataclass(frozen=True)`` whose fields are declared with
:func:`param` (a help string, a real default, optional bounds and choices). :func:`load_config`
merges, in order, the dataclass defaults, a YAML file and ``a.b.c=value`` overrides, then checks
the whole tree and raises one :class:`ConfigError` listing *every* problem (unknown keys with a
"did you mean", wrong types, out-of-range values, cross-field rules from each section's
``check()``), each with the dotted path, the bad value and the fix. The result is frozen; derived
values live in the code that derives them, never back in the config.

YAML is read the YAML 1.2 way (:class:`Yaml12Loader`), in files and in override values alike:
only ``true``/``false`` are booleans (``yes``, ``no``, ``on``, ``off`` are strings, so a bool
field given one is an error, not a silent ``True``), and ``1e-5`` is a float. Float fields reject
NaN and +-inf unless declared with ``param(..., allow_nonfinite=True)``: a ``lr: .nan`` typo
would otherwise only surface as a NaN loss hours into a run.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, get_args, get_origin

import yaml

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")  # a config class
_MISSING = dataclasses.MISSING
Renames = dict[str, Callable[[Any, dict], list[str]]]
"""A config class's ``RENAMED``: an old key (dotted below the section) -> its new spelling, as
``key=value`` assignments below the section, from its value and the section as written (``[]``:
nothing replaces it, delete it). :func:`load_config` refuses each old key in one line."""


class ConfigError(ValueError):
    """All problems found in one config load, one per line."""

    def __init__(self, problems: list[str], source: str = "config"):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{len(problems)} problem(s) in {source}:\n{lines}")


def param(
    default: Any = _MISSING,
    *,
    help: str,
    factory: Any = _MISSING,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    allow_nonfinite: bool = False,
    secret: bool = False,
) -> Any:
    """A config field: ``help`` is required; bounds are checked at load (``ge`` = ">=").

    Float values (also inside unions and lists) must be finite unless ``allow_nonfinite=True``;
    with it, ``.inf``/``.nan`` load as given and the bounds still apply (NaN fails every bound).
    ``secret`` fields (keys) are left out of the configs written to disk (:func:`to_dict`).
    """
    if (default is _MISSING) == (factory is _MISSING):
        raise TypeError("param() needs exactly one of default= or factory=")
    meta = {"help": help, "ge": ge, "gt": gt, "le": le, "lt": lt}
    meta["allow_nonfinite"] = allow_nonfinite
    meta["secret"] = secret
    if factory is not _MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    if isinstance(default, list):  # mutable default: copy per instance
        return dataclasses.field(default_factory=lambda d=tuple(default): list(d), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


# ----------------------------------------------------------------------------- YAML 1.2

# YAML 1.2 core schema (https://yaml.org/spec/1.2.2/#1032-tag-resolution) as
# (tag, regexp, first characters). int comes before float: "1" matches both and is an int.
_CORE_SCHEMA = [
    ("null", r"~|null|Null|NULL|", ["~", "n", "N", ""]),
    ("bool", r"true|True|TRUE|false|False|FALSE", list("tTfF")),
    ("int", r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+", list("-+0123456789")),
    (
        "float",
        r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)",
        list("-+0123456789."),
    ),
]


class Yaml12Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` resolving plain scalars by the YAML 1.2 core schema.

    PyYAML implements YAML 1.1, where ``yes``/``no``/``on``/``off``/``y``/``n`` are booleans,
    ``1e-5`` (no dot) is a string, ``012`` is octal and ``2024-01-01`` a date. Here they are a
    string, a float, twelve and a string. ``yaml.SafeLoader`` itself is left unchanged.
    """

    # A dict of our own, so the resolvers below replace the YAML 1.1 ones instead of being
    # appended to a copy of them (add_implicit_resolver copies the parent's dict when the class
    # has none); SafeLoader's dict is never touched.
    yaml_implicit_resolvers: dict = {}


def _construct_int(loader: Yaml12Loader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node)
    try:
        if text[:2] in ("0x", "0o"):
            return int(text[2:], 16 if text[1] == "x" else 8)
        return int(text)  # YAML 1.2: a leading zero is decimal (012 == 12), not octal as in 1.1
    except ValueError:
        raise yaml.constructor.ConstructorError(
            None, None, f"{text!r} is not an integer", node.start_mark
        ) from None


def _construct_float(loader: Yaml12Loader, node: yaml.ScalarNode) -> float:
    text = loader.construct_scalar(node)
    try:  # float() spells .inf / .nan without the dot
        return float(text.lower().replace(".inf", "inf").replace(".nan", "nan"))
    except ValueError:
        raise yaml.constructor.ConstructorError(
            None, None, f"{text!r} is not a number", node.start_mark
        ) from None


class Yaml12Dumper(yaml.SafeDumper):
    """``yaml.SafeDumper`` that quotes every string a YAML 1.1 *or* 1.2 reader would take for
    something else (``'on'``, ``'1e5'``, ``'0o17'``), so what :func:`save_config` writes reads
    back the same with :class:`Yaml12Loader` and with plain ``yaml.safe_load``."""


for _tag, _regexp, _first in _CORE_SCHEMA:
    _resolver = (f"tag:yaml.org,2002:{_tag}", re.compile(f"^(?:{_regexp})$"), _first)
    Yaml12Loader.add_implicit_resolver(*_resolver)
    Yaml12Dumper.add_implicit_resolver(*_resolver)  # added to (a copy of) the YAML 1.1 ones
# Merge keys (<<: *base) are YAML 1.1 only, but kept: sharing a block between sections is useful
# and a key spelled "<<" has no other sensible meaning in a config.
Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:merge", re.compile(r"^(?:<<)$"), ["<"])
Yaml12Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)
Yaml12Loader.add_constructor("tag:yaml.org,2002:float", _construct_float)


# ----------------------------------------------------------------------------- coercion


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def _coerce(value: Any, tp: Any, path: str, problems: list[str]) -> Any:
    """Convert a YAML value to ``tp`` or record a problem (and return the value unchanged)."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = get_args(tp)
        if value is None and type(None) in options:
            return None
        inner = [o for o in options if o is not type(None)]
        sub: list[str] = []
        for option in inner:
            sub = []
            out = _coerce(value, option, path, sub)
            if not sub:
                return out
        problems.append(
            f"{path}: expected {' or '.join(_type_name(o) for o in options)}, got {value!r}"
        )
        return value
    if origin is Literal:
        choices = get_args(tp)
        if value in choices:
            return value
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        problems.append(f"{path}: got {value!r}, must be one of {list(choices)}{hint}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            problems.append(f"{path}: expected a list, got {value!r}; write [a, b] in YAML")
            return value
        (item_tp, *_) = get_args(tp) or (Any,)
        return [_coerce(v, item_tp, f"{path}[{i}]", problems) for i, v in enumerate(value)]
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            problems.append(f"{path}: expected a mapping for section {tp.__name__}, got {value!r}")
            return tp()
        return _build(tp, value, path, problems)
    if tp is Any:
        return value
    return _coerce_scalar(value, tp, path, problems)


def _coerce_scalar(value: Any, tp: Any, path: str, problems: list[str]) -> Any:
    """bool / int / float / str from YAML, without Python's lenient casts (no 'yes' -> True)."""
    if tp is bool:
        if isinstance(value, bool):
            return value
        yaml11 = isinstance(value, str) and value.lower() in ("yes", "no", "on", "off", "y", "n")
        note = " (YAML 1.2 reads yes/no/on/off as strings)" if yaml11 else ""
        problems.append(f"{path}: expected true/false, got {value!r}; write true or false{note}")
        return value
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        problems.append(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:  # an int past 1.8e308: +-inf, which _nonfinite then reports
                return math.inf if value > 0 else -math.inf
        if isinstance(value, str):  # a quoted number, lr: "1e-5"; "nan" / "1e400" parse too
            try:
                return float(value)
            except ValueError:
                pass
        problems.append(f"{path}: expected a number, got {value!r}")
        return value
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        problems.append(f"{path}: expected a string, got {value!r}")
        return value
    return value


def _nonfinite(raw: Any, value: Any, path: str) -> list[tuple[str, str]]:
    """(path, what the user wrote) for each NaN / +-inf float in a coerced ``value``.

    Only a float-typed field (or float option of a union, or float list item) coerces to a
    float, so a str field given ``.nan`` (now ``"nan"``) is not flagged.
    """
    if isinstance(value, float) and not math.isfinite(value):
        if isinstance(raw, int) and not isinstance(raw, bool):
            return [(path, f"an integer of {len(str(abs(raw)))} digits (too large for a float)")]
        return [(path, repr(raw))]
    if isinstance(value, list) and isinstance(raw, (list, tuple)) and len(raw) == len(value):
        return [
            hit
            for i, (r, v) in enumerate(zip(raw, value))
            for hit in _nonfinite(r, v, f"{path}[{i}]")
        ]
    return []


def _check_bounds(f: dataclasses.Field, value: Any, path: str, problems: list[str]) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    m = f.metadata
    for key, ok, word in (
        ("ge", lambda v, b: v >= b, ">="),
        ("gt", lambda v, b: v > b, ">"),
        ("le", lambda v, b: v <= b, "<="),
        ("lt", lambda v, b: v < b, "<"),
    ):
        bound = m.get(key)
        if bound is not None and not ok(value, bound):
            problems.append(f"{path} must be {word} {bound}, got {value!r}; {f.metadata['help']}")


def _default_section(f: dataclasses.Field) -> Any:
    """The default value of a section field (its ``factory``'s, which may differ from the
    section class's defaults: ``eval_gconfig`` is greedy), or None for other fields."""
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    elif f.default is not dataclasses.MISSING:
        value = f.default
    else:
        return None
    return value if dataclasses.is_dataclass(value) else None


def _own_defaults(section: Any) -> dict:
    """The values of ``section`` that differ from its class's defaults, as nested plain data
    (what must survive when a user sets other fields of the section; fields left at the class
    default stay unset, so presets that fill unset fields still apply)."""
    own, base = dataclasses.asdict(section), dataclasses.asdict(type(section)())

    def diff(a: dict, b: dict) -> dict:
        out = {}
        for k, v in a.items():
            if isinstance(v, dict) and isinstance(b.get(k), dict):
                if sub := diff(v, b[k]):
                    out[k] = sub
            elif v != b.get(k):
                out[k] = v
        return out

    return diff(own, base)


def _refuse_renamed(cls: type, data: dict, prefix: str, problems: list[str]) -> dict:
    """``data`` less the old keys of ``cls.RENAMED`` (:data:`Renames`), each reported with its
    value and the new spelling."""
    renames: Renames = getattr(cls, "RENAMED", {})
    kept = copy.deepcopy(data) if renames else data
    for old, spell in renames.items():
        *parents, leaf = old.split(".")
        node = kept
        for p in parents:
            node = node.get(p) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node:
            continue
        value = node.pop(leaf)
        new = " ".join(_join(prefix, a) for a in spell(value, data))
        fix = f"write {new}" if new else "delete it, the defaults do what it did"
        shown = (
            "null" if value is None else str(value).lower() if isinstance(value, bool) else value
        )
        where = '(docs/config.md, "Renamed keys")'
        problems.append(f"{_join(prefix, old)}: {shown} is a renamed key; {fix} {where}")
    return kept


def _build(cls: type[T], data: dict, prefix: str, problems: list[str]) -> T:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    data = _refuse_renamed(cls, data, prefix, problems)
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean {_join(prefix, close[0])!r}?" if close else ""
            problems.append(
                f"{_join(prefix, key)}: unknown key in {cls.__name__}{hint} "
                f"(valid keys: {', '.join(sorted(fields))})"
            )
    n_before = len(problems)
    kwargs = {}
    for name, f in fields.items():
        path = _join(prefix, name)
        if name in data:
            n_field = len(problems)
            raw = data[name]
            default = _default_section(f)
            if default is not None and isinstance(raw, dict):  # set fields merge over the default
                raw = _merge(_own_defaults(default), raw)
            value = _coerce(raw, hints[name], path, problems)
            kwargs[name] = value
            if len(problems) > n_field:  # wrong type: already reported, range checks moot
                continue
            bad = [] if f.metadata.get("allow_nonfinite") else _nonfinite(raw, value, path)
            fix = f.metadata.get("help") or "write a finite number"
            problems.extend(f"{p}: must be a finite number, got {shown}; {fix}" for p, shown in bad)
            if not bad:  # NaN fails every bound: one problem per field is enough
                _check_bounds(f, value, path, problems)
    try:
        obj = cls(**kwargs)
    except (TypeError, ValueError) as e:  # a type problem above already made it unbuildable
        if len(problems) == n_before:
            problems.append(f"{prefix or cls.__name__}: {e}")
        return cls()
    for name in fields.keys() - data.keys():  # default sections obey their rules too
        value = getattr(obj, name)
        if dataclasses.is_dataclass(value):
            _check_tree(value, _join(prefix, name), problems)
    if hasattr(obj, "check"):
        _run_check(obj, prefix, problems, field_problems=len(problems) > n_before)
    return obj


def _run_check(obj: Any, prefix: str, problems: list[str], field_problems: bool) -> None:
    """Add ``obj.check()``'s cross-field problems, even when some fields were bad.

    A field that failed coercion keeps its raw value in ``obj`` (``'abc'`` for an int), so a rule
    comparing it may raise. That field's own problem is already reported, so the rule is dropped
    (keeping what it yielded before) rather than the load crashing; with no field problem in
    this section the crash is a bug in ``check()`` and propagates.
    """
    try:
        for p in obj.check():
            problems.append(_join(prefix, p))
    except (TypeError, ValueError, AttributeError, ArithmeticError):
        if not field_problems:
            raise


def _check_tree(obj: Any, prefix: str, problems: list[str]) -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            _check_tree(value, _join(prefix, f.name), problems)
    if hasattr(obj, "check"):
        problems.extend(_join(prefix, p) for p in obj.check())


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


# ----------------------------------------------------------------------------- public API


def parse_overrides(overrides: list[str]) -> tuple[dict, list[str]]:
    """Turn ``["a.b=1", "c=[1, 2]"]`` into a nested dict; values are parsed as YAML 1.2 scalars."""
    tree: dict = {}
    problems = []
    for item in overrides:
        if "=" not in item:
            problems.append(f"override {item!r}: expected key=value, e.g. actor.optimizer.lr=1e-5")
            continue
        key, raw = item.split("=", 1)
        if any(not part.strip() for part in key.split(".")):
            problems.append(
                f"override {item!r}: empty key or key part before '='; write "
                "key=value, e.g. actor.optimizer.lr=1e-5"
            )
            continue
        try:
            value = yaml.load(raw, Loader=Yaml12Loader) if raw != "" else ""
        except yaml.YAMLError as e:
            why = getattr(e, "problem", None) or e  # marked errors say where; others just what
            problems.append(f"override {item!r}: value is not valid YAML ({why})")
            continue
        node = tree
        *parents, leaf = key.strip().split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                problems.append(f"override {item!r}: {p} is set to a value and a section at once")
                break
        else:
            node[leaf] = value
    return tree, problems


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def read_yaml(path: str | Path) -> dict:
    """Read a YAML 1.2 mapping, turning parse errors into a ConfigError with line and column."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(
            [
                f"--config {path}: is a directory; pass a YAML file, e.g. "
                "examples/arithmetic_grpo.yaml"
            ],
            str(path),
        )
    if not path.is_file():
        raise ConfigError([f"--config {path}: no such file"], str(path))
    try:
        data = yaml.load(path.read_text(), Loader=Yaml12Loader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = getattr(e, "problem", None) or str(e)
        raise ConfigError([f"{path}: malformed YAML{where}: {what}"], str(path)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: top level must be a mapping, got {type(data).__name__}"])
    return data


def from_dict(cls: type[T], data: dict, source: str = "config") -> T:
    """Build and check ``cls`` from a nested dict, raising one ConfigError with every problem."""
    problems: list[str] = []
    cfg = _build(cls, data, "", problems)
    if problems:
        raise ConfigError(problems, source)
    return cfg


def config_help(cls: type) -> str:
    """What ``--help`` prints for a config-driven entry point: the usage, then each top-level
    field with its default and help, each section with its summary."""
    lines = [
        f"{cls.__name__}: {_summary(cls)}",
        "usage: [--config YAML] [key=value ...]  (dotted keys reach into sections: "
        "actor.optimizer.lr=1e-5; values are YAML)",
        "",
    ]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        sections = [t for t in (hints[f.name], *get_args(hints[f.name])) if _is_section(t)]
        if sections:
            lines.append(f"  {f.name}.*  {_summary(sections[0])}")
        else:
            default = f.default if f.default is not _MISSING else "(required)"
            lines.append(f"  {f.name}={default!r}  {f.metadata.get('help', '')}".rstrip())
    lines += ["", "Every field with its type, default and meaning: docs/config.md."]
    return "\n".join(lines)


def _summary(cls: type) -> str:
    """The first paragraph of a class's docstring, on one line."""
    return " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _attribute(problems: list[str], override_keys: list[str]) -> list[str]:
    """Mark the problems whose field was set on the command line, not in the YAML file."""
    out = []
    for p in problems:
        where = re.split(r"[:\s]", p, maxsplit=1)[0]  # "a.b: ..." or "a.b must be ..."
        mine = any(where == k or where.startswith((k + ".", k + "[")) for k in override_keys)
        out.append(f"{p} (set on the command line)" if mine else p)
    return out


def load_config(cls: type[T], argv: list[str]) -> T:
    """The one loader every entry point uses: ``[--config FILE] [a.b=c ...]`` -> frozen ``cls``.
    ``-h``/``--help`` among the arguments prints :func:`config_help` and exits 0."""
    if "-h" in argv or "--help" in argv:
        print(config_help(cls))
        raise SystemExit(0)
    path, overrides = None, []
    it = iter(argv)
    for arg in it:
        if arg == "--config":
            path = next(it, None)
            if path is None:
                raise ConfigError(["--config needs a file path"])
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            overrides.append(arg)
    data = read_yaml(path) if path else {}
    tree, problems = parse_overrides(overrides)
    source = f"{path} and the command line" if path and overrides else path or "command line"
    try:
        cfg = from_dict(cls, _merge(data, tree), source)
    except ConfigError as e:
        keys = [o.split("=", 1)[0].strip() for o in overrides if "=" in o] if path else []
        raise ConfigError(problems + _attribute(e.problems, keys), source) from None
    if problems:
        raise ConfigError(problems, source)
    return cfg


def to_dict(cfg: Any) -> dict:
    """The resolved config as plain data (what gets written to the run directory); ``secret``
    fields are emptied, so no key lands in a file other users may read."""
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.metadata.get("secret"):
            value = type(value)()
        elif dataclasses.is_dataclass(value):
            value = to_dict(value)
        elif isinstance(value, list):  # a list of sections (core.allocations) is plain data too
            value = [to_dict(v) if dataclasses.is_dataclass(v) else copy.deepcopy(v) for v in value]
        else:
            value = copy.deepcopy(value)
        out[f.name] = value
    return out


def save_config(cfg: Any, path: str | Path) -> Path:
    """Write the resolved config as YAML (so a run can be repeated with ``--config`` on it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.dump(to_dict(cfg), Dumper=Yaml12Dumper, sort_keys=False))
    return path


def iter_fields(cls: type, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, Any]]:
    """Every leaf field of a config tree as (dotted path, field, type): docs and tests use it."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        path = _join(prefix, f.name)
        yield path, f, tp
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            yield from iter_fields(tp, path)
        for arg in get_args(tp):
            if isinstance(arg, type) and dataclasses.is_dataclass(arg):
                yield from iter_fields(arg, path)
