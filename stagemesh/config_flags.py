"""Command-line flags made from config dataclasses, and the configs made back from parsed flags, so that a
knob is written once: its name, default, type and docstring in the dataclass, its bounds in __post_init__.

A field's flag is `--` and its name with dashes (`kv_cache_gb` -> `--kv-cache-gb`); its default is the
field's (no default: a required flag); its type comes from the annotation: int, float, str; bool is a switch
(`--preload`); `X | None` parses as X; `list[str]` may be repeated; `Literal[...]` gives the choices. Its
help is the field's docstring, the string right after it in the class body. A nested dataclass field is
flattened (its fields are flags too, without a prefix); a `dict[str, Dataclass]` field gives one set of
flags per key of its default, each flag prefixed with the key (`limits["high"].max_waiting` ->
`--high-max-waiting`).

Where a field differs, `field(metadata=...)` says how:
  "flag": the flag's name (`--layers`), or None for a field that is no user knob (no flag);
  "deprecated": an old spelling of the flag, still accepted for one release (the CLI warns when it is used);
  "type": parses the flag's text (a ValueError it raises is the user's error); when several fields of one
          class share a flag (`--layers A:B` -> layer_start, layer_end), it returns their values in order;
  "choices", "metavar": as in argparse;
  "positional": True: a positional argument named after the field (`stagemesh certs DIR`), not a `--` flag.

The same values can come from a TOML file (`--config FILE`) and from the environment (`STAGEMESH_<FLAG>`: the flag's
name in capitals, dashes as underscores); a flag given wins over the environment, the environment over the file, the
file over the defaults (defaults_from). The file's schema is the config dataclasses: a field by its name, a nested
config as a table of its own fields (`[batcher]`), a dict of configs as a table per key (`[limits.high]`); a flag's
own name (`layers = "0:4"`) is accepted at the top level too. A key the schema does not know is refused by name.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

FLAG, TYPE, CHOICES, METAVAR, POSITIONAL, DEPRECATED = "flag", "type", "choices", "metavar", "positional", "deprecated"
ENV_PREFIX = "STAGEMESH_"
NOT_A_FLAG = types.MappingProxyType({FLAG: None})
"""metadata of a field that is no user knob: it gets no flag and keeps its default."""
PORT_RULE = "must be 0..65535 (0 picks a free port)"


@dataclass(frozen=True)
class Knob:
    """One flag and the config fields it sets (each a path of names and dict keys from the top config)."""

    flag: str
    paths: tuple[tuple[str, ...], ...]
    kwargs: dict[str, Any]
    aliases: tuple[str, ...] = ()
    """Old spellings of the flag, still accepted."""

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def positional(self) -> bool:
        return not self.flag.startswith("--")

    @property
    def env(self) -> str:
        """The environment variable that stands for the flag: STAGEMESH_KV_CACHE_GB for --kv-cache-gb."""
        return ENV_PREFIX + self.dest.upper()


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal after it in the class body), whitespace folded."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    return {
        node.target.id: " ".join(after.value.value.split())
        for node, after in zip(body, body[1:], strict=False)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)
    }


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _optional(hint: Any) -> Any:
    """X for `X | None`, else the hint itself."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _dict_of_dataclass(hint: Any) -> type | None:
    if typing.get_origin(hint) is dict and dataclasses.is_dataclass(typing.get_args(hint)[1]):
        return typing.get_args(hint)[1]
    return None


def _user_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """The field's own parser, its ValueError shown to the user as argparse shows a bad value."""

    def parse_flag(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None

    return parse_flag


def _argparse_kwargs(f: dataclasses.Field, hint: Any, default: Any, flag: str, doc: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"help": doc.replace("%", "%%")}
    hint = _optional(hint)
    if default is dataclasses.MISSING:
        if not f.metadata.get(POSITIONAL):  # argparse: a positional argument is required by being one
            kwargs["required"] = True
    else:
        kwargs["default"] = default
    if hint is bool:
        kwargs["action"] = argparse.BooleanOptionalAction if default else "store_true"
        return kwargs
    if TYPE in f.metadata:
        kwargs["type"] = _user_type(f.metadata[TYPE])
    elif typing.get_origin(hint) is typing.Literal:
        kwargs["choices"] = typing.get_args(hint)
        kwargs["type"] = type(kwargs["choices"][0])
    elif typing.get_origin(hint) is list:
        kwargs["action"] = "append"
        kwargs["type"] = typing.get_args(hint)[0]
        kwargs["default"] = None  # argparse appends to a given default; an unset flag keeps the field's
    elif hint in (int, float, str):
        kwargs["type"] = hint
    else:
        raise TypeError(f"{flag}: no flag for a field of type {hint!r}; give it metadata 'type' or 'flag': None")
    for key in (CHOICES, METAVAR):
        if key in f.metadata:
            kwargs[key] = f.metadata[key]
    return kwargs


def _walk(cls: type, defaults: Any = None, prefix: str = "", path: tuple[str, ...] = ()) -> list[Knob]:
    """The knobs of `cls`; `defaults` is the parent's default instance of it, if it is nested (a parent
    may default a nested config to other values than the nested class's own defaults)."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    knobs: dict[str, Knob] = {}
    nested: list[Knob] = []
    for f in dataclasses.fields(cls):
        if not f.init or f.metadata.get(FLAG, "") is None:
            continue
        hint = hints[f.name]
        default = _default(f) if defaults is None else getattr(defaults, f.name)
        if dataclasses.is_dataclass(hint):
            nested += _walk(hint, default, prefix, (*path, f.name))
        elif value_cls := _dict_of_dataclass(hint):
            for key, value in default.items():
                nested += _walk(value_cls, value, f"{prefix}{key}-", (*path, f.name, key))
        else:
            flag = "--" + prefix + f.metadata.get(FLAG, f.name.replace("_", "-")).removeprefix("--")
            if f.metadata.get(POSITIONAL):
                flag = prefix.replace("-", "_") + f.name
            if flag in knobs:  # a flag that sets several fields
                knobs[flag] = dataclasses.replace(knobs[flag], paths=(*knobs[flag].paths, (*path, f.name)))
                continue
            doc = docs.get(f.name, "")
            kwargs = _argparse_kwargs(f, hint, default, flag, f"{prefix[:-1]}: {doc}" if prefix else doc)
            aliases = (f"--{prefix}{f.metadata[DEPRECATED].removeprefix('--')}",) if DEPRECATED in f.metadata else ()
            knobs[flag] = Knob(flag, ((*path, f.name),), kwargs, aliases)
    return [*knobs.values(), *nested]


@functools.cache
def knobs(cls: type) -> tuple[Knob, ...]:
    """Every flag of config class `cls`, nested configs flattened, in field order."""
    found = _walk(cls)
    flags = [k.flag for k in found]
    if twice := sorted({f for f in flags if flags.count(f) > 1}):
        raise TypeError(f"{cls.__name__}: fields of different configs have the same flag: {twice}")
    return tuple(found)


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """Adds a flag for every user knob of config class `cls` (see the module's docstring)."""
    for knob in knobs(cls):
        if knob.positional:  # argparse takes a positional argument's dest from its name
            parser.add_argument(knob.dest, **knob.kwargs)
        else:
            parser.add_argument(knob.flag, *knob.aliases, dest=knob.dest, **knob.kwargs)


def deprecated_spellings(cls: type) -> dict[str, str]:
    """Each old spelling of a flag of `cls`, and the flag it now is."""
    return {alias: knob.flag for knob in knobs(cls) for alias in knob.aliases}


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _env_value(knob: Knob, text: str) -> Any:
    """A flag's value from its environment variable's text: a switch from true/false words, a repeatable flag's
    items separated by spaces, else the text itself (argparse parses a string default as it parses the flag)."""
    action = knob.kwargs.get("action")
    if action in ("store_true", argparse.BooleanOptionalAction):
        if text.strip().lower() not in (*_TRUE, *_FALSE):
            raise ValueError(f"{knob.env}={text!r}: use one of {', '.join(_TRUE + _FALSE)}")
        return text.strip().lower() in _TRUE
    if action == "append":
        parse = knob.kwargs.get("type", str)
        return [parse(item) for item in text.split()]
    return text


def _leaves(tree: dict, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += _leaves(value, (*path, key))
        else:
            out.append((*path, key))
    return out


def _lookup(tree: dict, path: tuple[str, ...]) -> Any:
    for name in path:
        if not isinstance(tree, dict) or name not in tree:
            return dataclasses.MISSING
        tree = tree[name]
    return tree


def _file_value(knob: Knob, data: dict) -> Any:
    """The knob's value in a config file's data (its fields by their dataclass paths, or its flag's own name at
    the top level), or MISSING."""
    if (by_name := data.get(knob.dest, dataclasses.MISSING)) is not dataclasses.MISSING:
        return by_name
    values = [_lookup(data, path) for path in knob.paths]
    if all(v is dataclasses.MISSING for v in values):
        return dataclasses.MISSING
    if len(values) > 1:  # a flag that sets several fields (--layers): every one of them, or its own name
        if any(v is dataclasses.MISSING for v in values):
            raise ValueError(f"give every one of {', '.join('.'.join(p) for p in knob.paths)} in the file, or "
                             f"{knob.dest} = \"...\" as the flag takes it")
        return tuple(values)
    return values[0]


def defaults_from(cls: type, file_data: dict, environ: typing.Mapping[str, str]) -> dict[str, Any]:
    """{dest: value} for every flag of `cls` that the config file's data or the environment sets (the environment
    winning); a flag given on the command line wins over both (they become the parser's defaults). ValueError
    naming the key or variable for a key the schema does not know or a value out of a flag's choices."""
    known_paths = {path for knob in knobs(cls) for path in knob.paths} | {(knob.dest,) for knob in knobs(cls)}
    if unknown := [".".join(p) for p in _leaves(file_data) if p not in known_paths]:
        raise ValueError(f"{', '.join(sorted(unknown))}: not a setting of this command (the config file's keys are "
                         "the flags' fields, e.g. kv_cache_gb or [batcher] max_batch_tokens)")
    values: dict[str, Any] = {}
    for knob in knobs(cls):
        if knob.positional:
            continue
        where, value = f"the config file's {knob.dest}", _file_value(knob, file_data)
        if knob.env in environ:
            where, value = knob.env, _env_value(knob, environ[knob.env])
        if value is dataclasses.MISSING:
            continue
        choices = knob.kwargs.get("choices")
        if choices is not None and not isinstance(value, str) and value not in choices:
            raise ValueError(f"{where} = {value!r}: use one of {', '.join(map(str, choices))}")
        if choices is not None and isinstance(value, str) and value not in map(str, choices):
            raise ValueError(f"{where} = {value!r}: use one of {', '.join(map(str, choices))}")
        values[knob.dest] = value
    return values


def from_args(cls: type, args: argparse.Namespace) -> Any:
    """The config the parsed flags describe: `cls` and its nested configs, built bottom-up (so each one's
    __post_init__ checks its own bounds). Fields without a flag, and unset list flags, keep their defaults."""
    values: dict = {}
    for knob in knobs(cls):
        value = getattr(args, knob.dest)
        if value is None and knob.kwargs.get("action") == "append":
            continue
        if len(knob.paths) == 1:
            items = (value,)
        else:  # a flag that sets several fields: its parser gave a value for each
            items = (None,) * len(knob.paths) if value is None else value
        for path, item in zip(knob.paths, items, strict=True):
            tree = values
            for name in path[:-1]:
                tree = tree.setdefault(name, {})
            tree[path[-1]] = item
    return _build(cls, values)


def _build(cls: type, values: dict, defaults: Any = None) -> Any:
    """`cls` from the flags' values; a nested config starts from its parent's default for it (`defaults`)."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in values:
            continue
        default = _default(f) if defaults is None else getattr(defaults, f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = _build(hints[f.name], values[f.name], default)
        elif value_cls := _dict_of_dataclass(hints[f.name]):
            kwargs[f.name] = {key: _build(value_cls, sub, default.get(key)) for key, sub in values[f.name].items()}
        else:
            kwargs[f.name] = values[f.name]
    return cls(**kwargs) if defaults is None else dataclasses.replace(defaults, **kwargs)


def flag_of(cls: type, *path: str) -> str:
    """The flag that sets the field at `path` of config class `cls` (its name if it has none)."""
    return next((k.flag for k in knobs(cls) if path in k.paths), ".".join(path))


def refused(config: Any, path: str, rule: str) -> ValueError:
    """The error for a field out of its bounds: its flag, its value and the rule, which says what to change,
    e.g. "--speed 0: must be > 0 (a relative speed; 1.0 is an ordinary host)". `path` is the field's name,
    dotted through dict keys and nested configs ("limits.high.max_waiting")."""
    value = config
    for name in path.split("."):
        value = value[name] if isinstance(value, dict) else getattr(value, name)
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # as typed: --speed 0
    return ValueError(f"{flag_of(type(config), *path.split('.'))} {value}: {rule}")
