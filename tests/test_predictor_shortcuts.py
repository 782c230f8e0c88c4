"""The roofline predictor's memoised shortcuts give the very floats of its general closed forms."""

import numpy as np

from hardware import catalog
from sim.engine.cluster import make_predictor
from sim.config import RunConfig
from sim.models.predictor import RooflinePredictor, load_profile


def predictors():
    """Every device of the paper profile with both models at tp 1 and 4: memory-bound and
    compute-bound decode batches both occur."""
    profile = load_profile("paper")
    for device in profile:
        for model in catalog.models():
            for tp in (1, 4):
                yield lambda model=model, device=device, tp=tp: RooflinePredictor(
                    catalog.model(model), catalog.device(device), tp, profile[device])


def test_decode_sums_are_the_same_floats_before_and_after_the_batch_is_memoised():
    rng = np.random.default_rng(0)
    kinds = set()
    for make in predictors():
        warm = make()
        for _ in range(200):
            batch = int(rng.choice([1, 2, 7, 32, 128, 512, 4096]))
            context, steps = int(rng.integers(0, 4_000_000)), int(rng.integers(1, 3000))
            cold = make()                      # no batch memoised yet: the general path
            assert warm.decode_time(batch, context, steps) == cold.decode_time(batch, context,
                                                                               steps)
            elapsed = float(rng.random()) * 1.2 * warm.decode_time(batch, context, steps)
            assert (warm.decode_next_boundary(batch, context, steps, elapsed)
                    == make().decode_next_boundary(batch, context, steps, elapsed))
            kinds.add(warm._memory_bound[batch] is None)
    assert kinds == {False, True}              # both paths were taken


def test_next_boundary_is_the_first_boundary_at_or_after_elapsed():
    p = make_predictor(RunConfig(), RunConfig().cluster.decode)
    rng = np.random.default_rng(1)
    for _ in range(500):
        batch, context = int(rng.integers(1, 64)), int(rng.integers(0, 200_000))
        steps = int(rng.integers(1, 400))
        elapsed = float(rng.random()) * 1.1 * p.decode_time(batch, context, steps)
        j, t = p.decode_next_boundary(batch, context, steps, elapsed)
        assert t == p.decode_time(batch, context, j)
        assert t >= elapsed or j == steps
        assert j == 1 or p.decode_time(batch, context, j - 1) < elapsed


def test_memory_bound_batches_are_memoised_only_where_the_memory_line_always_wins():
    p = make_predictor(RunConfig(), RunConfig().cluster.decode)
    for batch in (1, 8, 64, 512, 65536):
        const, c0, c1, m0, m1 = p._decode_lines(batch)
        assert (p._memory_bound[batch] is not None) == (m0 >= c0 and m1 >= c1)


def test_past_a_runs_end_the_next_boundary_is_its_last():
    """The aggregated engine asks for an arrival's boundary only within the run: one past
    its end must cut nothing, on memory- and compute-bound batches alike."""
    rng = np.random.default_rng(2)
    kinds = set()
    for make in predictors():
        p = make()
        for _ in range(100):
            batch = int(rng.choice([1, 3, 32, 512, 4096]))
            context, steps = int(rng.integers(0, 2_000_000)), int(rng.integers(1, 3000))
            end = p.decode_time(batch, context, steps)
            for elapsed in (np.nextafter(end, np.inf), end * (1 + float(rng.random()))):
                assert p.decode_next_boundary(batch, context, steps, float(elapsed)) == (
                    steps, end)
            kinds.add(p._memory_bound[batch] is None)
    assert kinds == {False, True}


def test_a_mixed_step_of_a_new_prompt_is_the_same_float_once_memoised():
    rng = np.random.default_rng(3)
    for make in predictors():
        warm = make()
        for _ in range(50):
            n = int(rng.integers(1, 8192))
            contexts = rng.integers(1, 20_000, size=int(rng.integers(0, 40))).tolist()
            first = warm.mixed_step([(n, 0)], contexts)
            assert warm.mixed_step([(n, 0)], contexts) == first == make().mixed_step(
                [(n, 0)], contexts)
            assert warm.mixed_step([(n, 0), (5, 0)], contexts) == make().mixed_step(
                [(n, 0), (5, 0)], contexts)
