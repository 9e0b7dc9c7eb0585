"""One worker set-up: the Ray Train worker and the local launcher both hand their rank to
`kiln.parallel.worker.run_worker`, and neither builds an engine or calls the loop itself."""

import ast
from pathlib import Path

KILN = Path(__file__).resolve().parents[3] / "platform" / "kiln"


def _called(path: Path) -> set[str]:
    return {
        n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Call)
    }


def test_both_launchers_call_the_one_worker_set_up():
    for launcher in ("ray/trainer.py", "launch/local.py"):
        calls = _called(KILN / launcher)
        assert "run_worker" in calls, launcher
        # each says how its rows are read (its source), never how the engine and loop are built
        assert calls & {"build_engine", "train_loop", "prepare_process"} == set(), launcher
    assert {"build_engine", "train_loop"} <= _called(KILN / "parallel/worker.py")
