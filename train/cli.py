"""What every command line of the project shares: how `--help` shows defaults."""
from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults formatter, except where an option's help already says its default in
    words ("default: the store's") or has nothing to show (a None default)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS) or not action.option_strings:
            return text
        return text + " (default: %(default)s)"
