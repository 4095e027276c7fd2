"""The operator verbs' arguments and answers (``suppress``, ``unsuppress``, ``rollback``), without a broker."""

from __future__ import annotations

import argparse

import pytest

from pipeline.cli import VERBS, build_parser
from pipeline.cli.common import SETTING_KEYS, settings_from
from pipeline.config import Settings
from pipeline.extras import MissingExtra
from topics.fields import encode
from topics.internal import Control, dead_letter_value


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


def test_a_dead_letter_answers_the_command_it_holds_and_no_other() -> None:
    from pipeline.cli.answers import refusal_in

    ctl = Control(command="rollback", ts=1.0, details={"to_version": 5}, id="rollback-1")
    raw = encode(ctl.to_dict())
    record = dead_letter_value(raw, "out_of_range", "v5 is not kept", "p.control", 0, 7, 2.0)
    refusal = refusal_in(encode(record), "rollback-1", "p.control")
    assert refusal is not None and (refusal.reason, refusal.detail) == ("out_of_range", "v5 is not kept")
    assert refusal_in(encode(record), "rollback-2", "p.control") is None  # another command's
    assert refusal_in(encode(record), "rollback-1", "other.control") is None  # another deployment's
    other = dead_letter_value(b'{"id": "rollback-1"}', "bad_json", "x", "p.retrieval-events", 0, 1, 2.0)
    assert refusal_in(encode(other), "rollback-1", "p.control") is None  # not a control record
    for junk in (None, b"", b"{", b"[]", encode({"source": {"topic": "p.control"}, "original": "{"})):
        assert refusal_in(junk, "rollback-1", "p.control") is None


def test_rollback_list_names_the_earlier_versions_the_topic_or_the_learners_directory_keeps() -> None:
    from pipeline.cli.rollback import rollback_targets

    topic = {7: "periodic", 9: "suppress", 10: "periodic"}  # versions whose chunks the topic still holds
    local = {5: "periodic", 6: "rollback", 7: "periodic", 9: "suppress", 10: "periodic"}
    targets = rollback_targets(topic, local, newest=10, serving=9)
    assert [(t.version, t.reason, t.where, t.serving) for t in targets] == [
        (9, "suppress", ("model topic", "local directory"), True),
        (7, "periodic", ("model topic", "local directory"), False),
        (6, "rollback", ("local directory",), False),
        (5, "periodic", ("local directory",), False),
    ]  # newest first; the newest version itself is no rollback
    assert rollback_targets({}, {}, newest=1, serving=1) == []
