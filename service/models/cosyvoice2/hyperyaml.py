"""HyperPyYAML (`cosyvoice2.yaml`) read as data, without torch: the server's API process reads a
directory's prompt settings through it.

`!new:module.Class` builds objects, `!name:` names functions, `!apply:` calls them, `!ref <key>`
refers to (and does arithmetic on) other keys. Here tags become plain mappings, references are
resolved, nothing is imported or called."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.models.cosyvoice2.voices import CONFIG_FILE


class ConfigError(ValueError):
    """The directory's configuration is missing, unreadable or asks for a variant we do not build."""


@dataclass
class Tagged:
    """A `!new:` / `!name:` node: the target's dotted name and its arguments."""

    tag: str
    target: str
    args: Any


@dataclass
class _Ref:
    expression: str


def _yaml() -> Any:
    try:
        import yaml
    except ImportError as exc:
        raise ConfigError("reading a CosyVoice2 directory needs PyYAML: pip install 'cadenza[cosyvoice2]'") from exc
    return yaml


def _loader() -> Any:
    yaml = _yaml()
    loader: Any = type("Loader", (yaml.SafeLoader,), {})  # a subclass, so the constructors stay ours

    def tagged(loader: Any, suffix: str, node: Any) -> Any:
        kind, _, target = suffix.partition(":")
        if isinstance(node, yaml.MappingNode):
            args: Any = loader.construct_mapping(node, deep=True)
        elif isinstance(node, yaml.SequenceNode):
            args = loader.construct_sequence(node, deep=True)
        else:
            args = loader.construct_scalar(node)
        return Tagged(kind, target, args)

    def ref(loader: Any, node: Any) -> _Ref:
        return _Ref(str(loader.construct_scalar(node)))

    loader.add_multi_constructor("!", tagged)
    loader.add_constructor("!ref", ref)
    return loader


def _resolve(value: Any, top: dict[str, Any]) -> Any:
    if isinstance(value, _Ref):
        names = re.findall(r"<([\w.]+)>", value.expression)
        if missing := [n for n in names if n not in top]:
            raise ConfigError(f"{CONFIG_FILE}: reference to undefined {', '.join(missing)}")
        if m := re.fullmatch(r"\s*<([\w.]+)>\s*", value.expression):
            return _resolve(top[m.group(1)], top)
        expr = re.sub(r"<([\w.]+)>", lambda m: repr(_resolve(top[m.group(1)], top)), value.expression)
        if not re.fullmatch(r"[\d\s.+\-*/()'\"eE]+|'[^']*'|\"[^\"]*\"", expr):
            raise ConfigError(f"unsupported reference {value.expression!r}")
        return eval(expr, {"__builtins__": {}})  # numbers and + - * / only (checked above)
    if isinstance(value, Tagged):
        return Tagged(value.tag, value.target, _resolve(value.args, top))
    if isinstance(value, dict):
        return {k: _resolve(v, top) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, top) for v in value]
    return value


def read_yaml(path: Path) -> dict[str, Any]:
    """The file as plain data (tags as `Tagged`, references resolved)."""
    yaml = _yaml()

    try:
        data = yaml.load(path.read_text("utf-8"), Loader=_loader())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a mapping of settings")
    return {k: _resolve(v, data) for k, v in data.items()}
