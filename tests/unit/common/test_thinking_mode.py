"""The thinking mode of a request and of a set of samples: the switch read from either key the
templates use (Qwen3's enable_thinking, Kimi-K2.5's thinking), none when the request sent none,
and one name for a set of samples (on, off, mixed, unknown)."""

import json

import pytest

from eaglenest.common.thinking import mode_of_data, modes_of, request_switch, summary


@pytest.mark.parametrize(
    ("kwargs", "switch"),
    [
        ({"enable_thinking": True}, True),
        ({"enable_thinking": False}, False),
        ({"thinking": False}, False),
        ({"thinking": True, "other": 1}, True),
        ({}, None),
        (None, None),
        ({"enable_thinking": "no"}, None),  # not a boolean: the template's own default decides
    ],
)
def test_the_switch_a_request_sent(kwargs, switch):
    request = {"messages": [], "model": "m"}
    if kwargs is not None:
        request["chat_template_kwargs"] = kwargs
    assert request_switch(json.dumps(request, sort_keys=True)) is switch


def test_a_request_that_is_not_json_sent_no_switch():
    assert request_switch("{not json") is None and request_switch(None) is None


def test_one_name_for_a_set_of_samples():
    assert mode_of_data(modes_of([True, True])) == "on"
    assert mode_of_data(modes_of([False])) == "off"
    assert mode_of_data(modes_of([True, False])) == "mixed"
    assert mode_of_data(modes_of([True, None])) == "unknown"  # a shard without the column
    assert mode_of_data(modes_of([])) == "unknown"


def test_summary_counts_modes_and_switches():
    assert summary([True, None, False], [True, True, False]) == {
        "mode": "mixed",
        "samples": {"off": 1, "on": 2},
        "switch_sent": {"false": 1, "none": 1, "true": 1},
    }
