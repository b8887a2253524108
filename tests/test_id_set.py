"""IdSet (nanovllm/batch/id_set.py) against a Python set of the same ids."""
from random import Random

from nanovllm.batch.id_set import IdSet


def test_id_set_answers_as_a_python_set():
    rng = Random(0)
    ids = [f"req-{rng.randrange(5000)}" for _ in range(3000)] + ["é-ünïcode", "", "x" * 500]
    other_ids = [f"req-{rng.randrange(5000)}" for _ in range(2000)]
    ours, theirs = IdSet(ids), set(ids)
    assert len(ours) == len(ids)  # every add counts; repeats are what repeated() reports
    probes = ids[:200] + other_ids[:200] + ["req-x", "é-ünïcode"]
    assert [p in ours for p in probes] == [p in theirs for p in probes]
    assert 7 not in ours
    assert IdSet(set(ids)).count_in(IdSet(other_ids)) == len(theirs & set(other_ids))
    counts = {}
    for i in ids:
        counts[i] = counts.get(i, 0) + 1
    assert len(ours.repeated()) == sum(n > 1 for n in counts.values()) > 0
    ours.add("late")  # after lookups sorted it
    assert "late" in ours and "req-x" not in ours and len(ours) == len(ids) + 1
