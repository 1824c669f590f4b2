"""One timed cell: a stack installed fresh under ``execution=offload`` on a loaded model, a warm-up generation,
then measured generations, each pass's wall time beside its simulated time (:func:`run_cell`). calibrate's own
check (:func:`check_profile`) and every cell of ``specmd fidelity`` are this one measurement (issue 56: they were
twins, and drifted apart: one warm-up of 12 decodes against one of 2, one generation against two)."""

from __future__ import annotations

import gc
from typing import Optional

import torch


class PassProbe:
    """Per forward pass of an installed offload stack: (host busy s, link busy s, simulated host busy s,
    simulated link busy s) over the pass. Wraps the executor's ``begin_pass``/``end_pass`` (the boundaries the
    wall clock itself uses) and reads both sides' busy counters there."""

    def __init__(self, stack):
        self.ex, self.clock = stack.executor, stack.engine.clock
        self.marks: list = []
        begin, end = self.ex.begin_pass, self.ex.end_pass
        self.ex.begin_pass = lambda kind, tokens: (self.marks.append(self._now()), begin(kind, tokens))
        self.ex.end_pass = lambda: (end(), self.marks.__setitem__(-1, _sub(self._now(), self.marks[-1])))

    def _now(self) -> tuple:
        host = getattr(self.ex, "host_worker", None)
        mover = getattr(self.ex, "mover", None)
        busy = self.clock.busy()
        return (host.busy_s if host is not None else 0.0, mover.busy_s if mover is not None else 0.0,
                busy.get("host_busy_s", 0.0), busy.get("link_busy_s", 0.0))


def _sub(a: tuple, b: tuple) -> tuple:
    return tuple(x - y for x, y in zip(a, b))


def offload_execution(threads="auto", pin: bool = False, host_threads="auto") -> dict:
    """The ``execution`` section of a timed cell: offload, throttled to the profile's link, at these thread
    settings (a profile's ``calibrated_on``: the cells run where the profile was fitted)."""
    return {"name": "offload", "throttle": True, "threads": threads, "pin": bool(pin), "host_threads": host_threads}


def run_cell(model, ckpt, hw: dict, stack: dict, ids: torch.Tensor, decodes: int, device,
             execution: Optional[dict] = None) -> dict:
    """One fresh install of ``stack`` (``{"capacity": c, "miss": m, ...}``: the groups :func:`specmd.compose.spec_of`
    takes, the profile ``hw`` at capacity ``c``): a warm-up generation (the first touch of the arena's and the
    host tier's pages, the first calls of its kernels, its first evictions: costs a long run pays once, not per
    prompt), then the measured ones -- ``ids`` ([B, prompt]), then ``ids`` rotated, the ``decodes`` split
    between them. Per pass kind (``prefill``, ``decode``) the mean over the measured passes of: wall and
    simulated seconds, their waits (wall: copies waited for, and on a CPU device the host's experts computed
    inline on the same cores; simulated: the stall), and the host's and the link's busy seconds, each side."""
    from ...compose import spec_of
    from ...executor import EXECUTION
    from ...executor.hostwork import InlineHost
    from ...hardware import HardwareConfig
    from ...hook import install

    groups = dict(stack)
    spec = spec_of(hardware=HardwareConfig(**{**hw, "capacity": groups.pop("capacity")}), **groups)
    spec.execution = EXECUTION.params(execution or offload_execution())
    st = install(model, spec, device=device, checkpoint=ckpt)
    try:
        probe = PassProbe(st)
        # (as long as the measured prompt, its tokens reversed: a shorter one left the first eviction and the
        # first activations of the measured size to the measured prefill -- a 4 x 32-token prefill of the
        # Qwen-shaped model at 30% took 3.0 s once, then 1.1-1.2 s)
        warm = torch.flip(ids, (1,))
        # the measured part: two generations (the prompt, then the prompt rotated), the decodes split between
        # them -- two prefills in the TTFT's mean, not one: a prefill is one event whose wall jitters by
        # 15-25% on this VM, and with one the repeats' spread exceeded the error in 41 of 54 cells
        half = decodes // 2
        with torch.no_grad():
            # (n new tokens: a prefill and n - 1 decodes)
            for i, (x, n) in enumerate(((warm, 3), (ids, half + 1), (torch.roll(ids, 7, 1), decodes - half + 1))):
                if i == 1:
                    first = len(st.executor.pass_kinds)
                model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=0)
        ex = st.executor
        inline = isinstance(getattr(ex, "host_worker", None), InlineHost)
        passes = st.engine.cache.stats.passes
        out = {}
        for kind in ("prefill", "decode"):
            rows = [(w, ws, m, p.time_s, p.stall_s) for k, w, ws, m, p in
                    zip(ex.pass_kinds[first:], ex.pass_wall[first:], ex.pass_stall[first:], probe.marks[first:],
                        passes[first:]) if k == kind]
            if not rows:
                continue
            n = len(rows)
            mean = lambda f: sum(f(r) for r in rows) / n  # noqa: E731
            wall, sim = mean(lambda r: r[0]), mean(lambda r: r[3])
            host_w = mean(lambda r: r[2][0])
            # the wall's waits: copies waited for, and (inline, a CPU) the host's experts on the same cores
            waits_w = mean(lambda r: r[1]) + (host_w if inline else 0.0)
            out[kind] = {"wall_s": wall, "sim_s": sim, "wall_waits_s": waits_w, "sim_waits_s": mean(lambda r: r[4]),
                         "wall_host_s": host_w, "sim_host_s": mean(lambda r: r[2][2]),
                         "wall_link_s": mean(lambda r: r[2][1]), "sim_link_s": mean(lambda r: r[2][3])}
        return out
    finally:
        st.remove()
        del st
        gc.collect()  # (a 35 MB-expert model's arena and host tier are gigabytes: freed before the next install)


CHECK_STACKS = ({"capacity": 0.05, "prefetch": "topk", "miss": "fetch"},
                {"capacity": 0.05, "prefetch": "topk", "miss": "hybrid"})


def check_profile(model_name: str, hw: dict, device: torch.device, prompt: int = 256, decodes: int = 12,
                  execution: Optional[dict] = None) -> dict:
    """calibrate's own check: the calibrated profile's simulated TTFT and TPOT against what ``execution=offload``
    measures, on two stacks at 5% (lru + topk with ``fetch``, and with ``hybrid``), a ``prompt``-token prompt and
    ``decodes`` greedy decodes, measured as a fidelity cell is (:func:`run_cell`). Returns {miss: {ttft, tpot:
    measured / simulated}}."""
    from ...models.loader import load_configured, local_checkpoint

    model, mcfg = load_configured(model_name)
    model.to(device)
    ckpt = local_checkpoint(mcfg.pretrained) if mcfg.pretrained else None
    ids = torch.randint(0, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(7)).to(device)
    out = {}
    for stack in CHECK_STACKS:
        r = run_cell(model, ckpt, hw, stack, ids, decodes, device, execution)
        out[stack["miss"]] = {fig: r[kind]["wall_s"] / r[kind]["sim_s"]
                              for fig, kind in (("ttft", "prefill"), ("tpot", "decode")) if kind in r}
    return out
