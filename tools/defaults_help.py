"""--help of the tools: each option's default printed from its parser, so that no help text repeats it by hand (and
drifts from it)."""
from __future__ import annotations

import argparse


def shown(default) -> str:
    """A default as it is typed on the command line: a list of several values (nargs="*") space-separated."""
    return " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)


class DefaultsHelp(argparse.HelpFormatter):
    """argparse's help, with "(default: X)" after the help of each option that has a value unless it is given (X: the
    parser's own, `shown`); not for one without (None, or an empty text: its help says what then) nor a flag's (on or
    off). argparse.ArgumentDefaultsHelpFormatter adds it to all of these too: "(default: None)", "(default: False)"."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.option_strings and action.nargs != 0 and action.default not in (None, "", argparse.SUPPRESS):
            return f"{text} (default: {shown(action.default).replace('%', '%%')})".lstrip()
        return text


class RawDescriptionDefaultsHelp(DefaultsHelp, argparse.RawDescriptionHelpFormatter):
    """DefaultsHelp with the description printed as it is written (the benches' docstrings: tables, commands)."""
