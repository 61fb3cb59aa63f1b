"""The streamed-expert cache's eviction policies (`expert_policy.py`) against hand-worked cases:
which resident keys `victims` names, that the call's own keys are never among them, and how
LFRU's decayed counts order keys. Each expected value is worked out in the comment above it.

LFRU(modules=1, half_life=h) weighs a use at clock c (the c-th `use` call) by 2 ** (c / h);
a key's score is the sum of its weights, the lowest score goes first. `guard=0` turns off
the recency guard where a test is about the counts alone.
"""

import pytest

from mlx_v41.model.expert_policy import LFRU, LRU, make_policy


def lru_abc() -> LRU:
    policy = LRU()
    for keys in (["a"], ["b"], ["c"], ["a"]):
        policy.use(keys)
    return policy  # recency, oldest first: b, c, a


def test_lru_evicts_least_recent():
    policy = lru_abc()
    # b was last used at step 2, c at 3, a at 4
    assert policy.victims(1, set()) == ["b"]
    assert policy.victims(2, set()) == ["b", "c"]
    # naming victims evicts nothing: asked again, the same answer
    assert policy.victims(3, set()) == ["b", "c", "a"]


def test_lru_keep_never_returned():
    policy = lru_abc()
    # b is kept, so the next two in recency order: c, a
    assert policy.victims(2, {"b"}) == ["c", "a"]
    # only c and a are left to name, however many are asked for
    assert policy.victims(5, {"b"}) == ["c", "a"]
    assert policy.victims(1, {"a", "b", "c"}) == []


def test_lru_forget():
    policy = lru_abc()
    policy.forget("b")
    policy.forget("never used")  # unknown keys are ignored
    # b gone: c (step 3) is the oldest, then a (step 4)
    assert policy.victims(3, set()) == ["c", "a"]


@pytest.mark.parametrize("make", [LRU, LFRU], ids=["lru", "lfru"])
def test_victims_of_count_zero(make):
    policy = make()
    policy.use(["a", "b"])
    assert policy.victims(0, set()) == []


def test_lfru_keeps_frequent_over_recent():
    lfru, lru = LFRU(modules=1, half_life=64.0, guard=0), LRU()
    for policy in (lfru, lru):
        for keys in (["hot"], ["hot"], ["hot"], ["new"]):
            policy.use(keys)
    # hot: 2**(1/64) + 2**(2/64) + 2**(3/64) = 1.011 + 1.022 + 1.033 = 3.066;
    # new: 2**(4/64) = 1.044 < 3.066, so new goes first although it is the more recent
    assert lfru.victims(1, set()) == ["new"]
    # LRU: hot was last used at step 3, new at 4
    assert lru.victims(1, set()) == ["hot"]
    # with new kept, hot is the only one left
    assert lfru.victims(1, {"new"}) == ["hot"]
    assert lfru.victims(2, {"new", "hot"}) == []


@pytest.mark.parametrize("late_clock, victim", [(6, "late"), (7, "hot")])
def test_lfru_decay_lets_hot_key_go(late_clock, victim):
    policy = LFRU(modules=1, half_life=2.0, guard=0)
    for _ in range(4):
        policy.use(["hot"])  # clocks 1..4
    for _ in range(late_clock - 5):
        policy.use([])  # steps of other modules (the clock runs on)
    policy.use(["late"])  # clock late_clock
    # hot: 2**0.5 + 2**1 + 2**1.5 + 2**2 = 1.414 + 2 + 2.828 + 4 = 10.243.
    # late at clock 6: 2**3 = 8 < 10.243, late goes (hot's count there: 10.243 / 8 = 1.28);
    # at clock 7: 2**3.5 = 11.314 > 10.243, hot goes (its count has decayed to 0.905 < 1)
    assert policy.victims(1, set()) == [victim]


def test_lfru_stale_entries_no_duplicates():
    policy = LFRU(modules=1, half_life=64.0)
    policy.use(["a", "b"])  # clock 1
    policy.use(["a"])  # clock 2
    policy.use(["a"])  # clock 3
    # The heap holds a three times (clocks 1, 2, 3; the first two stale) and b once.
    # b: 2**(1/64) = 1.011; a: 1.011 + 1.022 + 1.033 = 3.066. Each key once, b first.
    assert policy.victims(3, set()) == ["b", "a"]
    # the popped entries went back: the same answer again
    assert policy.victims(3, set()) == ["b", "a"]


def test_lfru_forget():
    policy = LFRU(modules=1, half_life=64.0, guard=0)
    policy.use(["a", "b"])  # clock 1
    policy.use(["a"])  # clock 2
    policy.use(["a"])  # clock 3
    policy.forget("b")
    # b gone (its heap entry is now stale): only a
    assert policy.victims(2, set()) == ["a"]
    policy.use(["b"])  # clock 4: b starts again from one use
    # b: 2**(4/64) = 1.044 < a's 3.066 (its history before the forget is gone)
    assert policy.victims(1, set()) == ["b"]


def test_lfru_guards_the_last_tokens_keys():
    # 2 modules, guard 1 token = 2 steps: a key is guarded while clock - last use < 2
    policy = LFRU(modules=2, half_life=64.0, guard=1.0)
    for keys in (["hot"], ["hot"], ["hot"], ["new"]):  # clocks 1..4
        policy.use(keys)
    # new (count 1, clock 4) is below hot (count ~3) but used 0 steps ago: guarded;
    # hot (last use 3, 4 - 3 = 1 < 2) is guarded too: only guarded keys, lowest count first
    assert policy.victims(1, set()) == ["new"]
    policy.use([])  # clock 5: hot's last use is 2 steps back, out of the guard; new's 1
    assert policy.victims(1, set()) == ["hot"]
    assert policy.victims(2, set()) == ["hot", "new"]  # then the guarded one
    assert policy.victims(2, {"hot"}) == ["new"]


def test_make_policy():
    assert isinstance(make_policy("lru"), LRU)
    assert isinstance(make_policy("lfru", modules=43), LFRU)
    with pytest.raises(ValueError, match="expert cache policy"):
        make_policy("fifo")
