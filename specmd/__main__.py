"""``python -m specmd [overrides]`` and ``python -m specmd -m ...`` (Hydra multirun)."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from . import CONF_DIR

_FAILED: list = []  # run dirs of the jobs of this multirun that failed on a config or data error


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def _hydra_main(cfg: DictConfig):
    from hydra.core.hydra_config import HydraConfig
    from rich.console import Console

    from .app import execute
    from .errors import ConfigError, DataError
    from .summary import print_summary

    hc = HydraConfig.get()
    run_dir = hc.runtime.output_dir
    multirun = hc.mode.name == "MULTIRUN"
    # a multirun's runs share a W&B group: its sweep directory's last two parts (<date>/<time> by default)
    group = "/".join(Path(hc.sweep.dir).parts[-2:]) if multirun else None
    console = Console(stderr=False)
    try:
        results = execute(cfg, run_dir=run_dir, group=group)
    except (ConfigError, DataError) as exc:
        Console(stderr=True).print(f"[bold red]specmd: error:[/] {exc}", highlight=False, soft_wrap=True)
        if not (Path(run_dir) / "failed.json").exists():  # a config error, found before any model work
            from omegaconf import OmegaConf

            from .results import write_json_atomic

            write_json_atomic(Path(run_dir) / "failed.json", {
                "config": OmegaConf.to_container(cfg, resolve=False), "stage": "config",
                "error": f"{type(exc).__name__}: {exc}"})
        if not multirun:
            raise SystemExit(2)
        # one bad job fails itself, not the sweep: the others run, and the sweep exits 2 at the end
        _FAILED.append(run_dir)
        return None
    print_summary(results, run_dir, console)
    return results.get("cache", {}) and results["cache"].get("hit_rate")


def main() -> None:
    """``specmd [overrides]`` runs like ``python -m specmd``; ``specmd mrc ...`` computes miss-ratio curves;
    ``specmd report ...`` writes the tables and figures of sweeps (:mod:`specmd.report`)."""
    if len(sys.argv) > 1 and sys.argv[1] == "mrc":
        from .replay.mrc import main as mrc

        sys.exit(mrc(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "report":
        from .report import main as report

        sys.exit(report(sys.argv[2:]))
    _hydra_main()
    if _FAILED:
        print(f"specmd: {len(_FAILED)} job(s) of the sweep failed (failed.json in each): {', '.join(_FAILED)}",
              file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
