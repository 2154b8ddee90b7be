"""Docstrings and comments cite only what is in the repository (a pure text scan, no imports).

* A path a file under specbench/ or tests/ names — `docs/dspark.md`, `specbench/engine/core.py`,
  `reference/x.md`, a bare `DESIGN.md` — must exist in the repository (paths of other projects,
  e.g. DeepSpec's `deepspec/...`, are not checked: they cite that project's file by name).
* Every `§N` is part of a `docs/X.md §N[, §M…]` reference, and X.md has a numbered heading N
  (`## 4. …` or `### 4.2 …`).
"""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# This file is left out: its negative control quotes bad references on purpose.
SCANNED = sorted(p for p in [*(ROOT / "specbench").rglob("*.py"), *(ROOT / "tests").glob("*.py")]
                 if p != Path(__file__).resolve())

# A path is checked when its first component is one of these: the repository's own folders, and
# the design-note folder outside it that code once cited.
CHECKED_ROOTS = {"specbench", "tests", "docs", "policies", "workloads", "drafters", "benchmarks",
                 "corpus", "results", "reports", "reference"}
PATH = re.compile(r"(?<![\w./<-])([A-Za-z0-9_][\w.-]*(?:/[\w.-]+)*\.(?:md|py|toml|json|jsonl|sh))\b")
# Files the suite itself writes (not citations), which a bare name may mention.
WRITTEN_BY_THE_SUITE = {"TRAINING.md"}
DOC_REF = re.compile(r"docs/([\w-]+)\.md((?:\s*(?:,|–|-|and)?\s*§\d+(?:\.\d+)*)+)")
SECTION = re.compile(r"§(\d+(?:\.\d+)*)")
HEADING = re.compile(r"^#{1,6}\s+(\d+(?:\.\d+)*)\.?\s", re.MULTILINE)


def exists(path: str, citing: Path) -> bool:
    """Relative to the repository root, or to the package (`policies/dspark.py` inside specbench/)."""
    return (ROOT / path).exists() or (ROOT / "specbench" / path).exists()


def missing_paths(text: str, citing: Path) -> list[str]:
    out = []
    for m in PATH.finditer(text):
        path = m.group(1)
        first = path.split("/")[0]
        if "/" in path and first not in CHECKED_ROOTS:
            continue
        if "/" not in path and (not path.endswith(".md") or path in WRITTEN_BY_THE_SUITE):
            continue  # a bare module name (`core.py`) is a mention, not a path
        if not exists(path, citing):
            out.append(f"{citing.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {path} is not in the repository")
    return out


def doc_sections(name: str) -> set[str] | None:
    doc = ROOT / "docs" / f"{name}.md"
    return set(HEADING.findall(doc.read_text())) if doc.is_file() else None


def bad_section_refs(text: str, citing: Path) -> list[str]:
    out, covered = [], set()
    for m in DOC_REF.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        sections = doc_sections(m.group(1))
        for s in SECTION.finditer(m.group(2)):
            covered.add(m.start(2) + s.start())
            if sections is not None and s.group(1) not in sections:
                out.append(f"{citing.relative_to(ROOT)}:{line}: docs/{m.group(1)}.md has no section {s.group(1)}")
    for m in re.finditer("§", text):
        if m.start() not in covered:
            line = text.count("\n", 0, m.start()) + 1
            out.append(f"{citing.relative_to(ROOT)}:{line}: a § that is not part of a docs/X.md §N reference")
    return out


def test_cited_paths_exist():
    problems = [p for f in SCANNED for p in missing_paths(f.read_text(), f)]
    assert not problems, "\n".join(problems)


def test_section_references_name_existing_headings():
    problems = [p for f in SCANNED for p in bad_section_refs(f.read_text(), f)]
    assert not problems, "\n".join(problems)


def test_the_scan_catches_what_it_is_for():
    """Negative control: outside notes, a bare design-note name, a stale module path, a section
    the doc does not have and a bare § are all reported; good references are not."""
    here = ROOT / "specbench" / "engine" / "core.py"
    bad = ('"""See reference/dspark.md §2.1 and DESIGN.md; specbench/core.py;\n'
           'docs/dspark.md §99, and a bare §4.3 here."""')
    found = missing_paths(bad, here) + bad_section_refs(bad, here)
    assert any("reference/dspark.md is not in" in p for p in found)
    assert any("DESIGN.md is not in" in p for p in found)
    assert any("specbench/core.py is not in" in p for p in found)
    assert any("has no section 99" in p for p in found)
    assert sum("not part of a docs/X.md" in p for p in found) == 2  # §2.1 after reference/, and §4.3
    good = ('"""docs/dspark.md §4.2, §4.3 and docs/eagle.md §5; specbench/engine/core.py;\n'
            'policies/dspark.py; deepspec/modeling/dspark/loss.py; core.py."""')
    assert missing_paths(good, here) + bad_section_refs(good, here) == []
