"""``specmd calibrate [--out DIR] [--name NAME] [--model MODEL] [--device DEV] [--quick]``: measure this machine
and write a hardware profile that makes the simulated clock predict what ``execution=offload`` measures.

Every measurement runs at one thread placement (``--threads``, ``--pin``: an offloaded run's
``execution.threads``/``pin``, :class:`specmd.machine.CorePlan`), recorded in the profile's ``calibrated_on``; a
run at other settings warns, and ``specmd fidelity`` runs at these.

1. **The link, per host tier**: the transfer path's own copies (:class:`~specmd.executor.transfer.ThreadMover`,
   unthrottled) of 64 KiB .. 32 MiB from host memory (``ram``) and, with the page cache dropped, from a file
   (``disk``); ``latency + nbytes / bandwidth`` fitted by least squares, with a faster rate for a copy's first
   MBs where that fits better (``small_copy_gbps``/``small_copy_mb``: :func:`.fit.fit_link`).
2. **Compute**: the experts' own kernel at four weight sizes and one to 128 rows, fitted as the clock's
   roofline (``peak_tflops``, ``mem_bandwidth_gbps``, ``gemv_bandwidth_gbps`` for one row,
   ``roofline_serial``: :func:`.measure.measure_compute`), the same on the host (``host_*``; equal on a CPU-only
   machine); then the host and the link at once (``host_link_contention``: :func:`.measure.measure_contention`).
3. **Policy decisions** (measured before 4): each built-in eviction, prefetch and miss policy's host time per
   MoE layer call beyond the reference stack's (lru, topk, fetch), timed on the engine
   (``hardware.policy_overhead_us``).
4. **What the roofline does not see**: the model (default: the embedded ``deep_olmoe``) generates greedily
   under ``execution=offload`` -- all resident, at 5% fetching on demand (copies, no predictions), at 5% with
   prefetching, all resident with prefetching (predictions, no copies), and at 5% fetching HQQ copies
   (``miss=fetch_priority``, with lru + topk and with least_stale + score); prefills of 8..448 tokens, then
   decodes -- three times, each in a fresh process (one after another) and a fresh install; each pass's measured
   compute time minus its simulated compute time (the median of the three) is fitted as ``decoder layers *
   layer + tokens * decoder layers * token + experts run * expert + copy jobs issued * issue + experts placed *
   place + predictions * prediction + experts unpacked * unpack`` overheads (non-negative least squares on relative error; the unpack term last,
   on the low-precision stacks' residuals, their policies' decision costs from 3 charged): the costs of eager
   framework calls and of issuing copies that a GPU hides in kernel launches and a CPU does not.

The profile goes to ``DIR/hardware/<name>.yaml``; the default DIR is the user config directory, which
specmd puts on Hydra's search path (``hardware=<name>`` works at once; with ``--out``, add
``hydra.searchpath=[file://DIR]``). ``<name>_disk.yaml`` carries the disk tier's link.

Before it measures (minutes), calibrate checks what it was given (:func:`.command.prepare`): the name is a name
(:func:`.profile.check_name`: no path, no override syntax, not a shipped profile's), DIR is a directory it can write
(:func:`.profile.check_output`), and the model loads here (:func:`.profile.check_model`: offline, a hub model is a DataError at
once). Bad input is a ConfigError. The profiles are written to temporary files beside them and renamed when
complete, together (:func:`specmd.results.write_files`): an interrupted or failed calibrate leaves no
half-written profile, and a full disk keeps what it measured elsewhere, named.

The package: :mod:`.measure` (stages 1-3), :mod:`.fit` (the fits, 4, and the profile's check), :mod:`.profile`
(the name's grammar, the file, the overrides that select it) and :mod:`.command` (the arguments, the stages in
order, the writing); :mod:`.cell` (one timed cell) is also ``specmd fidelity``'s (:mod:`.fidelity`: how far to
trust a calibrated profile, its cells on a grid), which lives here with the measurements it shares.
"""

from .command import calibrate, prepare, run_stages

__all__ = ["calibrate", "main", "prepare"]


def main(argv=None) -> int:
    from ...errors import ArgumentParser

    ap = ArgumentParser(prog="specmd calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write DIR/hardware/<name>.yaml (default: the user config directory, on "
                                  "Hydra's search path)")
    ap.add_argument("--name", help="profile name (default: calibrated_<host>)")
    ap.add_argument("--model", default="deep_olmoe", help="model config the overheads are fitted on")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true", help="link, compute and host experts only (no policy costs, "
                                                           "overhead fit or check)")
    ap.add_argument("--remeasure", action="store_true", help="measure everything anew (default: reuse what an "
                                                               "earlier calibrate of this host, device, torch and "
                                                               "model measured)")
    ap.add_argument("--threads", default="auto", type=_threads,
                    help="compute threads, as execution.threads (default auto: the cores minus one for the copy "
                         "thread); runs at the profile's settings are timed as it was fitted")
    ap.add_argument("--pin", action="store_true", help="pin compute and copy threads to their own cores, as "
                                                       "execution.pin=true")
    a = ap.parse_args(argv)
    # before any measurement; bad input (ConfigError, DataError) is one line and exit 2: specmd.ending
    name, hw_dir = prepare(a.out, a.name, a.model, a.device, a.threads, a.pin)
    run_stages(hw_dir, name, a.out is not None, a.model, a.device, a.quick, print, a.remeasure, a.threads, a.pin)
    return 0


def _threads(text: str):
    """``--threads``: auto, or an integer (checked >= 1 by :func:`.command.check_threads`)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        import argparse

        raise argparse.ArgumentTypeError(f"{text!r}; valid choices: auto, or an integer >= 1") from None
