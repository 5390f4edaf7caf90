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
    files += sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "benchmarks").glob("*.md"))
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


def test_contributing_lists_the_harness_knobs_and_the_readme_does_not():
    """The users' table (README) has no test-harness knob; CONTRIBUTING's table between its
    test-knobs markers is `tests/helpers/knobs.py`'s, row for row."""
    readme = (ROOT / "README.md").read_text().split(BEGIN, 1)[1].split(END, 1)[0]
    assert "MDEEP_TEST_" not in readme
    text = (ROOT / "CONTRIBUTING.md").read_text()
    begin, end = "<!-- test-knobs:begin -->", "<!-- test-knobs:end -->"
    assert text.count(begin) == 1 and text.count(end) == 1, "CONTRIBUTING needs one block"
    block = text.split(begin, 1)[1].split(end, 1)[0].strip().splitlines()
    rows = [f"| `{k.env_name}` | {k.shown_default} | {k.doc} |"
            for k in test_knobs.TEST_KNOBS.values()]
    assert block == ["| variable | default | what it does |", "|---|---|---|"] + rows


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
    """Deleted probes live on in git history and in the benchmarks/ notes (which may name them as
    such); the README, CONTRIBUTING and the scripts must not send anyone to run them."""
    removed = ("probe_write.py", "probe_phases.py", "probe_layout.py", "probe_copy.py",
               "ab_knobs.sh")
    for path in _doc_files():
        if path.parent.name in ("docs", "benchmarks"):
            continue
        text = path.read_text()
        for name in removed:
            assert name not in text, f"{path.name} mentions the removed script {name}"


# A repository path in backticks: a top-level folder of this repository, then a file name.
REPO_PATH = re.compile(
    r"`((?:docs|benchmarks|examples|patches|cuda_src|megatron_deepep|dev|tests|\.ci)/"
    r"[A-Za-z0-9_./-]*[A-Za-z0-9_/-])`")
MODULE_COMMAND = re.compile(r"-m\s+(megatron_deepep(?:\.[a-z_]+)*)")


# A record's bare name in backticks: a card prefix (h100_, h200_, cpu_, ...), a date, a topic.
RECORD_NAME = r"`([a-z][a-z0-9]*_\d{4}-\d\d-\d\d_[A-Za-z0-9_./-]+)`"
RECORD_STEM = r"([a-z][a-z0-9]*_\d{4}-\d\d-\d\d_[a-z0-9_]+\.md)"


def _user_docs():
    files = [ROOT / "README.md", ROOT / "CONTRIBUTING.md"]
    files += sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "benchmarks").glob("*.md"))
    return [path for path in files if path.exists()]


@pytest.mark.parametrize("path", _user_docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_paths_the_docs_name_exist(path):
    """Every repository path a user doc names in backticks is there (moved files leave none
    behind). A benchmarks file's bare names are relative to benchmarks/ and checked there."""
    text = path.read_text()
    missing = sorted({name for name in REPO_PATH.findall(text)
                      if "*" not in name and not (ROOT / name).exists()})
    if path.parent.name == "benchmarks":
        missing += sorted({name for name in re.findall(RECORD_NAME, text)
                           if not (path.parent / name).exists()})
    assert not missing, f"{path.relative_to(ROOT)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("path", _user_docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_commands_the_docs_give_exist(path):
    """`python -m megatron_deepep.X` and `torchrun ... -m megatron_deepep.X` name real modules."""
    import importlib.util

    def exists(name):
        try:
            return importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # a parent that is a module, not a package
            return False

    missing = sorted({name for name in MODULE_COMMAND.findall(path.read_text())
                      if not exists(name)})
    assert not missing, f"{path.relative_to(ROOT)} gives commands of missing modules: {missing}"


def test_readme_is_short_and_links_the_latest_benchmarks():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250, "the README is for users: keep it to 250 lines"
    named = set(re.findall(RECORD_STEM, text))
    missing = sorted(name for name in named if not (ROOT / "benchmarks" / name).exists())
    assert not missing, f"the README names records that do not exist: {missing}"
    latest_list = text[text.index("the\n  latest are") if "the\n  latest are" in text
                       else text.index("latest are"):]
    linked = set(re.findall(RECORD_STEM, latest_list.split("\n\n")[0]))
    assert linked, "the README's latest list names records in benchmarks/"
    latest, newest_of_card = {}, {}
    for path in (ROOT / "benchmarks").glob("*_*_*.md"):
        card, date, topic = path.stem.split("_", 2)
        if date > latest.get((card, topic), ("", ""))[0]:
            latest[(card, topic)] = (date, path.name)
        newest_of_card[card] = max(newest_of_card.get(card, ""), date)
    stale = sorted(name for name in linked
                   if name not in {file for _, file in latest.values()})
    assert not stale, f"the latest list names records a newer file replaces: {stale}"
    # Every card's newest day is in the list (h100_, h200_, cpu_, ...).
    absent = sorted(card for card, date in newest_of_card.items()
                    if not any(name.startswith(f"{card}_{date}_") for name in linked))
    assert not absent, f"the latest list names no record of the newest day of: {absent}"


def test_nothing_cites_files_outside_the_repository():
    """Docs and code name only what is in the repository: no guidance files of a workplace."""
    outside = ("DESIGN" + ".md", "../" + "shared")
    offenders = []
    for top in ("README.md", "CONTRIBUTING.md", "docs", "benchmarks", "megatron_deepep",
                "cuda_src", "examples", "patches", "scripts", "dev", "tests", ".ci"):
        path = ROOT / top
        if not path.exists():
            continue
        for child in ([path] if path.is_file() else sorted(path.rglob("*"))):
            if child.is_file() and child.suffix in (".md", ".py", ".sh", ".cu", ".cuh", ".txt",
                                                    ".sbatch", ".patch", ""):
                text = child.read_text(errors="replace")
                offenders += [f"{child.relative_to(ROOT)}: {name}" for name in outside
                              if name in text]
    assert not offenders, offenders


def test_the_readme_says_what_this_is_before_any_command():
    """A newcomer reads what this is, for whom, and how it differs, before the first code
    block; then the links and the words the README uses unexplained elsewhere."""
    text = (ROOT / "README.md").read_text()
    before = text.split("```", 1)[0].split("\n", 1)[1]  # after the title
    sentence = before.strip().split(". ")[0]
    assert len(sentence.split()) >= 8, before
    for word in ("Megatron-LM", "alltoall", "DeepEP"):
        assert word in before, word
    for link in ("https://github.com/NVIDIA/Megatron-LM", "https://github.com/deepseek-ai/DeepEP",
                 "https://github.com/NVIDIA/TransformerEngine",
                 "https://github.com/NVIDIA/cuda-python"):
        assert f"]({link})" in text, link
    for term in ("SM:", "HBM:", "MPS:", "NVRTC:", "NVSHMEM:", "TE:"):
        assert term in text, term
    commands = text.split("```bash", 1)[1].split("```", 1)[0]
    assert commands.index("--index-url https://download.pytorch.org/whl/cpu") < commands.index(
        "bash examples/run_gpt_moe.sh"), "the CPU-only line comes first"
    assert "examples/balance_demo.py" in text
    precompile = [line for line in text.splitlines() if not line.startswith("|")
                  and "python -m megatron_deepep.tools.precompile" in line]  # not the table
    assert precompile and all("--topk" in line for line in precompile), precompile
