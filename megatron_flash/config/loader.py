"""Build a RunConfig: schema defaults ← YAML file(s) ← ``key=value`` overrides → validate.

    cfg = load_config("configs/quickstart_cpu.yaml", ["optimizer.lr=3e-4", "loss.params.eps_high=0.28"])

Every user mistake surfaces as one ``ConfigError`` (a ValueError) whose message names the full
dotted key, the source (file or override) and, for unknown keys, the closest valid key:

    unknown config key 'loss.nmae' (did you mean 'loss.name'?) [override 'loss.nmae=x']

Keys are checked against the schema here, before OmegaConf sees them, so that a misspelled section
(``los.name``) or a YAML key written with dots gets the same message as a misspelled field.
Keys below free-form mapping fields (``loss.params``, ``engines.server_args``) are not checked.

Overrides set one value (``engines.server_args.context_length=160``), replace a free-form mapping
whole when given one (``engines.server_args={}`` empties it, ``loss.params={eps: 0.1}`` leaves only
that entry: a file's mapping entries cannot survive it), or delete with a leading ``~``:
``~engines.server_args.context_length`` removes one entry (refused when it is not there), ``~model.dtype``
puts a field back to the schema's default. Files merge: a later file's mapping adds to an earlier one's.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
import typing
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError

from megatron_flash.config.schema import RunConfig

PathLike = Union[str, "os.PathLike[str]"]
_REDACTED = "<redacted>"
_SECRET_KEYS = ("engines.api_key",)


class ConfigError(ValueError):
    """A config the user must fix; ``str(err)`` is the whole message, ready to print.

    Attributes:
        key: the full dotted key at fault, when there is a single one.
    """

    def __init__(self, message: str, *, key: Optional[str] = None) -> None:
        super().__init__(message)
        self.key = key


# --------------------------------------------------------------------------- schema walk

def _describe(tp: Any) -> str:
    """Human name of a field annotation: int, float or null, list of str, mapping."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Union:
        inner = [a for a in args if a is not type(None)]
        return " or ".join(_describe(a) for a in inner) + " or null"
    if origin in (list, List):
        return f"list of {_describe(args[0])}" if args else "list"
    if origin in (dict, Dict):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _schema_leaves(cls: type = RunConfig, prefix: str = "") -> Iterator[Tuple[str, Any]]:
    """(dotted key, annotation) for every leaf field; free-form dicts count as leaves."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _schema_leaves(tp, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", tp


def _group_by_section(keys: Sequence[str]) -> Dict[str, List[str]]:
    sections: Dict[str, List[str]] = {}
    for key in keys:
        section, _, name = key.partition(".")
        sections.setdefault(section, []).append(name)
    return sections


def _schema_groups(cls: type = RunConfig, prefix: str = "") -> Iterator[str]:
    """Dotted keys of the nested dataclasses below the sections (``model.lora``)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            if prefix:
                yield f"{prefix}{f.name}"
            yield from _schema_groups(hints[f.name], f"{prefix}{f.name}.")


_LEAVES: Dict[str, Any] = dict(_schema_leaves())  # dotted key → annotation
_SECTIONS: Dict[str, List[str]] = _group_by_section(list(_LEAVES))  # section → field names
_GROUPS: Dict[str, List[str]] = {g: [k[len(g) + 1:] for k in _LEAVES if k.startswith(g + ".")]
                                 for g in _schema_groups()}  # nested group → its field names


def flat_keys() -> List[str]:
    """Every valid leaf key, dotted (``trainer.total_steps``), in schema order."""
    return list(_LEAVES)


def _suggest(key: str) -> Optional[str]:
    """The valid key the user most likely meant, or None when nothing is close."""
    group = key.rpartition(".")[0]
    if group in _GROUPS:  # a field of a nested group (model.lora.rnak → model.lora.rank)
        close = difflib.get_close_matches(key.rpartition(".")[2], _GROUPS[group], n=1, cutoff=0.6)
        return f"{group}.{close[0]}" if close else None
    section, _, rest = key.partition(".")
    name = rest.split(".")[0]
    if section in _SECTIONS:
        # Right field, wrong section (trainer.lr → optimizer.lr).
        owners = [s for s, names in _SECTIONS.items() if name in names]
        if len(owners) == 1:
            return f"{owners[0]}.{name}"
        # Wrong field: compare field names only (the shared section prefix says nothing).
        fields_ = _SECTIONS[section]
        close = difflib.get_close_matches(name, fields_, n=1, cutoff=0.6)
        if close:
            return f"{section}.{close[0]}"
        # Abbreviations: rollout.n → n_samples_per_prompt, optimizer.warmup → lr_warmup_steps.
        for found in ([f for f in fields_ if f.startswith(name)],
                      [f for f in fields_ if len(name) >= 3 and name in f]):
            if len(found) == 1:
                return f"{section}.{found[0]}"
        return None
    for guess in difflib.get_close_matches(section, list(_SECTIONS), n=3, cutoff=0.6):
        if not name or name in _SECTIONS[guess]:
            return f"{guess}.{name}" if name else guess
    close = difflib.get_close_matches(key, flat_keys(), n=1, cutoff=0.6)
    return close[0] if close else None


def _unknown_key_message(key: str) -> str:
    guess = _suggest(key)
    if guess is not None:
        return f"unknown config key '{key}' (did you mean '{guess}'?)"
    group = key.rpartition(".")[0]
    if group in _GROUPS:
        return f"unknown config key '{key}' ({group} has: {', '.join(_GROUPS[group])})"
    section = key.partition(".")[0]
    if section in _SECTIONS:
        return f"unknown config key '{key}' ({section} has: {', '.join(_SECTIONS[section])})"
    return f"unknown config key '{key}' (sections: {', '.join(_SECTIONS)})"


def _walk(value: Any, path: Tuple[str, ...], unknown: List[str], leaves: Dict[str, Any]) -> None:
    """Record every schema leaf of ``value`` at ``path`` in ``leaves``, every unknown key in ``unknown``.

    Free-form fields are leaves, so nothing below them is checked.
    """
    key = ".".join(path)
    if path and "." in path[-1]:
        raise ConfigError(f"config key '{key}': a YAML key may not contain '.'; nest it instead "
                          f"({path[-1].split('.')[0]}: {{{path[-1].split('.', 1)[1]}: ...}})", key=key)
    if key in _LEAVES:
        leaves[key] = value
    elif not path or (len(path) == 1 and key in _SECTIONS) or key in _GROUPS:
        if not isinstance(value, Mapping):
            first = (_GROUPS[key] if key in _GROUPS else _SECTIONS.get(key, [""]))[0]
            example = f"{key}.{first}=..." if path else "model: {hf_path: ...}"
            raise ConfigError(f"config key '{key or '<top level>'}' must be a mapping of fields "
                              f"(e.g. {example}), got {value!r}", key=key or None)
        for child, child_value in value.items():
            _walk(child_value, path + (str(child),), unknown, leaves)
    elif len(path) == 1 and isinstance(value, Mapping) and value:
        # A misspelled section: report its leaves (los.name), which is what the user typed.
        unknown.extend(f"{key}.{child}" for child in value)
    else:
        unknown.append(key)


# --------------------------------------------------------------------------- parsing

class _Loader(yaml.SafeLoader):
    """SafeLoader that reads 1e-3 as a float (YAML 1.1 wants 1.0e-3) and rejects duplicate keys."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:float"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _construct_mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> Dict[Any, Any]:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark, f"found duplicate key {key!r}",
                key_node.start_mark)
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _read_yaml(path: PathLike) -> Dict[str, Any]:
    name = os.fspath(path)
    if not os.path.isfile(name):
        raise ConfigError(f"config file not found: {name}")
    with open(name, encoding="utf-8") as stream:
        try:
            data = yaml.load(stream, Loader=_Loader)
        except yaml.MarkedYAMLError as err:
            mark = err.problem_mark or err.context_mark
            where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = err.problem or err.context or "invalid YAML"
            context = ""
            if err.context and err.context_mark is not None and err.problem:
                context = f" ({err.context} at line {err.context_mark.line + 1})"
            raise ConfigError(f"cannot parse YAML config {name}{where}: {problem}{context}") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"cannot parse YAML config {name}: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"YAML config {name} must be a mapping of sections at top level, got {type(data).__name__}")
    return data


def _parse_override(item: str) -> Tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not of the form key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override '{item}' has an empty key or key part")
    if raw == "":
        return key, ""
    if raw.strip() == "-":  # YAML reads a bare "-" as a list holding one null; typed here it is text
        return key, raw.strip()
    try:
        return key, yaml.load(raw, Loader=_Loader)
    except yaml.YAMLError as err:
        if not set(raw) & _YAML_STRUCTURE:  # e.g. "*" (an alias to YAML): plain text as typed
            return key, raw
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError(f"cannot parse the value of override '{item}': {problem}", key=key) from None


_YAML_STRUCTURE = set("[]{}:,'\"#|>")
"""Characters that make an override value YAML structure (a list, a mapping, a quoted string); a value
without them that YAML still cannot read (`*`, `*+`) is taken as the text typed."""


def _nest(key: str, value: Any) -> Dict[str, Any]:
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


# --------------------------------------------------------------------------- merge

def _merge(base: Any, data: Dict[str, Any], source: str) -> Any:
    # `trainer:` with every field commented out parses as None: treat it as empty.
    data = {k: v for k, v in data.items() if not (k in _SECTIONS and v is None)}
    unknown: List[str] = []
    leaves: Dict[str, Any] = {}
    try:
        _walk(data, (), unknown, leaves)
    except ConfigError as err:
        raise ConfigError(f"{err} [{source}]", key=err.key) from None
    if unknown:
        message = "; ".join(_unknown_key_message(key) for key in unknown)
        raise ConfigError(f"{message} [{source}]", key=unknown[0] if len(unknown) == 1 else None)
    for key, value in leaves.items():
        if not _container_fits(_LEAVES[key], value):  # OmegaConf raises a bare TypeError for these
            raise ConfigError(f"config key '{key}' expects {_describe(_LEAVES[key])}, got {value!r} "
                              f"({type(value).__name__}) [{source}]", key=key)
    try:
        return OmegaConf.merge(base, OmegaConf.create(data))
    except OmegaConfBaseException as err:
        raise _translate(err, leaves, source) from None


def _container_fits(annotation: Any, value: Any) -> bool:
    """False when a mapping/list field gets the other kind of container or a scalar."""
    if isinstance(value, str) and value.startswith("${"):  # interpolation, checked on resolve
        return True
    origin = typing.get_origin(annotation)
    if origin in (dict, Dict):
        return isinstance(value, Mapping)
    if origin in (list, List):
        return isinstance(value, (list, tuple))
    return not isinstance(value, (Mapping, list, tuple))


def _translate(err: OmegaConfBaseException, leaves: Dict[str, Any], source: str) -> ConfigError:
    """An OmegaConf error as one line: key, expected type, given value, source."""
    full_key = getattr(err, "full_key", None) or ""
    key = re.sub(r"\[\d+\]$", "", str(full_key))
    if isinstance(err, ValidationError) and key in _LEAVES and key in leaves:
        given = leaves[key]
        return ConfigError(
            f"config key '{key}' expects {_describe(_LEAVES[key])}, got {given!r} "
            f"({type(given).__name__}) [{source}]", key=key)
    first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
    where = f"config key '{full_key}': " if full_key else ""
    return ConfigError(f"{where}{first_line} [{source}]", key=full_key or None)


def _free_mapping(key: str) -> bool:
    return key in _LEAVES and typing.get_origin(_LEAVES[key]) in (dict, Dict)


def _delete(merged: Any, item: str) -> Any:
    """``~key``: a schema field back to its default, or one entry out of a free-form mapping."""
    key = item[1:].strip()
    source = f"override '{item}'"
    if "=" in key or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"{source}: ~ takes a key and no value (e.g. ~engines.server_args.context_length)")
    if key in _LEAVES:
        OmegaConf.update(merged, key, OmegaConf.select(_defaults(), key), merge=False)
        return merged
    parent, _, name = key.rpartition(".")
    if not _free_mapping(parent):
        raise ConfigError(f"{_unknown_key_message(key)} [{source}]", key=key)
    node = OmegaConf.select(merged, parent)
    if name not in node:
        raise ConfigError(f"{source}: {parent} has no entry '{name}' to delete (it has: "
                          f"{', '.join(map(str, node)) or 'nothing'})", key=key)
    del node[name]
    return merged


@functools.lru_cache(maxsize=1)
def _defaults() -> Any:
    # Building the structured node costs ~40 ms; config-heavy tests load hundreds of times.
    return OmegaConf.structured(RunConfig)


def load_config(
    config_path: Optional[Union[PathLike, Sequence[PathLike]]] = None,
    overrides: Sequence[str] = (),
) -> RunConfig:
    """Schema defaults ← YAML file(s), in order ← ``key=value`` overrides; validated.

    Args:
        config_path: a YAML file of overrides, a list of them merged left to right (so
            ``[quickstart_cpu.yaml, loss_tis.yaml]`` composes), or None for defaults only.
        overrides: ``dotted.key=value`` strings; values are parsed as YAML (``[0,1]``, ``null``,
            ``1e-3``); ``key=`` sets the empty string.

    Raises:
        ConfigError: unknown key, wrong type, unreadable YAML or a failed validation.
    """
    if config_path is None:
        paths: List[PathLike] = []
    elif isinstance(config_path, (str, os.PathLike)):
        paths = [config_path]
    else:
        paths = list(config_path)
    if isinstance(overrides, str):
        raise TypeError("overrides must be a sequence of 'key=value' strings, not one string")
    merged = _defaults()  # OmegaConf.merge copies, so the cached node is never modified
    for path in paths:
        merged = _merge(merged, _read_yaml(path), os.fspath(path))
    for item in overrides:
        if item.startswith("~"):
            merged = _delete(merged, item)
            continue
        key, value = _parse_override(item)
        merged = _merge(merged, _nest(key, value), f"override '{item}'")
        if _free_mapping(key) and isinstance(value, Mapping):  # replaces: nothing of earlier entries stays
            OmegaConf.update(merged, key, value, merge=False)
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:  # interpolations resolve here, e.g. ${oc.env:VAR}
        raise _translate(err, {}, "resolving interpolations") from None
    assert isinstance(cfg, RunConfig)
    try:
        cfg.validate()
    except ValueError as err:
        raise ConfigError(str(err), key=str(err).split(" ", 1)[0]) from None
    return cfg


def config_to_yaml(cfg: RunConfig, *, redact: bool = True) -> str:
    """The resolved config as YAML (what --print-config shows and a run directory keeps).

    With ``redact`` (the default) secrets such as ``engines.api_key`` are replaced by a marker,
    so the text is safe to log or upload; pass ``redact=False`` to reproduce the run exactly.
    """
    node = OmegaConf.structured(cfg)
    if redact:
        for key in _SECRET_KEYS:
            if OmegaConf.select(node, key) is not None:
                OmegaConf.update(node, key, _REDACTED)
    return OmegaConf.to_yaml(node, resolve=True)
