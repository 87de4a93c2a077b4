"""``docs/reward_loop.md``'s table of rule-based data sources names every source the dispatcher
serves and every one it refuses (read from the page and from the tables; nothing is run)."""

from __future__ import annotations

from pathlib import Path

from weightsync.reward_loop.rules import PREFIX_RULES, RULES, SUBSTRING_RULES, UNAVAILABLE

PAGE = (Path(__file__).resolve().parents[3] / "docs/reward_loop.md").read_text()


def test_every_data_source_is_on_the_page():
    section = PAGE.split("## Rule-based data sources", 1)[1].split("\n## ", 1)[0]
    missing = [name for name in (*RULES, *UNAVAILABLE) if f"`{name}`" not in section]
    assert not missing, f"data sources missing from docs/reward_loop.md: {missing}"
    assert all(f"`{k}`" in section for k in (*PREFIX_RULES, *SUBSTRING_RULES))
    assert "RuleUnavailableError" in section and "UnknownDataSourceError" in section
