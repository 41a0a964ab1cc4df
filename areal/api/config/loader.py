"""Loading a typed config tree: YAML file + dotted overrides -> frozen dataclasses.

Every config section is a ``@dataclass(frozen=True)`` whose fields are declared with
:func:`param` (a help string, a real default, optional bounds and choices). :func:`load_config`
merges, in order, the dataclass defaults, a YAML file and ``a.b.c=value`` overrides, then checks
the whole tree and raises one :class:`ConfigError` listing *every* problem (unknown keys with a
"did you mean", wrong types, out-of-range values, cross-field rules from each section's
``check()``), each with the dotted path, the bad value and the fix. The result is frozen; derived
values live in the code that derives them, never back in the config.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Iterator, Literal, TypeVar, get_args, get_origin

import yaml

T = TypeVar("T")
_MISSING = dataclasses.MISSING


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
) -> Any:
    """A config field: ``help`` is required; bounds are checked at load (``ge`` = ">=")."""
    if (default is _MISSING) == (factory is _MISSING):
        raise TypeError("param() needs exactly one of default= or factory=")
    meta = {"help": help, "ge": ge, "gt": gt, "le": le, "lt": lt}
    if factory is not _MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    if isinstance(default, list):  # mutable default: copy per instance
        return dataclasses.field(default_factory=lambda d=tuple(default): list(d), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


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
    if dataclasses.is_dataclass(tp):
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
        problems.append(f"{path}: expected true/false, got {value!r}")
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
            return float(value)
        if isinstance(value, str):  # YAML reads 1e-5 (no dot) as a string
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


def _build(cls: type[T], data: dict, prefix: str, problems: list[str]) -> T:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
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
            value = _coerce(data[name], hints[name], path, problems)
            _check_bounds(f, value, path, problems)
            kwargs[name] = value
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
    if hasattr(obj, "check") and len(problems) == n_before:
        problems.extend(f"{_join(prefix, p)}" for p in obj.check())
    return obj


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
    """Turn ``["a.b=1", "c=[1, 2]"]`` into a nested dict; values are parsed as YAML scalars."""
    tree: dict = {}
    problems = []
    for item in overrides:
        if "=" not in item:
            problems.append(f"override {item!r}: expected key=value, e.g. actor.optimizer.lr=1e-5")
            continue
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as e:
            problems.append(f"override {item!r}: value is not valid YAML ({e.problem})")
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
    """Read a YAML mapping, turning parse errors into a ConfigError with line and column."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError([f"--config {path}: no such file"], str(path))
    try:
        data = yaml.safe_load(path.read_text())
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


def load_config(cls: type[T], argv: list[str]) -> T:
    """The one loader every entry point uses: ``[--config FILE] [a.b=c ...]`` -> frozen ``cls``."""
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
    source = path or "command line"
    try:
        cfg = from_dict(cls, _merge(data, tree), source)
    except ConfigError as e:
        raise ConfigError(problems + e.problems, source) from None
    if problems:
        raise ConfigError(problems, source)
    return cfg


def to_dict(cfg: Any) -> dict:
    """The resolved config as plain data (what gets written to the run directory)."""
    return dataclasses.asdict(cfg)


def save_config(cfg: Any, path: str | Path) -> Path:
    """Write the resolved config as YAML (so a run can be repeated with ``--config`` on it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return path


def iter_fields(cls: type, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, Any]]:
    """Every leaf field of a config tree as (dotted path, field, type): docs and tests use it."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        path = _join(prefix, f.name)
        yield path, f, tp
        if dataclasses.is_dataclass(tp):
            yield from iter_fields(tp, path)
        for arg in get_args(tp):
            if dataclasses.is_dataclass(arg):
                yield from iter_fields(arg, path)
