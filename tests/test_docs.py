"""The user docs stay true: README and docs/ link only to files that exist, the CSV
walk-through of docs/data.md trains and evaluates as written, no doc or config names a
folder outside the repository, and the CHANGELOG's newest release is the package's
version. (The README's Flax snippet: tests/runner/test_cli.py; the data guide's second config:
tests/runner/test_runner_data.py; docs/config.md: tests/runner/test_config.py.)"""

import json
import pathlib
import re
import textwrap

import sparsejax
from sparsejax.__main__ import main

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_links_point_at_files_that_exist():
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" not in target and not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken


def test_readme_is_short_and_links_every_guide():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for guide in sorted((ROOT / "docs").glob("*.md")):
        assert f"(docs/{guide.name})" in readme, guide.name


def test_no_doc_or_config_names_a_folder_outside_the_repository():
    files = [*DOCS, *(ROOT / "configs").glob("*.yaml"), ROOT / "experiments" / "quickstart.ipynb"]
    files += [*(ROOT / "sparsejax").rglob("*.py"), *(ROOT / "experiments").glob("*.py")]
    found = [
        str(f.relative_to(ROOT))
        for f in files
        if re.search(r"\.\./shared|shared/data", f.read_text(errors="replace"))
    ]
    assert not found


def test_changelog_newest_release_is_the_package_version():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", changelog, re.M)
    assert releases and releases[0] == sparsejax.__version__


def test_the_csv_walkthrough_trains_evaluates_and_exports(tmp_path, monkeypatch, capsys):
    """docs/data.md, "A CSV file, step by step": its config on a file of its shape."""
    guide = (ROOT / "docs" / "data.md").read_text()
    section = guide[guide.index("## A CSV file, step by step") :]
    config = textwrap.dedent(re.search(r"```yaml\n(.*?)```", section, re.S).group(1))
    lines = ["click,user,item,site,price"]
    for i in range(600):
        user, item = i % 37, (i * 7) % 101
        lines.append(f"{int((user + item) % 5 == 0)},u{user},i{item},s{i % 3}.com,{i % 50}.5")
    (tmp_path / "clicks.csv").write_text("\n".join(lines) + "\n")
    (tmp_path / "my_clicks.yaml").write_text(config)
    monkeypatch.chdir(tmp_path)
    base = str(ROOT / "configs" / "base.yaml")
    assert main(["train", base, "my_clicks.yaml", "progress=false"]) == 0
    out = capsys.readouterr().out
    assert "kept 600 of 600 lines" in out and "splits: train 480, eval 60, test 60" in out
    summary = json.loads((tmp_path / "runs" / "my_clicks" / "summary.json").read_text())
    assert summary["last_eval"]["examples"] == 60 and 0 <= summary["last_eval"]["auc"] <= 1
    assert main(["eval", "runs/my_clicks", "--split", "test"]) == 0
    assert main(["export", "runs/my_clicks", "--out", "models/1"]) == 0
    assert (tmp_path / "models" / "1" / "example_request.json").is_file()
