"""The docs stay true: the site builds in strict mode, the generated pages are current, and the README
and the pages keep their shape.

- ``mkdocs build --strict`` into a temporary folder: a broken link, a missing anchor, a missing page
  or a page left out of the navigation fails (a negative control shows that a broken link does);
- docs/cli.md (from the click commands) and the test-file table of docs/testing.md (from the test
  files' docstrings) are what ``python tools/gen_docs.py`` writes today;
- the README: at most 250 lines, the two set-up commands as written and the one ``.ci/run`` calls,
  one results table per platform whose rows name their command, date, machine and commit, and
  links that resolve (files and anchors);
- docs/architecture.md: its layer table is test_layout's ``RANK``, and it names every module;
- docs/benchmarks/: every dated note names its command, date, machine and commit, newest first.

The snippets themselves run in ``tests/test_readme.py``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
TEST_COMMAND = "pip install '.[test]' && pytest"
RUN_COMMAND = 'pip install . && pyllama-dspark run -p "Explain the Pythagorean theorem." -n 128 --temp 0'
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "tools" / "gen_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _mkdocs(config: Path, site: Path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          cwd=config.parent, env=env, capture_output=True, text=True, timeout=600)


def test_generated_docs_are_current():
    gen = _gen_docs()
    stale = [p.relative_to(ROOT).as_posix() for p in gen.stale()]
    assert not stale, f"{', '.join(stale)} stale: run `{gen.REGENERATE}` and commit the result"


def test_cli_docs_name_every_command():
    import click

    from pyllama_dspark.cli.main import main

    text = (DOCS / "cli.md").read_text(encoding="utf-8")
    ctx = click.Context(main, info_name="pyllama-dspark")
    for name in main.list_commands(ctx):
        assert f"## `{name}`" in text, name


def test_site_builds_strict(tmp_path):
    p = _mkdocs(ROOT / "mkdocs.yml", tmp_path / "site")
    assert p.returncode == 0, f"mkdocs build --strict failed:\n{p.stdout}\n{p.stderr}"
    assert (tmp_path / "site" / "index.html").is_file()


def test_strict_build_fails_on_a_broken_link(tmp_path):
    """Negative control: the same site with one link to a page that does not exist must not build."""
    shutil.copytree(DOCS, tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    with open(tmp_path / "docs" / "index.md", "a", encoding="utf-8") as f:
        f.write("\n[nowhere](no-such-page.md)\n")
    p = _mkdocs(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert p.returncode != 0 and "no-such-page.md" in p.stdout + p.stderr, p.stdout + p.stderr


def test_readme_is_short_and_keeps_the_set_up():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250, len(text.splitlines())
    for cmd in (RUN_COMMAND, TEST_COMMAND):
        assert f"```bash\n{cmd}\n```" in text, cmd
    assert "-DGGML_CUDA=on" in text                          # the CUDA build
    assert re.search(r"\bpytest\b", text)
    assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text(encoding="utf-8"), ".ci/run must call the README's test command"
    assert "mkdocs" in (ROOT / "pyproject.toml").read_text(encoding="utf-8"), "the test extra installs mkdocs"


def _table_after(text: str, heading: str):
    """(header cells, body rows as lists of cells) of the first Markdown table after a heading line."""
    lines = text.split(f"\n{heading}\n", 1)[1].splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    rows = [[c.strip() for c in ln.strip().strip("|").split(" | ")] for ln in lines[start:end]]
    return rows[0], rows[2:]


def test_results_per_platform():
    """Every headline figure (docs/results.md, generated from results.json like the
    README's) names its command, date, machine and commit."""
    text = (DOCS / "results.md").read_text(encoding="utf-8")
    for platform in ("CPU", "GPU"):
        header, rows = _table_after(text, f"## {platform}")
        assert header[-5:] == ["command", "date", "machine", "commit", "note"], header
        assert rows, platform
        for row in rows:
            cmd, date, machine, commit, note = row[-5:]
            if row[1] == "not measured yet":
                continue
            assert cmd and machine and note and re.fullmatch(r"\d{4}-\d{2}-\d{2}", date), row
            assert re.fullmatch(r"`[0-9a-f]{7,40}`", commit), row
    readme = README.read_text(encoding="utf-8")
    assert "docs/images/results.png" in readme and "docs/results.md" in readme


def test_a_figure_that_disagrees_with_its_data_is_stale(tmp_path, monkeypatch):
    """The check bites: one figure changed in the data leaves the README, the page and the plot stale."""
    import json as _json

    gen = _gen_docs()
    import gen_results

    data = _json.loads(gen_results.DATA.read_text(encoding="utf-8"))
    data["claims"][0]["ratio"], data["claims"][0]["result"] = 0.5, "0.5 / 0.5, 0.5 / 0.5"
    fake = tmp_path / "results.json"
    fake.write_text(_json.dumps(data), encoding="utf-8")
    monkeypatch.setattr(gen_results, "DATA", fake)
    stale = {p.name for p in gen.stale()}
    assert {"README.md", "results.md", "results.png"} <= stale, stale


def _anchors(page: Path):
    from markdown.extensions.toc import slugify

    # fenced blocks are whole lines (an inline ```` ```json ```` in a sentence is not one)
    text = re.sub(r"^\s*```[\w+-]*[ \t]*\n.*?^\s*```[ \t]*$", "", page.read_text(encoding="utf-8"),
                  flags=re.S | re.M)
    return {slugify(re.sub(r"[`*]", "", m.group(1)), "-") for m in re.finditer(r"^#+\s+(.+?)\s*$", text, re.M)}


def test_readme_links_resolve():
    bad = []
    for target in LINK.findall(README.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        page = ROOT / path if path else README
        if not page.exists():
            bad.append(target)
        elif anchor and page.suffix == ".md" and anchor not in _anchors(page):
            bad.append(target)
    assert not bad, bad


def _layout():
    sys.path.insert(0, str(ROOT / "tests"))
    import test_layout

    return test_layout


def test_architecture_layers_are_test_layouts_rank():
    text = (DOCS / "architecture.md").read_text(encoding="utf-8")
    _, rows = _table_after(text, "## Layers, and what each may import")
    ranks = {name: int(row[0]) for row in rows for name in re.findall(r"`([\w_]+)`", row[1])}
    assert ranks == _layout().RANK


def test_architecture_names_every_module():
    text = (DOCS / "architecture.md").read_text(encoding="utf-8")
    missing = [mod for mod, _ in _layout()._modules()
               if mod.count(".") and not re.search(rf"\b{re.escape(mod.rsplit('.', 1)[1])}\b", text)]
    assert not missing, f"docs/architecture.md does not name {missing}: say what each holds in 'What is where'"


def test_architecture_names_the_native_files_that_exist():
    text = (DOCS / "architecture.md").read_text(encoding="utf-8")
    named = set()
    for stem, exts in re.findall(r"native/(\w+)(?:\.\{([\w,]+)\}|\.(?:cpp|h))", text):
        named |= {f"{stem}.{e}" for e in exts.split(",")} if exts else set()
    named |= set(re.findall(r"native/(\w+\.(?:cpp|h))\b", text))
    present = {f.name for f in (ROOT / "native").iterdir() if f.suffix in (".cpp", ".h")}
    assert not named - present, f"docs/architecture.md names native files that are gone: {sorted(named - present)}"
    assert not present - named, f"docs/architecture.md does not name {sorted(present - named)}"


DATED = re.compile(r"^## (\d{4}-\d{2}-\d{2})", re.M)


@pytest.mark.parametrize("page", sorted(p.name for p in (DOCS / "benchmarks").glob("*.md") if p.name != "index.md"))
def test_benchmark_notes_name_command_date_machine_commit(page):
    text = (DOCS / "benchmarks" / page).read_text(encoding="utf-8")
    dates = DATED.findall(text)
    assert dates, f"{page}: no dated note"
    assert dates == sorted(dates, reverse=True), f"{page}: notes not newest first: {dates}"
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
        if not DATED.match("## " + section):
            continue
        head = section.split("\n\n", 2)[1]
        for field in ("Command", "Date", "Machine", "Commit"):
            assert f"- **{field}:**" in head, f"{page}: '{section.splitlines()[0]}' has no {field}"


def test_every_benchmark_page_is_listed():
    index = (DOCS / "benchmarks" / "index.md").read_text(encoding="utf-8")
    for p in (DOCS / "benchmarks").glob("*.md"):
        assert p.name == "index.md" or f"({p.name})" in index, p.name


_CELL_SPLIT = re.compile(r"(?<!\\)\|")


def _table_shape_errors(text: str, where: str) -> list:
    """Rows of a Markdown table whose cell count is not the header's (GitHub's rule: an unescaped
    ``|`` splits a cell, inside a code span too), outside fenced code blocks."""
    errors, header, fenced = [], None, False
    for n, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if s.startswith("```"):
            fenced, header = not fenced, None
            continue
        if fenced or not s.startswith("|"):
            header = None
            continue
        cells = len(_CELL_SPLIT.split(s.strip("|")))
        if header is None:
            header = cells
        elif cells != header:
            errors.append(f"{where}:{n}: {cells} cells, the header has {header}: {s[:120]}")
    return errors


def test_every_table_row_has_its_headers_cells():
    pages = [README] + sorted(DOCS.rglob("*.md"))
    errors = [e for p in pages for e in _table_shape_errors(p.read_text(), str(p.relative_to(ROOT)))]
    assert not errors, "\n".join(errors)
    # the check bites: the unescaped metavar that split docs/cli.md's -ngl rows
    assert _table_shape_errors("| a | b | c |\n|---|---|---|\n| `-ngl` | N|AUTO|ALL | x |\n", "planted")


# the project's own bookkeeping, which means nothing to a user: its issue numbers, its lab words
_JARGON = re.compile(r"\bissues? #?\d+|\bhazard[- ]\d+|\bdevice lent\b|\bbefore this release\b", re.I)


def _jargon(text: str) -> list:
    return [m.group(0) for m in _JARGON.finditer(text)]


def test_user_pages_carry_no_project_bookkeeping():
    """The README and the pages (not the dated notes of docs/benchmarks/) cite upstream issues by link,
    never the project's own issue numbers or lab words."""
    pages = [README] + [p for p in sorted(DOCS.rglob("*.md")) if "benchmarks" not in p.parts]
    found = {str(p.relative_to(ROOT)): _jargon(LINK.sub("", p.read_text())) for p in pages}
    assert not {k: v for k, v in found.items() if v}, found
    assert _jargon("as issue 46 found; a hazard-9 draft; no device lent since") == \
        ["issue 46", "hazard-9", "device lent"]
