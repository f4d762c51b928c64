"""journal.run_index against the plain answer: a stored run meets a wanted one when they
share a key. Candidates may not miss a record that holds a wanted key (a miss proves an
id new), and name no record that does not."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.journal.keys import MAX_RUN
from kvledger.journal.run_index import RunIndex

# keys around a bucket boundary and at the signed ends, so runs cross buckets and stems collide
_BASES = (0, (1 << 40) - 50, -(1 << 63), (1 << 63) - MAX_RUN - 10, 7 << 40)
_run = st.tuples(st.sampled_from(_BASES), st.integers(0, 200), st.integers(0, MAX_RUN - 1)).map(
    lambda t: (t[0] + t[1], min(t[0] + t[1] + t[2], (1 << 63) - 1)))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(_run, min_size=1, max_size=4), max_size=30), st.lists(_run, min_size=1, max_size=4))
def test_candidates_are_exactly_the_records_sharing_a_key(records, wanted):
    index = RunIndex()
    for seq, runs in enumerate(records, 1):
        index.add(runs, seq)
    expected = {seq for seq, runs in enumerate(records, 1)
                if any(a <= d and c <= b for a, b in runs for c, d in wanted)}
    assert index.candidates(wanted) == expected
    assert index.runs == sum(map(len, records))
