"""Pure parts of the Ray Train entry: which ranks log their node's system metrics."""

from kiln.ray.trainer import monitors_its_node, node_label


def test_the_first_rank_of_every_node_but_rank_0s_monitors_it():
    placement = ["aaaa", "aaaa", "bbbb", "bbbb", "cccc", "aaaa"]
    assert [r for r in range(len(placement)) if monitors_its_node(r, placement)] == [2, 4]
    assert not any(monitors_its_node(r, ["aaaa", "aaaa"]) for r in range(2))  # one node: rank 0 covers it
    assert not monitors_its_node(0, ["aaaa"])


def test_node_label_is_short_and_stable():
    assert node_label("03675fc26a42e45db028d3781c8d529dc6ae4f09") == "node-03675fc2"
