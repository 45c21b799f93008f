"""Every command's `--help` explains every option and shows its default."""
from __future__ import annotations

import argparse
import importlib

import pytest

from train.cli import HelpFormatter

# module, and the arguments that reach its parser
COMMANDS = [
    ("train.__main__", []),
    ("train.data.__main__", []),
    ("tools.tile.__main__", []),
    ("tools.export", []),
    ("tools.view.__main__", []),
    ("tools.make_scene", []),
    ("tools.plan.__main__", []),
    ("tools.bench.render", []),
    ("tools.bench.store", []),
    ("tools.bench.tile", []),
    ("tools.bench.train", []),
    ("tools.bench.mpi", ["volume"]),
    ("tools.bench.mpi", ["scaling"]),
    ("tools.bench.mpi", ["planned"]),
    ("tools.bench.densify", []),
    ("tools.bench.view", []),
    ("tools.bench.occlusion", []),
    ("tools.bench.opensplat", []),
    ("tools.bench.scale", []),
    ("tools.bench.gpu", []),
]


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def _parser_of(module: str, argv: list[str], monkeypatch) -> argparse.ArgumentParser:
    """The parser a command builds, caught as it starts parsing (a pre-parser without -h is let through)."""
    original = argparse.ArgumentParser.parse_known_args

    def capture(self, args=None, namespace=None):
        if not self.add_help:
            return original(self, args, namespace)
        raise _Captured(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
    with pytest.raises(_Captured) as caught:
        importlib.import_module(module).main([*argv, "--help"])
    return caught.value.parser


@pytest.mark.parametrize("module, argv", COMMANDS, ids=[" ".join([m, *a]) for m, a in COMMANDS])
def test_every_option_says_what_it_does_and_its_default(module, argv, monkeypatch):
    parser = _parser_of(module, argv, monkeypatch)
    assert issubclass(parser.formatter_class, HelpFormatter), f"{parser.prog}: use train.cli.HelpFormatter"
    formatter = parser._get_formatter()
    missing = []
    for action in parser._actions:
        if (isinstance(action, argparse._HelpAction) or not action.option_strings or action.required
                or action.help == argparse.SUPPRESS):  # nothing to default; or hidden (a child process's)
            continue
        text = formatter._get_help_string(action) if action.help else ""
        if not action.help or "default" not in text:
            missing.append(action.option_strings[-1])
    assert not missing, f"{parser.prog}: options without help or a default shown: {', '.join(missing)}"
    parser.format_help()  # every help string formats (a bare % would not)


def test_a_default_said_in_words_is_not_repeated():
    parser = argparse.ArgumentParser(formatter_class=HelpFormatter)
    parser.add_argument("--a", type=int, default=3, help="a number")
    parser.add_argument("--b", default=None, help="a path (default: the store's)")
    parser.add_argument("--c", action="store_true", help="a switch")
    text = " ".join(parser.format_help().split())
    assert "a number (default: 3)" in text and "(default: the store's)" in text
    assert "(default: None)" not in text and "a switch (default: False)" in text
