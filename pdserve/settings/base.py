"""The base of every settings model, and how a refused value is reported: by its dotted path
(`prefill.tensor_parallel_size: must be an integer >= 1, got 0`) or by its command-line flag."""

from pydantic import BaseModel, ConfigDict, ValidationError

from pdserve.settings.config_error import ConfigError


class Settings(BaseModel):
    """Unknown fields are refused and nothing is coerced ("2" is not an int)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def refusal(error: ValidationError, model: type[BaseModel], name=None) -> ConfigError:
    """The first error as a ConfigError. `name(loc)` says how a field is called (default: its
    dotted path; the command line passes its flag)."""
    first = error.errors()[0]
    loc = tuple(first["loc"])
    where = (name or dotted)(loc) if loc else "the file"
    return ConfigError(f"{where}: {_reason(first, model, loc)}")


def dotted(loc: tuple) -> str:
    return ".".join(str(part) for part in loc)


def _reason(error: dict, model: type[BaseModel], loc: tuple) -> str:
    kind, ctx, value = error["type"], error.get("ctx") or {}, error["input"]
    if kind == "extra_forbidden":
        parent = _model_at(model, loc[:-1])
        known = ", ".join(parent.model_fields) if parent is not None else ""
        return f"unknown field (known: {known})"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"must be a mapping, got {_show(value)}"
    if kind == "literal_error":
        allowed = ctx["expected"].replace("'", "").replace(" or ", ", ")
        return f"must be one of {allowed}, got {value!r}"
    if kind in ("greater_than_equal", "greater_than"):
        bound = ctx.get("ge", ctx.get("gt"))
        sign = ">=" if "ge" in ctx else ">"
        what = "an integer" if isinstance(bound, int) and not isinstance(bound, bool) else ""
        shown = f"{bound:g}" if isinstance(bound, float) else bound
        return f"must be {what + ' ' if what else ''}{sign} {shown}, got {value}"
    names = {
        "int_type": "an integer",
        "float_type": "a number",
        "string_type": "a string",
        "bool_type": "true or false",
    }
    if kind in names:
        return f"must be {names[kind]}, got {_show(value)}"
    return error["msg"].removeprefix("Value error, ")


def _model_at(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    for part in loc:
        field = model.model_fields.get(str(part))
        if field is None or not (
            isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
        ):
            return None
        model = field.annotation
    return model


def _show(value) -> str:
    return f"{type(value).__name__} {value!r}"
