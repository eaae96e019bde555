"""--help of the tools that README.md's "Tools" shows: each option's default printed from its parser, so that no help
text repeats it by hand (and drifts from it)."""
from __future__ import annotations

import argparse


class DefaultsHelp(argparse.HelpFormatter):
    """argparse's help, with "(default: X)" after the help of each option that has a value unless it is given (X: the
    parser's own); not for one without (None, or an empty text: its help says what then) nor a flag's (on or off).
    argparse.ArgumentDefaultsHelpFormatter adds it to all of these too: "(default: None)", "(default: False)"."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.option_strings and action.nargs != 0 and action.default not in (None, "", argparse.SUPPRESS):
            return f"{text} (default: %(default)s)".lstrip()
        return text
