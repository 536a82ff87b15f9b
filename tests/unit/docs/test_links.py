"""The docs' links resolve: every `#anchor` names a heading of its file, every relative link
names a tracked file, and every `docs/bench/...` result the docs cite is committed.

The benchmark docs cite hundreds of JSON files and cross-link their sections by anchor; a
renamed section or a result left uncommitted breaks a reader's path silently.
"""
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]

_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
# A cited result: a path under docs/bench/ ending in a data file's suffix. Brace forms
# ("..._{1,2}.json") name several files at once and are expanded.
_BENCH_PATH = re.compile(r"docs/bench/[\w.\-{},/]+?\.(?:json|jsonl|csv|txt|log|png|svg)")


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def heading_anchors(markdown: str) -> set[str]:
    """Every heading's anchor outside fenced code; a repeated heading gets -1, -2, ... as on GitHub."""
    anchors: set[str] = set()
    num_seen: dict[str, int] = {}
    in_fence = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
            continue
        match = None if in_fence else _HEADING.match(line)
        if match is None:
            continue
        anchor = github_anchor(match.group(2))
        num_before = num_seen.get(anchor, 0)
        num_seen[anchor] = num_before + 1
        anchors.add(anchor if num_before == 0 else f"{anchor}-{num_before}")
    return anchors


def expand_braces(path: str) -> list[str]:
    """Each brace group in turn: 'a_{1,2}.json' -> ['a_1.json', 'a_2.json']."""
    match = re.search(r"\{([^{}]*)\}", path)
    if match is None:
        return [path]
    return [expanded for choice in match.group(1).split(",")
            for expanded in expand_braces(path[:match.start()] + choice + path[match.end():])]


def broken_links(doc_path: str, markdown: str, tracked_paths: set[str],
                 read_doc: Callable[[str], str]) -> list[str]:
    """What in `markdown` (the file at repo-relative `doc_path`) points nowhere; `read_doc`
    gives another tracked markdown file's text by its repo-relative path."""
    broken = []
    doc_dir = Path(doc_path).parent
    own_anchors = heading_anchors(markdown)
    for match in _LINK.finditer(markdown):
        target = match.group(1)
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        if not path:
            if anchor and anchor not in own_anchors:
                broken.append(f"{doc_path}: no heading for #{anchor}")
            continue
        linked_path = _normalise(doc_dir / path)
        if linked_path not in tracked_paths and not any(p.startswith(linked_path + "/") for p in tracked_paths):
            broken.append(f"{doc_path}: {target} is not a tracked file")
        elif anchor and linked_path.endswith(".md") and anchor not in heading_anchors(read_doc(linked_path)):
            broken.append(f"{doc_path}: {linked_path} has no heading for #{anchor}")
    for match in _BENCH_PATH.finditer(markdown):
        for cited in expand_braces(match.group(0)):
            if cited not in tracked_paths:
                broken.append(f"{doc_path}: cites {cited}, which is not committed")
    return broken


def _normalise(path: Path) -> str:
    parts: list[str] = []
    for part in path.parts:
        if part == "..":
            parts = parts[:-1]
        elif part != ".":
            parts.append(part)
    return "/".join(parts)


def _tracked_paths() -> set[str]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, check=True)
    return set(listed.stdout.decode().split("\0")) - {""}


def _docs(tracked_paths: set[str]) -> list[str]:
    return ["README.md"] + sorted(p for p in tracked_paths if p.startswith("docs/") and p.endswith(".md"))


def test_github_anchor_drops_punctuation_and_keeps_hyphens():
    assert github_anchor("fp32 on the Zen 4: the README row's blanks (2026-12-04 night, eb5074c / 543438b)") == \
        "fp32-on-the-zen-4-the-readme-rows-blanks-2026-12-04-night-eb5074c--543438b"
    assert github_anchor("Serving vs `vllm serve`") == "serving-vs-vllm-serve"
    assert github_anchor("pdserve tune") == "pdserve-tune"


def test_repeated_headings_and_fenced_lines_are_counted_as_github_does():
    markdown = "# Runs\n## Runs\n```bash\n# not a heading\n```\n### Runs\n"
    assert heading_anchors(markdown) == {"runs", "runs-1", "runs-2"}


def test_expand_braces_names_each_file():
    assert expand_braces("docs/bench/a_{before,after}_{1,2}.json") == [
        "docs/bench/a_before_1.json", "docs/bench/a_before_2.json",
        "docs/bench/a_after_1.json", "docs/bench/a_after_2.json"]


def test_each_kind_of_broken_link_is_reported():
    tracked = {"README.md", "docs/other.md", "docs/bench/kept.json"}
    docs = {"docs/other.md": "# Other\n## Kept section\n"}
    markdown = ("# Top\n[ok](#top) [gone](#missing) [file](docs/other.md#kept-section)"
                " [bad anchor](docs/other.md#renamed) [no file](docs/nowhere.md)\n"
                "Results: docs/bench/kept.json and docs/bench/lost.json, docs/bench/r_{kept,x}.json\n")
    assert broken_links("README.md", markdown, tracked, docs.__getitem__) == [
        "README.md: no heading for #missing",
        "README.md: docs/other.md has no heading for #renamed",
        "README.md: docs/nowhere.md is not a tracked file",
        "README.md: cites docs/bench/lost.json, which is not committed",
        "README.md: cites docs/bench/r_kept.json, which is not committed",
        "README.md: cites docs/bench/r_x.json, which is not committed",
    ]


def test_a_link_up_from_docs_resolves_against_the_repo():
    tracked = {"docs/architecture.md", "README.md"}
    assert broken_links("docs/architecture.md", "[readme](../README.md)", tracked, lambda p: "") == []


@pytest.mark.parametrize("doc_path", _docs(_tracked_paths()))
def test_every_link_and_cited_result_in_the_docs_resolves(doc_path):
    tracked = _tracked_paths()
    markdown = (REPO_ROOT / doc_path).read_text()
    assert broken_links(doc_path, markdown, tracked, lambda p: (REPO_ROOT / p).read_text()) == []
