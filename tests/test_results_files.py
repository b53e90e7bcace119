"""results/ a newcomer can read: results/bench/ holds only what a `gems bench NAME` writes now, results/README.md
names every committed file and folder, and every results/ file that the README, docs/, the code and the scripts
cite exists, at the section it points to (the pipeline's experiments are sections of
results/history/pipeline-schedules.md). Reads files only."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
#: a results/ file as text cites it: results/FOLDER/name.ext, with an optional #section (NAME.md: a placeholder)
CITED = re.compile(r"results/((?:bench|history|gpu|cosmoflow_\w+)/[a-z0-9][\w.-]*\.(?:md|json|csv|png))(#[\w-]+)?")


def committed() -> list[str]:
    """The paths under results/ that git tracks, relative to results/."""
    try:
        out = subprocess.run(["git", "ls-files", "results"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        pytest.skip("no git")
    if out.returncode != 0 or not out.stdout.strip():
        pytest.skip("not a git checkout")
    return [p.split("/", 1)[1] for p in out.stdout.splitlines()]


def bench_writes() -> set[str]:
    """The file names the benchmarks' modules write into their folder (gems/bench/*.py: ``write(out_dir, NAME, ...)``
    and ``out / "NAME.md"``)."""
    names: set[str] = set()
    for src in (ROOT / "gems" / "bench").glob("*.py"):
        text = src.read_text()
        for call in re.findall(r"\bwrite\(\w+(?:\([^)]*\))?, (.+?), text\)", text):
            names |= {f"{n}.md" for n in re.findall(r'"([\w-]+)"', call)}
        names |= set(re.findall(r'/ "([\w-]+\.(?:md|json))"\)\.write_text', text))
    return names


def slugs(markdown: str) -> set[str]:
    """The anchors GitHub gives a document's headings (outside code fences)."""
    out: set[str] = set()
    fence = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fence = not fence
        if fence or not re.match(r"#{1,6} ", line):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        n, base = 1, slug
        while slug in out:
            slug, n = f"{base}-{n}", n + 1
        out.add(slug)
    return out


def test_results_bench_holds_only_what_a_benchmark_writes_now():
    writes = bench_writes()
    assert {"overhead.md", "spatial.md", "pipeline.md", "plan.md", "data.md", "checkpoint.md", "step-cpu.md"} <= writes
    bench = {p.split("/", 1)[1] for p in committed() if p.startswith("bench/")}
    assert bench <= writes, f"results/bench/ holds files no `gems bench` writes: {sorted(bench - writes)}"
    for name in ("overhead", "spatial", "pipeline", "plan", "data", "checkpoint"):  # step and calibrate: a GPU's
        assert f"{name}.md" in bench, name


def test_results_readme_names_every_committed_file_and_folder():
    readme = (RESULTS / "README.md").read_text()
    paths = committed()
    for top in {p.split("/", 1)[0] for p in paths} - {"README.md", ".gitkeep"}:
        assert f"`{top}/" in readme or f"`{top}`" in readme or f"[`{top}/" in readme, top
    for p in paths:
        if p.startswith(("bench/", "history/")):
            assert f"`{p}`" in readme, p


def test_every_results_file_cited_exists_at_its_section():
    files = set(committed())
    writes = bench_writes()
    sources = [ROOT / "README.md", RESULTS / "README.md", RESULTS / "gpu" / "README.md", *(ROOT / "docs").glob("*.md"),
               *(ROOT / "gems").rglob("*.py"), *(ROOT / "scripts").glob("*.py"), *(ROOT / "jobs").glob("*")]
    seen = 0
    for src in sources:
        if not src.is_file():
            continue
        for path, anchor in CITED.findall(src.read_text()):
            seen += 1
            if path not in files:  # a file a benchmark writes may be named as its output, never cited for a figure
                assert path.startswith("bench/") and path.split("/", 1)[1] in writes, \
                    f"{src.relative_to(ROOT)} cites results/{path}, which is not in the repository"
                continue
            if anchor:
                assert anchor[1:] in slugs((RESULTS / path).read_text()), \
                    f"{src.relative_to(ROOT)} cites results/{path}{anchor}: no such section"
    assert seen > 20
    history = RESULTS / "history" / "pipeline-schedules.md"
    text = history.read_text()
    assert set(re.findall(r"\]\(#([\w-]+)\)", text)) <= slugs(text), "a link inside the history record has no section"
