"""The operator verbs' arguments and answers (``suppress``, ``unsuppress``, ``rollback``), without a broker."""

from __future__ import annotations

import argparse

import pytest

from pipeline.cli import VERBS, build_parser
from pipeline.cli.common import SETTING_KEYS, settings_from
from pipeline.config import Settings
from pipeline.extras import MissingExtra


def _parse(argv: list[str]) -> argparse.Namespace:
    return build_parser(argv).parse_args(argv)


@pytest.mark.parametrize("verb", ["suppress", "unsuppress"])
def test_the_memories_a_suppression_names_leave_the_slots_setting_alone(verb: str) -> None:
    """``--slots 17 42`` (the memories) used to overwrite Settings.slots (S): every call crashed with
    ``TypeError: '<' not supported between instances of 'list' and 'int'``."""
    args = _parse([verb, "--slots", "17", "42", "--by", "ops"])
    assert settings_from(args).slots == Settings().slots
    assert args.memory_slots == [17, 42]


def test_no_verb_option_puts_a_list_into_a_setting() -> None:
    """A verb's own option whose name is a setting's would be read as that setting (settings_from)."""
    for verb in VERBS:
        try:
            parser = build_parser([verb])
        except MissingExtra:
            continue
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        for action in sub.choices[verb]._actions:
            if action.dest in SETTING_KEYS:
                many = action.nargs in ("+", "*") or (isinstance(action.nargs, int) and action.nargs > 1)
                assert not many, f"causalmem {verb} {action.option_strings} is a list, read as setting {action.dest}"
