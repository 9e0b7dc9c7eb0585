"""`kiln data prepare` on a real Ray cluster of two nodes, reading from and writing to the
loopback S3 server: the tokenizer actors spread over both nodes, and the dataset is the same,
byte for byte, whatever the number of actors, and the same as a prepare without Ray.

Named to run after test_ray_nodes: that test lists the session cluster's processes and requires
every one to live on, and this test's actors and second node are still exiting for a while after
it ends."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pyarrow.fs as pafs

sys.path.insert(0, str(Path(__file__).parent))
from ray_nodes import BIN, is_alive  # noqa: E402
from test_two_nodes import SecondNode  # noqa: E402

KILN = str(BIN / "kiln")


def _upload(endpoint: str, corpus: list[str]) -> int:
    s3 = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    n = 0
    for root in (corpus[0], corpus[1], corpus[3]):  # json, logging, http
        for p in sorted(Path(root).glob("*.py")):
            s3.put_object(Bucket="kiln-test", Key=f"corpus/{Path(root).name}/{p.name}", Body=p.read_bytes())
            n += 1
    return n


def _shards(fs: pafs.FileSystem, root: str) -> dict[str, bytes]:
    infos = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    out = {}
    for i in infos:
        if i.type == pafs.FileType.File and i.path.endswith(".parquet"):
            with fs.open_input_stream(i.path) as f:
                out[i.path[len(root) :].lstrip("/")] = f.read()
    return out


def test_prepare_spreads_over_two_nodes_and_is_the_same_whatever_the_actors(ray_cluster, s3_server, corpus, tmp_path):
    gcs, _, env = ray_cluster
    assert _upload(s3_server, corpus) > 10
    common = [
        "data",
        "prepare",
        "--input",
        "s3://kiln-test/corpus/",
        "--tokenizer",
        "bpe",
        "--vocab-size",
        "512",
        "--seq-len",
        "64",
        "--unit-bytes",
        "32768",
        "--s3-endpoint",
        s3_server,
    ]
    here = subprocess.run(
        [KILN, *common, "--workers", "0", "--output", str(tmp_path / "here")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert here.returncode == 0, here.stderr[-3000:]
    ref = json.loads((tmp_path / "here/manifest.json").read_text())
    assert ref["units"] >= 6

    node = SecondNode(gcs, env)
    node.start()
    try:
        for workers in (1, 4):
            out = f"s3://kiln-test/prepared-{workers}"
            run = subprocess.run(
                [KILN, *common, "--address", gcs, "--workers", str(workers), "--output", out],
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert run.returncode == 0, run.stderr[-3000:]
            assert f"with {workers} tokenizer actors on Ray" in run.stderr
            fs = pafs.S3FileSystem(
                endpoint_override=s3_server,
                access_key="testing",
                secret_key="testing",
                region="us-east-1",
                scheme="http",
            )
            with fs.open_input_stream(f"kiln-test/prepared-{workers}/manifest.json") as f:
                m = json.loads(f.read())
            assert m["fingerprint"] == ref["fingerprint"] and m["splits"] == ref["splits"]
            assert _shards(fs, f"kiln-test/prepared-{workers}") == _shards(
                pafs.LocalFileSystem(), str(tmp_path / "here")
            )
            assert not fs.get_file_info(
                pafs.FileSelector(f"kiln-test/prepared-{workers}/_units", allow_not_found=True)
            )  # records gone
            if workers == 4:  # every actor is up before the first unit goes out (all 4 get units), SPREAD
                t = m["throughput"]
                assert t["nodes"] == 2 and t["workers"] == 4, t
                # the span holds every unit (from the pipeline's start to the last record back)
                assert t["busy_s"] <= 4 * t["seconds"] and t["first_unit_after_s"] < t["seconds"], t
    finally:
        node.kill()
    # Nothing of the node lives on: its log monitor polled the session's logs until the end.
    deadline = time.time() + 10
    while any(is_alive(p) for p in node.monitors) and time.time() < deadline:
        time.sleep(0.2)
    assert node.monitors and not any(is_alive(p) for p in node.monitors), node.monitors
