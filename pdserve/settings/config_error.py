"""The error every settings check raises, free of pydantic: the data plane's runtime helpers
(the cluster secret, TLS) raise it on a GPU image that has no pydantic."""


class ConfigError(ValueError):
    """Settings refused, naming the field."""
