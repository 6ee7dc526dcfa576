"""Settings models on the command line: one flag per field, its type, choices, help and default
taken from the model, so a knob is written once. A flag left out is not set in the namespace,
so the model's default applies; `--settings-json` gives a whole document (what a launcher
passes its child), which flags given beside it override."""

import argparse
import json
import types
import typing

from pydantic import BaseModel, ValidationError

from pdserve.settings.base import ConfigError, refusal


def add_arguments(
    parser,
    model: type[BaseModel],
    exclude: tuple[str, ...] = (),
    only: tuple[str, ...] | None = None,
) -> None:
    """A flag for each field of `model` (nested settings get theirs too), but those in
    `exclude`, or only those in `only`."""
    for name, field in model.model_fields.items():
        extra = field.json_schema_extra or {}
        if name in exclude or extra.get("cli") is False:
            continue
        if _is_model(field.annotation):
            if only is None:
                add_arguments(parser, field.annotation, exclude)
            continue
        if only is not None and name not in only:
            continue
        kind = _base_type(field.annotation)
        help_text = field.description
        if "(default:" not in help_text:
            help_text += f" (default: {_show_default(field.default)})"
        options = {"dest": name, "default": argparse.SUPPRESS, "help": help_text.replace("%", "%%")}
        if typing.get_origin(kind) is typing.Literal:
            options["choices"] = typing.get_args(kind)
        elif typing.get_origin(kind) is list:
            options["action"] = "append"
            options["metavar"] = extra.get("metavar")
        elif kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        else:
            options["type"] = kind
        if "type" in options:
            options["metavar"] = extra.get("metavar") or (
                "SECONDS"
                if name.endswith("_s")
                else flag(name, field)[2:].replace("-", "_").upper()
            )
        parser.add_argument(flag(name, field), **options)


def add_settings_json(parser) -> None:
    parser.add_argument(
        "--settings-json",
        default=None,
        metavar="JSON",
        help="all settings as one JSON document (what `pdserve serve` and "
        "`pdserve up` pass a child); flags given beside it override it",
    )


def from_arguments(kind: type[BaseModel], args: argparse.Namespace, **fixed):
    """Build settings of `kind` from the flags given (and `--settings-json`, and `fixed`
    values), or raise ConfigError naming the flag."""
    try:
        document = json.loads(getattr(args, "settings_json", None) or "{}")
    except json.JSONDecodeError as error:
        raise ConfigError(f"--settings-json: not valid JSON: {error}") from None
    values = _merge(document, _given(kind, args))
    values.update(fixed)
    try:
        return kind.model_validate(values)
    except ValidationError as error:
        raise refusal(error, kind, name=lambda loc: _flag_at(kind, loc)) from None


def flag(name: str, field) -> str:
    return (field.json_schema_extra or {}).get("flag", "--" + name.replace("_", "-"))


def _given(model: type[BaseModel], args: argparse.Namespace) -> dict:
    values = {}
    for name, field in model.model_fields.items():
        if _is_model(field.annotation):
            nested = _given(field.annotation, args)
            if nested:
                values[name] = nested
        elif hasattr(args, name):
            values[name] = getattr(args, name)
    return values


def _merge(base: dict, override: dict) -> dict:
    merged = dict(base)
    for key, value in override.items():
        merged[key] = (
            _merge(merged[key], value)
            if isinstance(value, dict) and isinstance(merged.get(key), dict)
            else value
        )
    return merged


def _flag_at(model: type[BaseModel], loc: tuple) -> str:
    for part in loc:
        field = model.model_fields.get(str(part))
        if field is None:
            return str(part)
        if not _is_model(field.annotation):
            return flag(str(part), field)
        model = field.annotation
    return ".".join(map(str, loc))


def _is_model(annotation) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _base_type(annotation):
    """`int | None` -> int."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        (kind,) = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return kind
    return annotation


def _show_default(value) -> str:
    return "none" if value in (None, "", []) else str(value)
