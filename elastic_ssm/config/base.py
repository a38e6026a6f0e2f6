"""``ConfigBase``: keyword-only dataclasses with a ``help`` per field (``opt``), fields checked by pydantic from their
annotations (lax mode; an error is one ``ConfigError`` line naming the field), a YAML round trip and dotted updates.
``validate`` keeps only the rules across fields. Nothing here imports torch."""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import yaml
from annotated_types import Ge, Gt, Interval, Len
from pydantic import AfterValidator, ConfigDict, TypeAdapter, ValidationError

__all__ = ["Pos", "PosInt", "NonNegF", "NonNeg", "AtLeast1", "Frac01", "Unit", "Share", "Fracs", "Betas",
           "NonEmpty", "NonBlank", "TokenId", "HeadDim", "Rising", "Distinct", "Ladder", "TierNames", "ConfigBase",
           "ConfigError", "opt", "section", "check_field", "read_yaml_mapping", "read_yaml_file", "load_yaml",
           "config_changes", "field_paths", "NOT_SAVED"]


def _rule(ok: Any, what: str) -> AfterValidator:
    """A rule on a whole (tuple) value, declared on the field: ``ok(value)`` or the error ``what``."""
    def check(v: Any) -> Any:
        if not ok(v):
            raise ValueError(what)
        return v
    return AfterValidator(check)


# ranges the config fields declare (``Annotated``), read by pydantic: a bad value is one line naming the field
Pos = Annotated[float, Gt(0)]
PosInt = Annotated[int, Gt(0)]
NonNegF = Annotated[float, Ge(0)]
NonNeg = Annotated[int, Ge(0)]
AtLeast1 = Annotated[int, Ge(1)]
Seed = Annotated[int, Interval(ge=0, le=(1 << 64) - 1)]   # torch.manual_seed's range
Frac01 = Annotated[float, Interval(ge=0, lt=1)]       # [0, 1)
Unit = Annotated[float, Interval(ge=0, le=1)]         # [0, 1]
Share = Annotated[float, Interval(gt=0, le=1)]        # (0, 1]
Fracs = Annotated[tuple[Share, ...], Len(1)]          # a non-empty list of capacity fractions in (0, 1]
Betas = Annotated[tuple[Frac01, ...], Len(2, 2)]      # AdamW (beta1, beta2), each in [0, 1)
NonEmpty = Annotated[str, Len(1)]
NonBlank = Annotated[str, _rule(lambda v: bool(v.strip()), "must not be empty or blank")]
TokenId = Annotated[int, Ge(-1)]                       # -1: none
HeadDim = Annotated[PosInt, _rule(lambda v: v % 2 == 0, "must be even (RoPE)")]   # attention head width
Rising = _rule(lambda v: list(v) == sorted(set(v)), "must be strictly increasing")
Distinct = _rule(lambda v: len(set(v)) == len(v), "must not repeat an entry")
#: tier fractions: strictly increasing in (0, 1], ending with the full tier
Ladder = Annotated[Fracs, Rising, _rule(lambda v: v[-1] == 1.0, "must end with 1.0 (the full tier)")]
#: tier names ``T<n>`` with ``n`` increasing (the names of the source's tiers, ordered by size too); empty: T1..Tn
TierNames = Annotated[tuple[str, ...], _rule(lambda v: (n := [int(x[1:]) if re.fullmatch(r"T[1-9]\d*", x) else 0
                                                              for x in v]) == sorted(set(n)) and 0 not in n,
                                             "must be names T<n> with n increasing (as T1, T4); leave it empty for "
                                             "T1..Tn")]


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and what to do."""


def opt(default: Any = dataclasses.MISSING, help: str = "", repeatable: bool = False, *, output: str | None = None,
        metavar: str | None = None, **kw: Any) -> Any:
    """A dataclass field with a default (none: required) and a one-line help text (used by the CLI). ``repeatable``:
    a tuple field whose flag, given several times, keeps every value (``--bench.set a=1 --bench.set b=2``); other
    flags given twice keep the last, as argparse does. A verb's option: ``output`` "file" / "folder", a path checked
    before the verb runs (``utils.files.check_output_path``); ``metavar`` names a positional argument in messages."""
    return field(default=default, metadata={"help": help, "repeatable": repeatable, "output": output,
                                            "metavar": metavar}, **kw)


def section(cls: type, help: str) -> Any:
    """A nested config section (a ``ConfigBase`` subclass built with its defaults) with a help text."""
    return field(default_factory=cls, metadata={"help": help})


_CONFIG = ConfigDict(allow_inf_nan=False)   # lax mode: "3e-4" -> 3e-4, [a, b] -> (a, b), 2.0 -> 2
_ADAPTERS: dict[type, dict[str, tuple[Any, TypeAdapter[Any]]]] = {}


def _bounded(tp: Any) -> bool:
    """Whether annotation ``tp`` (its items included) declares an ``annotated_types.Interval``."""
    return any(isinstance(m, Interval) for m in getattr(tp, "__metadata__", ())) or any(map(_bounded,
                                                                                           typing.get_args(tp)))


def _one_line(name: str, err: ValidationError) -> ConfigError:
    """The first error of pydantic's ``err`` as one ``ConfigError`` line naming ``name`` (and the item): pydantic's
    own words (a declared rule's: its message)."""
    e = err.errors(include_url=False)[0]
    where = name + "".join(f"[{x}]" for x in e["loc"] if isinstance(x, int))
    what = str(e["ctx"]["error"]) if e["type"] == "value_error" else e["msg"]
    return ConfigError(f"{where}: {what}, got {e['input']!r}")


def check_field(cls: type, name: str, value: Any, where: str = "") -> Any:
    """``value`` validated as field ``name`` of dataclass ``cls`` by its annotation (pydantic, lax mode: type, range,
    choices; an int without a declared interval within 64 bits), else one ``ConfigError`` line naming ``where``
    (default ``Class.name``). One ``TypeAdapter`` per field,
    built once; a nested section (a dataclass) is left to its own class."""
    if cls not in _ADAPTERS:
        hints = typing.get_type_hints(cls, include_extras=True)
        _ADAPTERS[cls] = {f.name: (hints[f.name], TypeAdapter(hints[f.name], config=_CONFIG))
                          for f in dataclasses.fields(cls) if not dataclasses.is_dataclass(hints[f.name])}
    tp, adapter = _ADAPTERS[cls][name]
    try:
        out = adapter.validate_python(value)
    except ValidationError as e:
        raise _one_line(where or f"{cls.__name__}.{name}", e) from None
    if type(out) is int and not _bounded(tp) and not -(1 << 63) <= out < 1 << 63:   # torch takes no larger int
        raise ConfigError(f"{where or f'{cls.__name__}.{name}'}: {out} is beyond a 64-bit integer; give a smaller "
                          "value")
    return out


def field_paths(cls: type, prefix: str = "") -> dict[str, dataclasses.Field]:
    """The dotted path of every field of dataclass ``cls`` (``optim.lr``), nested dataclasses' fields included ->
    its field."""
    hints, paths = typing.get_type_hints(cls), {}
    for f in dataclasses.fields(cls):
        tp = hints.get(f.name)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            paths.update(field_paths(tp, f"{prefix}{f.name}."))
        else:
            paths[prefix + f.name] = f
    return paths


def _validate_field(cls: type, name: str, tp: Any, value: Any) -> Any:
    """``value`` validated as field ``name`` of ``cls`` (``check_field``); a mapping for a nested section becomes
    that section's config."""
    if isinstance(tp, type) and issubclass(tp, ConfigBase):
        if isinstance(value, dict):
            return tp.from_dict(value)
        if not isinstance(value, tp):
            raise ConfigError(f"{cls.__name__}.{name}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return value
    if isinstance(value, bool) and typing.get_origin(tp) is not typing.Literal and \
            (tp in (int, float) or typing.get_args(tp)[:1] in ((int,), (float,))):   # YAML `steps: true` is not 1
        raise ConfigError(f"{cls.__name__}.{name}: expected a number, got the boolean {value!r}")
    return check_field(cls, name, value)


#: what ``config_changes`` says of a setting the saved dict lacks (added since the run was written)
NOT_SAVED = "not in the saved run"


def config_changes(saved: dict[str, Any], now: dict[str, Any], free: frozenset[str] = frozenset(),
                   prefix: str = "") -> list[str]:
    """Dotted names of the fields that differ between two config dicts (nested sections compared field by
    field), except the top-level ``free`` ones (a free name is a field or a whole section, e.g. ``eval``)."""
    out = []
    for k in sorted(set(saved) | set(now)):
        if k in free:
            continue
        a, b = saved.get(k), now.get(k)
        if k not in saved:      # a setting this version added: the run was written by an older elastic_ssm
            out.append(f"{prefix}{k}: {NOT_SAVED} (now {b!r})")
        elif isinstance(a, dict) and isinstance(b, dict):
            out += config_changes(a, b, frozenset(), f"{prefix}{k}.")
        elif (list(a) if isinstance(a, tuple) else a) != (list(b) if isinstance(b, tuple) else b):
            out.append(f"{prefix}{k}: {a!r} -> {b!r}")
    return out


class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":      # '<<: *anchor': merged keys may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, typing.Hashable) and key in seen:
                raise ConfigError(f"key {key!r} is given twice (lines {seen[key]} and {line}); keep one")
            if isinstance(key, typing.Hashable):
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _yaml12_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node).replace("_", "")
    return int(text, 0) if text.lower().startswith(("0o", "0x")) else int(text, 10)


# integers as YAML 1.2 reads them: ``010`` is ten (PyYAML's YAML 1.1 made it octal 8, and ``1:30`` ninety)
_StrictLoader.yaml_implicit_resolvers = {c: [(tag, rx) for tag, rx in rs if tag != "tag:yaml.org,2002:int"]
                                         for c, rs in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_YAML12_INT = re.compile(r"^(?:[-+]?[0-9][0-9_]*|0o[0-7]+|0x[0-9a-fA-F]+)$")
_StrictLoader.add_implicit_resolver("tag:yaml.org,2002:int", _YAML12_INT, list("-+0123456789"))
_StrictLoader.add_constructor("tag:yaml.org,2002:int", _yaml12_int)


def load_yaml(text: str, where: str) -> Any:
    """``yaml.safe_load`` of ``text`` that names ``where`` (a file or what the text configures) in its errors:
    a syntax error (line and column) and a key given twice in one mapping are a ``ConfigError``."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{where}: invalid YAML{at}: {getattr(e, 'problem', None) or e}; fix the "
                          "syntax") from None


def read_yaml_file(path: str | Path, what: str = "config file") -> Any:
    """The YAML document in file ``path`` (``load_yaml``); a missing path, a folder, an unreadable or non-UTF-8
    file is a ``ConfigError`` naming it. An empty file (or one holding only comments) is ``None``."""
    p = Path(path)
    if not str(path).strip():
        raise ConfigError(f"{what}: the path is an empty string; give a YAML file")
    if p.is_dir():
        raise ConfigError(f"{what} {p} is a folder; give a YAML file")
    if not p.exists():      # a pipe (/dev/stdin, <(...)) or /dev/null is read like a file
        raise ConfigError(f"{what} {p} does not exist")
    try:
        text = p.read_text()
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {p} is not UTF-8 text ({e.reason} at byte {e.start}); give a YAML file") from None
    return load_yaml(text, str(p))


def read_yaml_mapping(path_or_text: str | Path, what: str) -> dict[str, Any]:
    """The mapping in a YAML file path, or in YAML text (anything containing a newline or ':')."""
    if isinstance(path_or_text, str) and ("\n" in path_or_text or ":" in path_or_text):
        data = load_yaml(str(path_or_text), what)
    else:
        data = read_yaml_file(path_or_text, f"{what}: config file")
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: YAML must be a mapping of field names, got {type(data).__name__} {data!r}")
    return data


@dataclass(kw_only=True)
class ConfigBase:
    """Shared behaviour: field validation (pydantic), cross-field ``validate``, dict/YAML round trip, ``replace``."""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self), include_extras=True)
        for f in dataclasses.fields(self):
            setattr(self, f.name, _validate_field(type(self), f.name, hints[f.name], getattr(self, f.name)))
        self.validate()

    def validate(self) -> None:  # overridden by subclasses
        """Cross-field rules a schema cannot say (types and ranges are declared on the fields); raise
        ``ConfigError`` naming the bad field."""

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML-ready values: sections as dicts, tuples as lists."""
        plain = lambda v: v.to_dict() if isinstance(v, ConfigBase) else list(v) if isinstance(v, tuple) else v  # noqa: E731
        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def suggest(cls, key: str) -> str:
        """``'; did you mean optim.lr?'`` (else ``';'``) for an unknown ``key``: a section's field of that name,
        or the closest path."""
        paths = list(field_paths(cls))
        near = [p for p in paths if p.rpartition(".")[2] == key] or \
            difflib.get_close_matches(key, paths, n=1, cutoff=0.6)
        return f"; did you mean {' or '.join(near)}?" if near else ";"

    @classmethod
    def check_names(cls, d: dict[str, Any], beside: str = "") -> None:
        """ConfigError naming the keys of ``d`` that are not fields (and the closest path of the first)."""
        names = cls.field_names()
        unknown = sorted(set(d) - names, key=str)      # YAML keys may be numbers, booleans or null
        if unknown:
            raise ConfigError(f"{cls.__name__}: unknown field(s) {unknown}{beside}{cls.suggest(str(unknown[0]))} "
                              f"the fields are {sorted(names)}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ConfigBase:
        """The config of a mapping of field names; on a class with a ``preset`` classmethod, a ``preset`` key names
        the preset that the other keys override."""
        if not isinstance(d, dict):
            raise ConfigError(f"{cls.__name__}: expected a mapping of field names to values, got {d!r}")
        if "preset" in d and callable(getattr(cls, "preset", None)):
            d = dict(d)
            name = d.pop("preset")
            cls.check_names(d, f" beside preset {name!r}")
            return cls.preset(name, **d)  # type: ignore[attr-defined]
        cls.check_names(d)
        return cls(**d)

    def to_yaml(self, path: str | Path | None = None) -> str:
        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_yaml(cls, path_or_text: str | Path) -> ConfigBase:
        """Load from a YAML file path, or from YAML text (anything containing a newline or ':')."""
        return cls.from_dict(read_yaml_mapping(path_or_text, cls.__name__))

    def replace(self, **changes: Any) -> ConfigBase:
        """``dataclasses.replace`` (validated like construction)."""
        return dataclasses.replace(self, **changes)

    def updated(self, changes: dict[str, Any], where: str = "") -> ConfigBase:
        """A copy with ``changes`` applied, keys being field names or dotted paths into nested sections
        (``{"optim.lr": 1e-3, "refine.steps": 2}``); an unknown name is a ConfigError naming ``where``."""
        own: dict[str, Any] = {}
        nested: dict[str, dict[str, Any]] = {}
        for key, value in changes.items():
            head, _, rest = key.partition(".")
            if head not in self.field_names():
                raise ConfigError(f"{where}{key}: {type(self).__name__} has no field {head!r}")
            if rest:
                if not isinstance(getattr(self, head), ConfigBase):
                    raise ConfigError(f"{where}{key}: {type(self).__name__}.{head} has no fields")
                nested.setdefault(head, {})[rest] = value
            else:
                own[head] = value
        for head, sub in nested.items():
            own[head] = getattr(self, head).updated(sub, f"{where}{head}.")
        return dataclasses.replace(self, **own) if own else self

