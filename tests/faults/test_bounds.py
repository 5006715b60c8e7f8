"""Every fixed time bound lives in cupycoll.bounds, and docs/faults.md's table names each one
with its value: the table and the code cannot drift apart."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cupycoll import bounds

FAULTS_DOC = Path(__file__).resolve().parents[2] / "docs" / "faults.md"


def _named_in_the_table():
    """{bound name: value as the table writes it} from "`bounds.NAME` = VALUE" in the table."""
    text = FAULTS_DOC.read_text(encoding="utf-8")
    table = text[text.index("## The bounds"):text.index("\n## ", text.index("## The bounds") + 1)]
    return {name: value for name, value in re.findall(r"`bounds\.([A-Z_]+)` = ([0-9.]+)", table)}


@pytest.mark.any_stack
def test_every_bound_is_in_the_faults_table_with_its_value():
    named = _named_in_the_table()
    assert set(named) == set(bounds.TABLE), set(named) ^ set(bounds.TABLE)
    for name, value in named.items():
        assert float(value) == bounds.TABLE[name], (name, value, bounds.TABLE[name])


@pytest.mark.any_stack
def test_the_table_of_bounds_is_the_modules_constants():
    constants = {name: value for name, value in vars(bounds).items() if name.isupper() and name != "TABLE"}
    assert constants == bounds.TABLE
