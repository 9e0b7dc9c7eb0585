"""`comm/bytes_per_step` counts what each call sends under the ring algorithms, once, whichever
of torch's names a caller uses (the older ones call the newer), and only while on. Two gloo
ranks in processes of their own (the counter wraps process-wide functions), met through a file
store. Every engine and layout: tests/unit/parallel/test_parallelism.py."""

import subprocess
import sys

PROBE = """
import sys, torch, torch.distributed as dist, torch.multiprocessing as mp
from kiln.parallel.comm_bytes import COUNTER

def rank(r, store_path):
    COUNTER.install()
    COUNTER.install()  # twice: still one wrapper
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=r, world_size=2)
    x = torch.ones(1000)  # 4,000 bytes
    dist.all_reduce(x)
    assert COUNTER.read() == 0, "counted while off"
    COUNTER.on = True
    dist.all_reduce(x)                                  # 2(n-1)/n of 4,000: 4,000
    dist.all_reduce(x.to(torch.bfloat16))               # 2,000
    dist.all_gather_into_tensor(torch.empty(2000), x)   # n-1 shards: 4,000 (all_gather_single inside)
    dist.reduce_scatter_tensor(torch.empty(500), x)     # (n-1)/n: 2,000
    dist.broadcast(x, src=0)                            # 4,000 on rank 0, nothing on rank 1
    COUNTER.on = False
    dist.all_reduce(x)
    COUNTER.timed = True
    read = COUNTER.metrics()
    assert read["comm/time_s"] > 0 and COUNTER.metrics() == {"comm/bytes_per_step": 0.0, "comm/time_s": 0.0}
    with COUNTER.apart() as sent:  # counted apart even while off, the running count left alone
        dist.all_reduce(x)
    assert sent["comm/bytes_per_step"] == 4000 and COUNTER.on is False and COUNTER.read() == 0
    with open(f"{store_path}.rank{r}", "w") as f:  # one file a rank: printed lines can interleave
        f.write(f"counted {read['comm/bytes_per_step']} {COUNTER.read()}")
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(rank, args=(sys.argv[1],), nprocs=2)
"""


def test_each_collective_counts_its_ring_bytes_once_and_only_while_on(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    out = subprocess.run(
        [sys.executable, str(probe), str(tmp_path / "store")], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    said = [(tmp_path / f"store.rank{r}").read_text() for r in (0, 1)]
    assert said == ["counted 16000.0 0.0", "counted 12000.0 0.0"], said
