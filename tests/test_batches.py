"""batches.py: the batch wait under a stream of groups none of which can be trained; a group's
completions and advantages turned into sequences one for one."""

import queue
import time
from types import SimpleNamespace

import pytest
from test_train import _args, _fake_worker, _group

from batches import BatchTimeout, batch_sequences, collect_groups


class EndlessQueue:
    """A fast server's queue: a group every few milliseconds, for `for_s` seconds (bounds the test)."""

    def __init__(self, group, for_s: float):
        self.group, self.until = group, time.monotonic() + for_s

    def get(self, timeout: float):
        if time.monotonic() > self.until:
            raise queue.Empty
        time.sleep(0.005)
        return self.group


@pytest.mark.parametrize("drop_stale", [False, True], ids=["equal-rewards", "stale"])
def test_batch_timeout_strikes_while_untrainable_groups_keep_coming(drop_stale):
    """Every group skipped (equal rewards: a task too hard for the model) or dropped (stale) while they
    arrive faster than the 0.5 s queue poll: the queue is never empty, and the wait must still end at
    --batch-timeout with its one line (it looped for as long as groups came: forever, on an endless
    row stream)."""
    equal = SimpleNamespace(rewards=[0.0] * 4, admitted_version=0, row={"_index": 0})
    stale = SimpleNamespace(rewards=[0.0, 1.0], admitted_version=0, row={"_index": 1})
    worker = _fake_worker(alive=True)
    worker.queue = EndlessQueue(stale if drop_stale else equal, for_s=30)
    t0 = time.monotonic()
    with pytest.raises(BatchTimeout) as e:
        collect_groups(worker, 1, 5, _args(drop_stale=drop_stale), [], {"stop": False})
    waited = time.monotonic() - t0
    assert waited < 5, f"BatchTimeout after {waited:.0f} s with --batch-timeout 1"
    assert ("groups dropped as stale" if drop_stale else "all rewards equal in") in str(e.value)


def test_a_group_with_fewer_advantages_than_completions_is_refused_not_cut_short():
    """One sequence per completion, each with its own advantage: a group whose lists disagree raised
    nothing and silently left its last completions untrained (zip stops at the shorter)."""
    group = _group(0, [(4, 0, 0), (5, 0, 0), (6, 0, 0)])
    assert [len(s["ids"]) for s in batch_sequences([group])] == [6, 7, 8]
    group.advantages = group.advantages[:2]
    with pytest.raises(ValueError, match="shorter"):
        batch_sequences([group])
