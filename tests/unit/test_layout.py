"""The layout rules from DEVELOPERS.md that, if broken, break every Ray worker."""

import ast
import platform
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_platform_dir_is_not_a_package():
    assert (REPO / "platform" / "kiln" / "__init__.py").is_file()
    assert not (REPO / "platform" / "__init__.py").exists()


def test_stdlib_platform_wins_even_with_repo_first_on_path():
    # Ray puts the working dir first on every worker's sys.path; stdlib platform must still win.
    code = "import platform, sys; print(platform.__file__); print(platform.system())"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         env={"PYTHONPATH": str(REPO)}, check=True).stdout.splitlines()
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert Path(out[0]).resolve() == stdlib / "platform.py"
    assert out[1] == "Linux"
    assert Path(platform.__file__).resolve() == stdlib / "platform.py"


def test_kiln_is_imported_from_platform_dir():
    import kiln

    assert Path(kiln.__file__).resolve() == REPO / "platform" / "kiln" / "__init__.py"


def test_model_imports_only_torch():
    tree = ast.parse((REPO / "platform" / "kiln" / "model.py").read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            roots.add(node.module.split(".")[0])
    assert roots <= {"torch", "math", "dataclasses", "__future__"}, roots


def test_library_uses_logging_not_print():
    offenders = []
    for path in (REPO / "platform" / "kiln").rglob("*.py"):
        if path.name in ("cli.py", "local.py"):  # command front ends print their output
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
                offenders.append(f"{path.name}:{node.lineno}")
    assert not offenders, offenders
