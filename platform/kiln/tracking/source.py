"""The git commit of the code that runs, read from the repository's files.

On a cluster the code arrives without its history: a job's working dir (`jobs/runtime_env.yaml`)
and the cluster files' rsync carry `.git/HEAD` and the refs but not the objects, and nodes may
have no `git` binary. `git rev-parse` (and MLflow's GitPython-based context) then finds nothing,
so Kiln reads HEAD and the refs itself: a worktree's `.git` file, a detached HEAD and packed
refs included.
"""

from __future__ import annotations

import os
import re

UNKNOWN = "unknown"
_SHA = re.compile(r"^[0-9a-f]{40}([0-9a-f]{24})?$")  # SHA-1, or SHA-256 repositories


def git_commit(path: str | os.PathLike = ".") -> str:
    """The commit checked out in the repository holding `path`; "unknown" outside one."""
    git_dir = _find_git_dir(os.path.abspath(path))
    if git_dir is None:
        return UNKNOWN
    common = _common_dir(git_dir)
    try:
        head = _read(os.path.join(git_dir, "HEAD"))
    except OSError:
        return UNKNOWN
    if _SHA.match(head):
        return head  # a detached HEAD
    if not head.startswith("ref: "):
        return UNKNOWN
    return _resolve(common, head[len("ref: ") :].strip()) or UNKNOWN


def _find_git_dir(path: str) -> str | None:
    while True:
        dot_git = os.path.join(path, ".git")
        if os.path.isdir(dot_git):
            return dot_git
        if os.path.isfile(dot_git):  # a worktree or submodule: "gitdir: <path>"
            with open(dot_git) as f:
                line = f.read().strip()
            if line.startswith("gitdir: "):
                return os.path.normpath(os.path.join(path, line[len("gitdir: ") :]))
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent


def _common_dir(git_dir: str) -> str:
    """Where the refs live: a worktree's git dir names the main repository's in `commondir`."""
    try:
        return os.path.normpath(os.path.join(git_dir, _read(os.path.join(git_dir, "commondir"))))
    except OSError:
        return git_dir


def _resolve(common: str, ref: str) -> str | None:
    try:
        sha = _read(os.path.join(common, ref))
        return sha if _SHA.match(sha) else None
    except OSError:
        pass
    try:
        with open(os.path.join(common, "packed-refs")) as f:
            for line in f:
                sha, _, name = line.strip().partition(" ")
                if name == ref and _SHA.match(sha):
                    return sha
    except OSError:
        pass
    return None


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()
