"""The driver's router of worker output: everything to the file, Kiln's lines that matter to
the console, once each."""

from kiln.ray.console import WorkerLogRouter, console_line

T = "2026-11-24 15:41:08,068"


def test_the_console_gets_kilns_warnings_and_console_lines_once_and_the_file_gets_all(tmp_path):
    shown: list[str] = []
    router = WorkerLogRouter(str(tmp_path / "run/workers.log"), show=shown.append)
    batch = {
        "ip": "10.0.0.2",
        "pid": 42,
        "actor_name": "RayTrainWorker",
        "is_err": True,
        "lines": [
            f"{T} INFO kiln.train: rank 0 of 2 on node abc",  # Kiln's, but detail: file only
            f"{T} WARNING kiln.train: step 5: non-finite training loss nan",  # a warning: shown
            f"{T} INFO kiln.console: [###---] step 20/200 | loss 6.442",  # progress: shown
            "Reporting training result 1: TrainingReport(checkpoint=None, metrics={...})",
            "[2026-11-24 15:41:08,202] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU.",
            "Traceback (most recent call last):",
            "password=http://user:hunter22@host/",  # scrubbed on its way to the file
        ],
    }
    router(batch)
    router(dict(batch))  # the same lines forwarded again (a second log monitor)
    router.close()
    assert shown == [
        f"{T} kiln.train: warning: step 5: non-finite training loss nan\n"
        f"{T} kiln.console: [###---] step 20/200 | loss 6.442\n"
    ]
    logged = (tmp_path / "run/workers.log").read_text().splitlines()
    assert len(logged) == 14 and all(line.startswith("(RayTrainWorker pid=42, ip=10.0.0.2) ") for line in logged)
    assert any("TrainingReport(" in line for line in logged) and not any("hunter22" in line for line in logged)
    router(batch)  # after close: nothing written, nothing raised
    assert len(shown) == 1


def test_only_kiln_loggers_reach_the_console():
    assert (
        console_line(f"{T} ERROR kiln.data.sources: shard x is corrupt")
        == f"{T} kiln.data.sources: error: shard x is corrupt"
    )
    assert console_line(f"{T} WARNING ray.train: something") is None
    assert console_line(f"{T} WARNING kilnx: not ours") is None
    assert console_line("kiln.console: no timestamp") is None
