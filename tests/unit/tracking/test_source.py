"""The commit a run records, read from HEAD and the refs alone, as a cluster node gets them; and
the job runtime env that ships exactly those with the code."""

import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
import yaml
from ray._private.ray_constants import get_runtime_env_default_excludes
from ray._private.runtime_env.packaging import _zip_files

from kiln.tracking.source import git_commit

REPO = Path(__file__).resolve().parents[3]
SHA = "0123456789abcdef0123456789abcdef01234567"


def _repo_head() -> str:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("the checkout under test is not a git repository")
    return out.stdout.strip()


def test_a_checkout_without_git_objects_still_knows_its_commit(tmp_path):
    head = _repo_head()
    node = tmp_path / "kiln"  # what a node holds: no objects, no git history
    (node / "platform/kiln").mkdir(parents=True)
    (node / ".git").mkdir()
    for name in ("HEAD", "packed-refs", "refs"):
        src = REPO / ".git" / name
        if src.is_dir():
            shutil.copytree(src, node / ".git" / name)
        elif src.exists():
            shutil.copy(src, node / ".git" / name)
    assert git_commit(node / "platform/kiln") == head


def test_detached_packed_worktree_and_no_repository(tmp_path):
    main = tmp_path / "main"
    (main / ".git/refs/heads").mkdir(parents=True)
    (main / ".git/HEAD").write_text("ref: refs/heads/dev\n")
    (main / ".git/packed-refs").write_text(f"# pack-refs with: peeled\n{SHA} refs/heads/dev\n")
    assert git_commit(main) == SHA  # a ref found only in packed-refs
    (main / ".git/HEAD").write_text(SHA[::-1] + "\n")
    assert git_commit(main) == SHA[::-1]  # detached
    # A worktree: its .git is a file, HEAD in its own git dir, refs in the common one.
    wt_git = main / ".git/worktrees/wt"
    wt_git.mkdir(parents=True)
    (wt_git / "HEAD").write_text("ref: refs/heads/dev\n")
    (wt_git / "commondir").write_text("../..\n")
    (tmp_path / "wt").mkdir()
    (tmp_path / "wt/.git").write_text(f"gitdir: {wt_git}\n")
    assert git_commit(tmp_path / "wt") == SHA
    (main / ".git/HEAD").write_text("ref: refs/heads/gone\n")
    assert git_commit(main) == "unknown"  # a ref that is nowhere
    assert git_commit("/") == "unknown"


def _packed(root: Path, excludes: list[str], tmp_path: Path) -> set[str]:
    """The paths Ray's own packer puts in the upload of `root` (.gitignore files respected)."""
    out = tmp_path / f"{root.name}.zip"
    _zip_files(str(root), excludes, str(out), include_gitignore=True)
    return set(zipfile.ZipFile(out).namelist())


def test_the_job_runtime_env_ships_the_code_and_the_refs_not_the_rest(tmp_path):
    env = yaml.safe_load((REPO / "jobs/runtime_env.yaml").read_text())
    assert env["py_modules"] == ["platform/kiln"] and env["working_dir"] == "."
    package = _packed(REPO / "platform/kiln", env["excludes"], tmp_path)
    source = {str(p.relative_to(REPO / "platform/kiln")) for p in (REPO / "platform/kiln").rglob("*.py")}
    assert source <= package and "data/manifest.py" in package  # every module of the package
    # A working dir's excludes follow Ray's defaults (.git, .venv, ...), as `ray job submit` does.
    working_dir = _packed(REPO, get_runtime_env_default_excludes() + env["excludes"], tmp_path)
    for kept in (".git/HEAD", "jobs/pretrain.py", "jobs/configs/debug.yaml", "platform/kiln/data/manifest.py"):
        assert kept in working_dir, kept
    assert any(p.startswith(".git/refs/") for p in working_dir)
    for dropped in (".git/objects/", ".git/config", ".venv/", "data/", "runs/", "mlflow.db"):  # at the top
        assert not [p for p in working_dir if p.startswith(dropped)], dropped
    assert not [p for p in working_dir | package if "__pycache__/" in p]
