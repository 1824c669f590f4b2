"""``python -m specmd [overrides]`` and ``python -m specmd -m ...`` (Hydra multirun)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from . import CONF_DIR
from .jobs import SWEEP_EXIT, Interrupted, torch_threads


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def _hydra_main(cfg: DictConfig):
    from hydra.core.hydra_config import HydraConfig
    from rich.console import Console
    from rich.markup import escape

    from .app import JobRunning, execute
    from .errors import ConfigError, DataError
    from .summary import print_summary

    hc = HydraConfig.get()
    run_dir = hc.runtime.output_dir
    multirun = hc.mode.name == "MULTIRUN"
    # a multirun's runs share a W&B group: its sweep directory's last two parts (<date>/<time> by default)
    group = "/".join(Path(hc.sweep.dir).parts[-2:]) if multirun else None
    err = Console(stderr=True)
    try:
        # a sweep's job resumes: done with this config -> not run again (specmd.jobs)
        results = execute(cfg, run_dir=run_dir, group=group, resume=multirun, overrides=list(hc.overrides.task),
                          threads=torch_threads(None, OmegaConf.to_container(hc.launcher, resolve=True)))
    except JobRunning as exc:
        err.print(f"[yellow]specmd: skipped:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return None
    except (ConfigError, DataError) as exc:  # failed.json is written; one clear line, no traceback
        err.print(f"[bold red]specmd: error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        if not multirun:
            raise SystemExit(2)
        return None  # one bad job fails itself, not the sweep (SweepEnd sets the exit code)
    except Exception as exc:  # model load, quantization, evaluation: failed.json names the stage, keeps the traceback
        if os.environ.get("HYDRA_FULL_ERROR") == "1":  # Hydra's own switch for the full trace
            raise
        stage = _failed_stage(run_dir)
        err.print(f"[bold red]specmd: {'job failed' if multirun else 'error'}[/] in stage {stage}: "
                  f"{type(exc).__name__}: {escape(str(exc))}", highlight=False, soft_wrap=True)
        err.print(f"  the traceback is in {run_dir}/failed.json (HYDRA_FULL_ERROR=1 prints it)"
                  + ("; the sweep goes on" if multirun else ""), markup=False, highlight=False, soft_wrap=True)
        if not multirun:
            raise SystemExit(1)
        return None
    if results.get("resumed"):
        Console().print(f"specmd: done already, not run again: {run_dir}/results.json (same config hash)",
                        highlight=False, soft_wrap=True)
    else:
        print_summary(results, run_dir, Console())
    return results.get("cache", {}) and results["cache"].get("hit_rate")


def _failed_stage(run_dir: str) -> str:
    """The stage ``failed.json`` names (``?`` when the failure came before it could be written)."""
    import json

    try:
        return json.loads((Path(run_dir) / "failed.json").read_text())["stage"]
    except (OSError, ValueError, KeyError):
        return "?"


def main() -> None:
    """``specmd [overrides]`` runs like ``python -m specmd``; ``specmd mrc ...`` computes miss-ratio curves;
    ``specmd report ...`` writes the tables and figures of sweeps (:mod:`specmd.report`); ``specmd tune ...``
    finds the best stack under a quality budget (:mod:`specmd.tune`)."""
    if len(sys.argv) > 1 and sys.argv[1] == "mrc":
        from .replay.mrc import main as mrc

        sys.exit(mrc(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "report":
        from .report import main as report

        sys.exit(report(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "calibrate":
        from .calibrate import main as calibrate

        sys.exit(calibrate(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "tune":
        from .tune import main as tune

        sys.exit(tune(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "status":
        from .report.status import main as status

        sys.exit(status(sys.argv[2:]))
    try:
        _hydra_main()
    except Interrupted as exc:  # failed.json of the running job names the stage and the signal
        print(f"specmd: {exc}", file=sys.stderr)
        sys.exit(128 + exc.signum)
    sys.exit(SWEEP_EXIT["code"])


if __name__ == "__main__":
    main()
