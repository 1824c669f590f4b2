"""topk and score prefetch on hand-made router outputs."""

import pytest
import torch

from specmd.policies.prefetch import PREFETCH


class FakeView:
    num_experts, top_k, num_layers = 6, 2, 2

    def __init__(self, probs):
        self.probs = torch.tensor(probs)

    def next_layer(self, layer):
        return layer + 1 if layer + 1 < self.num_layers else None

class Rec:  # a gate record whose prefetch signal is the view's hand-made router output
    from specmd.engine.record import Scoring

    scoring = Scoring(False, False, 1.0)  # (a plain rule: probabilities rank as they are)

    def __init__(self, layer, view):
        self.layer, self.view = layer, view

    def predict(self, target):
        return self.view.probs, self.view.probs.topk(self.view.top_k, dim=-1).indices


PROBS = [[0.05, 0.40, 0.30, 0.10, 0.10, 0.05],   # token 0: top-2 {1, 2}, top-3 adds 3 (tie 3/4 -> lower index)
         [0.50, 0.05, 0.05, 0.05, 0.15, 0.20]]   # token 1: top-2 {0, 5}, top-3 adds 4


def predict(overfetch, probs=PROBS, layer=0):
    p = PREFETCH.build({"name": "topk", "overfetch": overfetch})
    view = FakeView(probs)
    p.setup(view)
    return p.predict(Rec(layer, view), view)


def test_union_of_token_topk_in_descending_probability():
    assert predict(1.0) == [(1, [0, 1, 2, 5])]  # 0.50, 0.40, 0.30, 0.20


def test_overfetch_widens_each_token_to_ceil_k_times_factor():
    assert predict(1.5) == [(1, [0, 1, 2, 5, 4, 3])]  # k' = 3: adds 3 (0.10) and 4 (0.15)


def test_decode_single_token_and_last_layer():
    assert predict(1.0, probs=[PROBS[1]]) == [(1, [0, 5])]
    assert predict(1.0, layer=1) == []


def test_score_percentile_basis_readings():
    # percentile 50 over the last two predictions of the target layer: a peaked one, then [.4, .3, .2, .1].
    # window: the 8 scores' median is (.1 + .2) / 2 = .15 -> {0, 1, 2}: the count adapts to the window;
    # token: the token's own median is .25 -> {0, 1} (always half the experts, a fixed top-k).
    def run(basis):
        p = PREFETCH.build({"name": "score", "percentile": 50.0, "window": 2, "basis": basis})
        p.setup(FakeView(PROBS))
        out = []
        for probs in ([[0.7, 0.1, 0.1, 0.1]], [[0.4, 0.3, 0.2, 0.1]]):
            view = FakeView(probs)
            out.append(p.predict(Rec(0, view), view))
        return out

    assert run("window") == [[(1, [0, 1, 2, 3])], [(1, [0, 1, 2])]]
    assert run("token") == [[(1, [0, 1, 2, 3])], [(1, [0, 1])]]


@pytest.mark.parametrize("percentile", [0.0, 50.0, 80.0, 95.0, 99.9])
def test_score_quantile_is_torch_quantile_bit_for_bit(percentile):
    """The threshold from the sorted window (torch's float32 rank, its two order statistics, torch.lerp) is
    ``torch.quantile`` of the window bit for bit, for windows of every size around the vector widths."""
    from types import SimpleNamespace

    from specmd.policies.prefetch.score import ScorePrefetch

    q = percentile / 100.0
    g = torch.Generator().manual_seed(int(percentile * 10))
    for n in (1, 2, 3, 7, 64, 4096, 4097, 3071):
        x = torch.rand(n, generator=g) ** 3
        pol = ScorePrefetch(ScorePrefetch.Params(percentile=percentile, window=1))
        pol.setup(SimpleNamespace(num_layers=2))
        pol._push(1, x.numpy().reshape(1, n))
        assert torch.equal(pol.threshold(1), torch.quantile(x, q)), n


def test_score_window_ring_is_the_last_rows():
    """The ring of the last ``window`` rows, kept sorted as rows come and go, gives the threshold a concatenation
    of every prediction's rows cut to its last ``window`` gives (prefill blocks larger and smaller than the
    window, then decode rows; repeated scores, so a row that leaves removes one copy of each of its scores)."""
    from types import SimpleNamespace

    import numpy as np

    from specmd.policies.prefetch.score import ScorePrefetch

    pol = ScorePrefetch(ScorePrefetch.Params(window=8))
    pol.setup(SimpleNamespace(num_layers=2))
    g = torch.Generator().manual_seed(3)
    hist = None
    for t in (5, 2, 12, 1, 1, 3, 1, 7, 1, 1, 1, 9, 1, 1, 2):
        probs = torch.softmax(torch.randn(t, 6, generator=g), -1)
        probs[:, 0] = probs[:, 1]  # ties inside a row and across rows
        probs[0, 2] = 0.25
        hist = (probs if hist is None else torch.cat([hist, probs]))[-8:]
        pol._push(1, probs.numpy())
        assert np.array_equal(pol.sorted[1], np.sort(hist.reshape(-1).numpy())), t
        assert torch.equal(pol.threshold(1), torch.quantile(hist.reshape(-1), 0.8)), t


@pytest.mark.parametrize("percentile,window,E",
                         [(80.0, 64, 64), (80.0, 4, 8), (50.0, 3, 5), (0.0, 2, 4), (99.0, 8, 16)])
def test_score_selection_equals_the_torch_reference(percentile, window, E):
    """Score prefetch selects from its sorted window without torch ops (the threshold is computed only when a
    score equals the lower order statistic): the same experts in the same order as torch's quantile of the
    window's rows, ``probs >= threshold`` and :func:`union_by_score`, for decode rows and prefill blocks,
    with ties, exact order statistics and repeated rows."""
    from types import SimpleNamespace

    from specmd.engine.record import LiveRecord, Scoring
    from specmd.policies.prefetch.base import union_by_score
    from specmd.policies.prefetch.score import ScorePrefetch

    view = SimpleNamespace(num_layers=2, next_layer=lambda l: 1 if l == 0 else None)
    pol = ScorePrefetch(ScorePrefetch.Params(percentile=percentile, window=window))
    pol.setup(view)
    g = torch.Generator().manual_seed(int(percentile) + window + E)
    hist = None
    for step in range(120):
        T = 1 if step % 7 else int(torch.randint(2, 6, (1,), generator=g))
        logits = torch.randn(T, E, generator=g).mul(3).round()  # whole numbers: many exact ties
        if step % 11 == 0:
            logits = logits[:1].expand(T, E).clone()  # a repeated row
        rec = LiveRecord(0, torch.zeros(T, E), None, torch.zeros(T, 1, dtype=torch.long), Scoring(False, False, 1.0),
                         signal=lambda target, lg=logits: (lg, None))
        probs = torch.softmax(logits, -1)
        hist = (probs if hist is None else torch.cat([hist, probs]))[-window:]
        above = probs >= torch.quantile(hist.reshape(-1), percentile / 100.0)
        tokens, experts = above.nonzero(as_tuple=True)
        values = probs[tokens, experts]
        want = ([] if not bool(above.any()) else
                union_by_score(probs, experts.view(1, -1), values.view(1, -1)) if T == 1 else
                union_by_score(probs, experts.view(-1, 1), values.view(-1, 1)))
        assert pol.predict(rec, view) == [(1, want)], step


def test_score_threshold_that_rounds_to_the_lower_statistic():
    """Between two adjacent floats a < b the quantile's lerp can round to a (weight < 1/2) or to b (>= 1/2):
    a score equal to a is selected only in the first case, as torch's ``probs >= threshold`` does."""
    from types import SimpleNamespace

    import numpy as np

    from specmd.policies.prefetch.score import ScorePrefetch

    view = SimpleNamespace(num_layers=2, next_layer=lambda l: 1 if l == 0 else None)
    a = np.float32(0.5)
    b = np.nextafter(a, np.float32(1))
    for row, want in (([0.1, 0.2, a, b], [3, 2]),  # q * (n - 1) = 2.4: t = a + 0.4 ulp = a
                      ([0.1, a, b], [2])):  # 1.6: t = b - 0.4 ulp = b
        probs = torch.tensor([row], dtype=torch.float32)
        pol = ScorePrefetch(ScorePrefetch.Params(percentile=80.0, window=1))
        pol.setup(view)
        rec = SimpleNamespace(layer=0, predict=lambda target, p=probs: (p, None))
        got = pol.predict(rec, view)
        assert got == [(1, want)]
        torch_selects = (probs >= torch.quantile(probs.reshape(-1), 0.8)).nonzero()[:, 1].tolist()
        assert sorted(torch_selects) == sorted(want)  # (the hand answer is torch's)


def test_decode_fast_paths_equal_the_torch_reference():
    """The live path's Python shortcuts for small selections give exactly the torch results they replace:
    the requested experts (set of tolist vs bincount, on both sides of SMALL_SELECTION) and the decode issue
    order (stable sort of -score: ties keep their selection order; NaN scores fall back to torch)."""
    import torch

    from specmd.engine.record import SMALL_SELECTION, _unique
    from specmd.policies.prefetch.base import union_by_score

    g = torch.Generator().manual_seed(0)
    for T, k, E in ((1, 8, 64), (1, 2, 8), (32, 8, 64), (33, 8, 64), (SMALL_SELECTION, 1, 16), (4, 6, 160)):
        for _ in range(20):
            index = torch.randint(0, E, (T, k), generator=g)
            ref = torch.bincount(index.reshape(-1), minlength=E).nonzero().squeeze(1).tolist()
            assert _unique(index, E) == ref
    for _ in range(200):
        E, k = 16, 6
        probs = torch.softmax(torch.randn(1, E, generator=g), -1)
        index = torch.randperm(E, generator=g)[:k].unsqueeze(0)
        values = probs.gather(-1, index)
        values[0, torch.randint(0, k, (2,), generator=g)] = values[0, 0].item()  # ties
        ref = index[0, torch.argsort(-values[0], stable=True)].tolist()
        assert union_by_score(probs, index, values) == ref
    values = torch.tensor([[0.2, float("nan"), 0.5]])
    index = torch.tensor([[3, 1, 2]])
    assert union_by_score(torch.zeros(1, 4), index, values) == [2, 3, 1]  # torch: NaN last
