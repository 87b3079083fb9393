"""The user's documents describe the software as it is, not how it was built:
README.md and every file under docs/ name no issue number, no branch, no
step of the work's history and no developer machine's path. The history has
one home, CHANGELOG.md, which this check leaves alone."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Each rule: a name and a pattern that must not match a user document.
RULES: dict[str, re.Pattern[str]] = {
    # "issue 12", "issues 20 and 21", "issue #9", "(#134)"
    "issue number": re.compile(r"\bissues?\s*#?\d+|(?<![\w&/`])#\d+\b", re.IGNORECASE),
    "branch": re.compile(
        r"\bthis branch\b|\bthe branch\b|\bmain's\b|\bon main\b|\bgit (checkout|switch)\b",
        re.IGNORECASE,
    ),
    "history": re.compile(
        r"\bthis (stop|pass|commit)\b|\b(previous|last|earlier) (stop|session's work|commit)\b"
        r"|\blanded\b|\bbefore and after\b|\bbefore/after\b|\bused to be\b",
        re.IGNORECASE,
    ),
    "machine path": re.compile(r"(?<![\w.~$-])/(root|home|work|Users|mnt|opt/ds4)/"),
}


def user_docs() -> list[pathlib.Path]:
    docs = sorted((ROOT / "docs").glob("*.md"))
    return [ROOT / "README.md", *docs]


def findings(text: str) -> list[tuple[str, int, str]]:
    found = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for name, pattern in RULES.items():
            m = pattern.search(line)
            if m:
                found.append((name, lineno, m.group(0)))
    return found


@pytest.mark.parametrize("doc", user_docs(), ids=lambda p: p.name)
def test_user_doc_names_no_issue_branch_history_or_machine_path(doc: pathlib.Path) -> None:
    hits = findings(doc.read_text())
    assert not hits, "\n".join(f"{doc.name}:{n}: {rule}: {m!r}" for rule, n, m in hits)


@pytest.mark.parametrize(
    ("line", "rule"),
    [
        ("## 8. A second architecture (issue 20)", "issue number"),
        ("as issues 21 and 22 measured", "issue number"),
        ("see #134 upstream", "issue number"),
        ("on this branch the load is faster", "branch"),
        ("main's figure was 71 ms", "branch"),
        ("this stop moved the lock", "history"),
        ("the figures before and after", "history"),
        ("run from /root/ds4/target", "machine path"),
        ("cd /home/dev/ds4", "machine path"),
    ],
)
def test_each_rule_catches_its_case(line: str, rule: str) -> None:
    assert [name for name, _, _ in findings(line)] == [rule]


@pytest.mark.parametrize(
    "line",
    [
        "FORMAT §6 lays out the block section",
        "ds4 serve --cache-dir ~/.cache/ds4 --port 8000",
        "a corrupt file is removed, and the ladder goes on",
        "[the recovery ladder](#recovery-ladder)",
        "the header's `&#8203;` entity",
        "files under `python/ds4/kvstore/` and `rust/index/`",
    ],
)
def test_plain_prose_passes(line: str) -> None:
    assert findings(line) == []


def test_the_history_has_its_own_home() -> None:
    assert (ROOT / "CHANGELOG.md").is_file()
