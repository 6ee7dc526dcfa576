"""The CLI reference page, rendered at build time from the parsers `pdserve` itself runs
(`pdserve.cli.build_parser`), so each flag's help and default are written once, in code.

An mkdocs hook (mkdocs.yml `hooks:`): a page holding MARKER gets the reference in its place.
tests/unit/test_cli_docs.py calls `render` to check that no flag of any sub-command is missing.
"""

import argparse

from pdserve.cli import build_parser

MARKER = "<!-- cli-reference -->"


def on_page_markdown(markdown: str, **_) -> str:
    return markdown.replace(MARKER, render()) if MARKER in markdown else markdown


def render(parser: argparse.ArgumentParser | None = None) -> str:
    """Markdown: one section per sub-command (nested ones too), a table of its arguments."""
    return "\n".join(_sections(parser or build_parser(), "pdserve"))


def commands(parser: argparse.ArgumentParser, path: str = "pdserve", summary: str = ""):
    """(command path, its one-line help, its parser) for every command that runs (has no
    sub-commands) or takes arguments of its own before its sub-commands."""
    subcommands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subcommands or arguments(parser):
        yield path, summary, parser
    for action in subcommands:
        helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
        for name, sub in action.choices.items():
            yield from commands(sub, f"{path} {name}", helps.get(name, ""))


def arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """What a command takes, but --help and its sub-commands."""
    skip = (argparse._HelpAction, argparse._SubParsersAction)
    return [action for action in parser._actions if not isinstance(action, skip)]


def _sections(parser: argparse.ArgumentParser, path: str):
    for command, summary, sub in commands(parser, path):
        yield f"## `{command}`\n"
        if summary:
            yield _text(summary[0].upper() + summary[1:]) + ".\n"
        rows = arguments(sub)
        if rows:
            yield "| argument | what it does |\n|---|---|"
            yield from (f"| {_name(action)} | {_help(action, command)} |" for action in rows)
            yield ""


def _name(action: argparse.Action) -> str:
    if not action.option_strings:  # a positional argument
        return f"`{action.metavar or action.dest}`" + _choices(action)
    takes_value = action.nargs != 0
    value = (
        f" {action.metavar or action.dest.upper()}" if takes_value and not action.choices else ""
    )
    flags = ", ".join(f"`{flag}{value}`" for flag in action.option_strings)
    return flags + (_choices(action) if takes_value else "")


def _choices(action: argparse.Action) -> str:
    return f" `{{{','.join(map(str, action.choices))}}}`" if action.choices else ""


def _help(action: argparse.Action, command: str) -> str:
    """The help as `--help` prints it (%(default)s and the like filled in)."""
    params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
    params["prog"] = command
    if action.choices:
        params["choices"] = ", ".join(map(str, action.choices))
    text = (action.help or "") % params
    if action.required and action.option_strings:
        text += " (required)"
    return _text(text.strip())


def _text(text: str) -> str:
    """Plain help text made safe inside a Markdown table cell."""
    for raw, safe in (
        ("&", "&amp;"),
        ("<", "&lt;"),
        (">", "&gt;"),
        ("|", "&#124;"),
        ("*", "&#42;"),
    ):
        text = text.replace(raw, safe)
    return text
