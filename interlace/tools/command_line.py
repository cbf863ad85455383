"""The argument parser every ``interlace <command>`` builds: its name in the usage line, a
plain-text description, and each option's default after its help."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help with ``(default: ...)`` after an option's help, a list's items as one would
    type them. Not where the help says its default itself, in parentheses (a None, or a default
    that depends on the machine, is explained in words), nor for a switch's False."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "(default" in text or default is None or default is False or default is argparse.SUPPRESS or default == []:
            return text
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        # (the help is %-formatted by argparse: a '%' in the default is escaped)
        return f"{text} (default: {shown.replace('%', '%%')})"


def command_parser(command: str, description: str, **kwargs) -> argparse.ArgumentParser:
    """The parser of ``interlace <command>``; ``description``: plain text (``--help`` prints it as is)."""
    return argparse.ArgumentParser(prog=f"interlace {command}", description=description,
                                   formatter_class=HelpFormatter, **kwargs)
