"""Benchmark records' provenance (`benchmarks/provenance.py`): the working tree's hash is the tree of the commit
whose files ran, also when the checkout's git metadata is older than its files, and leads back to that commit."""

from __future__ import annotations

import shutil
import subprocess

import pytest

import provenance

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs the git command line")


def _git(repo, *args) -> str:
    return subprocess.check_output(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                                   text=True).strip()


def test_the_tree_of_a_copy_with_old_git_metadata_names_the_commit_that_holds_its_files(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / ".gitignore").write_text("ignored/\n")
    (repo / "a.py").write_text("one\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "first")
    old_head = _git(repo, "rev-parse", "--short", "HEAD")
    monkeypatch.chdir(repo)
    assert provenance.tree() == _git(repo, "rev-parse", "HEAD^{tree}")
    assert provenance.dirty() is False
    (repo / "ignored").mkdir()
    (repo / "ignored" / "model.bin").write_text("weights")  # ignored files are not part of the tree
    assert provenance.tree() == _git(repo, "rev-parse", "HEAD^{tree}")

    # The files of a later commit, with the first commit's metadata (as a copy sent to another machine has them):
    (repo / "a.py").write_text("two\n")
    (repo / "b.py").write_text("new\n")  # untracked there, part of the later commit
    copied_tree = provenance.tree()
    assert provenance.commit() == old_head and provenance.dirty() is True
    assert copied_tree != _git(repo, "rev-parse", "HEAD^{tree}")
    assert _git(repo, "status", "--porcelain") == "M a.py\n?? b.py", "the own index is untouched"
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "second")
    later = _git(repo, "rev-parse", "HEAD")
    assert provenance.commits_of([copied_tree]) == [(copied_tree, later)]


def test_a_tracked_file_an_ignore_rule_matches_stays_in_the_tree(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    _git(repo, "init", "-q")
    (repo / ".gitignore").write_text("data/\n")
    (repo / "data" / "keep.json").write_text("{}")
    _git(repo, "add", "-A")
    _git(repo, "add", "-f", "data/keep.json")  # tracked although ignored
    _git(repo, "commit", "-qm", "first")
    monkeypatch.chdir(repo)
    assert provenance.tree() == _git(repo, "rev-parse", "HEAD^{tree}")
    (repo / "data" / "keep.json").unlink()  # and its deletion counts
    assert provenance.tree() != _git(repo, "rev-parse", "HEAD^{tree}")


def test_outside_a_checkout_the_tree_is_unknown(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert provenance.tree() is None
