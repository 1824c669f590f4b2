import torch

from tests.conftest import make_stack, sample_ids, tiny


def hit_rate(family, capacity, prefetch="none"):
    model = tiny(family)
    with torch.no_grad(), make_stack(model, family, capacity=capacity, prefetch=prefetch) as stack:
        model.generate(sample_ids(batch=1, seq=16, seed=3), max_new_tokens=12, do_sample=False)
    stack.cache.check_invariants()
    return stack.cache.stats.summary()["hit_rate"]


def test_lru_hit_rate_non_decreasing_in_capacity():
    for family in ("olmoe", "mixtral", "deepseek_v3"):
        # from 5%: 2% of the tiny Mixtral holds no expert (an error since a cache that holds nothing is one)
        rates = [hit_rate(family, c) for c in (0.05, 0.1, 0.25, 0.5, 1.0)]
        assert rates == sorted(rates), (family, rates)
        assert rates[-1] > rates[0], (family, rates)


def test_full_capacity_only_compulsory_misses():
    family = "olmoe"
    model = tiny(family)
    with torch.no_grad(), make_stack(model, family, capacity=1.0, prefetch="none") as stack:
        model.generate(sample_ids(batch=1, seq=16, seed=3), max_new_tokens=6, do_sample=False)
    st = stack.cache.stats
    assert st.total("evictions") == 0
    assert st.total("misses") == len(stack.cache.entries)  # every miss is a first touch
