"""The user docs agree with the code: the README's knob table is `knobs.markdown_table()`, and
every `MDEEP_*` name the docs and scripts mention is a knob (no stale or removed ones)."""

from __future__ import annotations

import pathlib
import re

import pytest

from megatron_deepep import knobs
from tests.helpers import knobs as test_knobs
from tests.helpers import REPO_ROOT

ROOT = pathlib.Path(REPO_ROOT)
BEGIN, END = "<!-- knobs:begin -->", "<!-- knobs:end -->"
KNOB_NAME = re.compile(r"\bMDEEP_([A-Z0-9_]+)")


def _doc_files():
    files = [ROOT / "README.md", ROOT / "CONTRIBUTING.md"]
    files += sorted((ROOT / "docs").glob("*.md"))
    files += sorted((ROOT / "dev" / "gpu").glob("*.sh"))
    return [path for path in files if path.exists()]


def _text_files_under(*tops):
    for top in tops:
        path = ROOT / top
        if path.is_file():
            yield path
            continue
        for child in sorted(path.rglob("*")):
            if child.is_file() and child.suffix in (".md", ".sh", ".py", ".txt", ".json",
                                                     ".jsonl"):
                yield child


def test_readme_knob_table_is_generated_from_knobs():
    text = (ROOT / "README.md").read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1, "README needs one knob block"
    block = text.split(BEGIN, 1)[1].split(END, 1)[0]
    assert block.strip() == knobs.markdown_table().strip(), (
        "README knob table is stale: paste the output of "
        "`python -c \"from megatron_deepep import knobs; print(knobs.markdown_table())\"`")


@pytest.mark.parametrize("path", _doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_mentioned_knob_exists(path):
    names = {m.group(1).rstrip("_") for m in KNOB_NAME.finditer(path.read_text())}
    unknown = sorted(name for name in names
                     if name not in knobs.KNOBS and name not in test_knobs.TEST_KNOBS)
    assert not unknown, f"{path.name} mentions knobs not in knobs.KNOBS: " + ", ".join(
        knobs.PREFIX + name for name in unknown)


def test_no_old_prefix_in_docs_and_scripts():
    offenders = [str(path.relative_to(ROOT))
                 for path in _text_files_under("README.md", "docs", "dev")
                 if "MEGATRON_DEEPEP_" in path.read_text(errors="replace")]
    assert not offenders, f"the old MEGATRON_DEEPEP_ prefix appears in {offenders}"


def test_removed_scripts_are_not_referenced():
    """Deleted probes live on in git history and in docs/perf_notes.md (which may name them as
    such); the README, CONTRIBUTING and the scripts must not send anyone to run them."""
    removed = ("probe_write.py", "probe_phases.py", "probe_layout.py", "probe_copy.py",
               "ab_knobs.sh")
    for path in _doc_files():
        if path.parent.name == "docs":
            continue
        text = path.read_text()
        for name in removed:
            assert name not in text, f"{path.name} mentions the removed script {name}"
