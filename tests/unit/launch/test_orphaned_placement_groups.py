"""Which placement groups Kiln reclaims on connecting: only those a dead job leaked."""

from types import SimpleNamespace as Row

from kiln.launch.on_ray import orphaned_placement_groups

JOBS = [
    Row(job_id="01000000", status="SUCCEEDED"),
    Row(job_id="02000000", status="RUNNING"),
    Row(job_id="03000000", status="JobStatus.FAILED"),
]


def pg(pg_id, job, state="CREATED", detached=False):
    return Row(placement_group_id=pg_id, creator_job_id=job, state=state, is_detached=detached)


def test_a_live_group_of_an_ended_job_is_orphaned():
    assert orphaned_placement_groups([pg("a", "01000000"), pg("b", "03000000", "PENDING")], JOBS) == ["a", "b"]


def test_running_jobs_detached_and_removed_groups_are_left_alone():
    groups = [
        pg("live", "02000000"),
        pg("detached", "01000000", detached=True),
        pg("gone", "01000000", "REMOVED"),
        pg("unknown-job", "09000000"),
    ]
    assert orphaned_placement_groups(groups, JOBS) == []
