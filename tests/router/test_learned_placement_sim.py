"""Simulator check of traffic-learned placement (issue 15): on the MovieLens trace, co-locating the
clusters the sketch saw requested together raises the affinity router's hit ratio without replicating
anything, keeps every pod's cluster count (capacity), and moves at most the budget per interval."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from kvshard.datasets import load_dataset
from kvshard_bench import routing_sim as sim
from kvshard_router.policies import make_policy


class Recorded(sim.Simulation):
    """The simulation, recording what each colocation interval moved and the per-pod cluster counts."""

    per_interval: list[int]
    counts: list[collections.Counter[str]]

    def _colocate(self, interval: float, now: float, pending: list[tuple[float, int, str]]) -> int:
        moved = super()._colocate(interval, now, pending)
        self.per_interval.append(moved)
        self.counts.append(collections.Counter(h[0] for h in self.assignment.values()))
        assert all(len(h) == 1 for h in self.assignment.values())  # no replica added
        return moved


@pytest.fixture(scope="module")
def small() -> tuple[sim.Trace, sim.ModelSettings, float]:
    model = sim.ModelSettings(pods=16, intervals=10)
    trace = sim.build_trace(load_dataset("movielens-100k"), sim.TraceSettings(requests=16_000), model, None)
    mean_full = float(np.mean([sim.service_ms(model, r.history_tokens, sum(r.item_tokens or ()))
                               for r in trace.requests]))
    return trace, model, mean_full / (model.full_ms - model.cached_ms)


def test_learned_colocation_beats_plain_affinity_within_capacity_and_budget(
    small: tuple[sim.Trace, sim.ModelSettings, float],
) -> None:
    trace, model, lam = small
    plain = sim.Simulation(trace, model, None).run("affinity", make_policy("affinity", load_penalty_tokens=lam))
    learning = sim.LearningSettings(move_budget=32)
    learned_sim = Recorded(trace, model, None, learning)
    learned_sim.per_interval, learned_sim.counts = [], []
    start = collections.Counter(h[0] for h in learned_sim.assignment.values())
    learned = learned_sim.run("learned", make_policy("affinity", load_penalty_tokens=lam))

    assert learned.hit_ratio > 1.05 * plain.hit_ratio
    assert learned_sim.per_interval and max(learned_sim.per_interval) <= learning.move_budget
    assert sum(learned_sim.per_interval) == learned_sim.moves > 0
    assert all(counts == start for counts in learned_sim.counts)  # every pod keeps its cluster count
    # load-aware: the learned placement does not pile traffic on a few pods
    assert np.mean(learned.window_imbalance) <= np.mean(plain.window_imbalance) + 0.05


def test_routing_by_backlog_keeps_more_local_and_waits_less_than_counting_requests(
    small: tuple[sim.Trace, sim.ModelSettings, float],
) -> None:
    """The router's Backlog (work left, drained at learned rates) against λ per in-flight request, both
    with learned placement on the same trace: more item tokens served from cache and a shorter tail."""
    trace, model, lam = small
    learning = sim.LearningSettings(move_budget=32)
    counted = sim.Simulation(trace, model, None, learning, load="inflight").run(
        "inflight", make_policy("affinity", load_penalty_tokens=lam))
    backlog = sim.Simulation(trace, model, None, learning, load="backlog").run("backlog", make_policy("affinity"))
    assert backlog.hit_ratio > 1.03 * counted.hit_ratio
    assert backlog.p99_ms < 0.9 * counted.p99_ms


def test_remembering_the_blocks_sent_outside_the_placement_keeps_more_local(
    small: tuple[sim.Trace, sim.ModelSettings, float],
) -> None:
    """Pods keep the blocks they computed (an LRU the size of ``lru_blocks``); a router that remembers
    what it sent where, bounded the same, serves more item tokens from cache without a longer tail."""
    trace, model, _ = small
    learning = sim.LearningSettings(move_budget=32)
    forgetful = sim.Simulation(trace, model, None, learning).run("forgetful", make_policy("affinity"))
    remembering = sim.Simulation(trace, model, None, learning).run(
        "remembering", make_policy("affinity", recent_blocks_per_pod=sim.lru_blocks(trace, model)))
    assert remembering.hit_ratio > 1.05 * forgetful.hit_ratio
    assert remembering.p99_ms < 1.05 * forgetful.p99_ms
