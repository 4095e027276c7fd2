"""``causalmem status``'s principals line (contract 1.15): read from the newest manifest's metrics,
what does not parse left out, the flagged principals and the quarantined ones named."""

from __future__ import annotations

from pipeline.modeltopic import ModelTopicIndex
from pipeline.status.principals import principals_view, principals_view_of
from pipeline.status.render import principals_text


def test_no_checkpoint_no_principals() -> None:
    assert principals_view(ModelTopicIndex(), "default") == {"principals": [], "flagged": [], "quarantined": []}


def test_entries_that_do_not_parse_are_left_out() -> None:
    view = principals_view_of(
        {
            "principals": {
                "bad name": {"share": 0.5},
                "svc-a": "not an object",
                "svc-b": {"share": "x", "weight": float("nan"), "n": 3, "flagged": 1, "quarantined": False},
            },
            "quarantined": ["ok-1", "not ok", 7],
        }
    )
    assert [p["name"] for p in view["principals"]] == ["svc-b"]
    assert view["principals"][0]["share"] == 0.0 and view["principals"][0]["weight"] is None
    assert view["flagged"] == [] and view["quarantined"] == ["ok-1"]


def test_the_line_names_the_quarantined_and_the_largest_shares() -> None:
    view = principals_view_of(
        {
            "quarantined": ["bot-9"],
            "principals": {
                "bot-9": {"share": 0.0, "weight": 0.0, "n": 80, "flagged": True, "quarantined": True},
                "svc-a": {"share": 0.6, "weight": 1.0, "n": 500, "flagged": False, "quarantined": False},
                "svc-b": {"share": 0.4, "weight": 1.0, "n": 300, "flagged": False, "quarantined": False},
            },
        }
    )
    text = principals_text(view).plain
    assert "FLAGGED" not in text  # flagged and already quarantined: nothing left to act on
    assert "quarantined bot-9" in text and "top: svc-a 60%, svc-b 40%" in text
