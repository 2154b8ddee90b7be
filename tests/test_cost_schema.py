"""specbench/costs/schema.py: the one check every reader of a cost profile goes through."""
import json

import pytest

from specbench.costs import schema
from specbench.errors import UserError

GOOD = {"context": 256, "entries": [{"batch": 1, "q": 1, "median_ms": 2.0}, {"batch": 1, "q": 4, "median_ms": 3.0}]}


def test_a_good_profile_and_its_optional_sections_pass():
    data = {**GOOD, "round": [{"batch": 1, "q": 1, "median_ms": 2.5}],
            "prefill": [{"batch": 1, "tokens": 64, "median_ms": 9.0}], "draft": [{"batch": 1, "median_ms": 1.0}]}
    assert schema.check_profile(data, "p") is data


@pytest.mark.parametrize("data, message", [
    ([], "not a cost profile"),
    ({}, 'not a cost profile \\(needs "entries"'),
    ({"entries": []}, 'needs "entries"'),
    ({"entries": [{"batch": 1, "q": True, "median_ms": 2.0}]}, 'needs "entries"'),  # a bool is not a count
    ({**GOOD, "round": [{"batch": 1, "median_ms": 2.0}]}, "\"round\" must be a list of {batch, q, median_ms}"),
    ({**GOOD, "prefill": "fast"}, "\"prefill\" must be a list of {batch, tokens, median_ms}"),
    ({**GOOD, "draft": [{"batch": 1}]}, "\"draft\" must be a list of {batch, median_ms}"),
])
def test_malformed_profiles_are_one_line_errors(data, message):
    with pytest.raises(UserError, match=message):
        schema.check_profile(data, "p.json")


def test_read_profile_reports_unreadable_and_invalid_files(tmp_path):
    with pytest.raises(UserError, match="cannot read cost profile"):
        schema.read_profile(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(UserError, match="invalid JSON"):
        schema.read_profile(tmp_path / "bad.json")
    (tmp_path / "good.json").write_text(json.dumps(GOOD))
    assert schema.read_profile(tmp_path / "good.json") == GOOD


def test_drafter_cost_keys_round_trip():
    key = schema.drafter_cost_key("drafters/t/dspark", "ab12", "AMD EPYC 9654 (x1 threads)")
    assert key == "drafters/t/dspark@ab12|AMD EPYC 9654 (x1 threads)"
    assert schema.parse_drafter_cost_key(key) == ("drafters/t/dspark", "ab12", "AMD EPYC 9654 (x1 threads)")
    assert schema.parse_drafter_cost_key("drafters/t/eagle|cpu") == ("drafters/t/eagle", "", "cpu")
