"""Submitit launchers that run several jobs of a sweep in one task: ``hydra/launcher=specmd_submitit_local``
and ``specmd_submitit_slurm`` (SLURM), each with ``jobs_per_task``.

Hydra's submitit launchers submit one array task per job, so every job pays a process start: the imports,
lm-eval's task index and the model load (several seconds), while a replay job itself takes well under a
second. These launchers split the sweep into ``ceil(jobs / jobs_per_task)`` array tasks and run each task's
jobs one after another in one process (the process, its imports and its caches are shared; each job still
gets its own config, directory and results). Everything else is Hydra's launcher: the queue parameters
(partition, GPUs, time, ``array_parallelism``) are the ``submitit_local`` / ``submitit_slurm`` ones.
"""

from dataclasses import dataclass
from typing import Any, List, Sequence

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus
from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf, SlurmQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher


class _Batched:
    """Runs a batch of ``BaseSubmititLauncher.__call__`` argument tuples in one task, in order."""

    def __init__(self, launcher: BaseSubmititLauncher):
        self.launcher = launcher

    def __call__(self, batch: List[tuple]) -> List[JobReturn]:
        return [self.launcher(*args) for args in batch]

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:  # a preempted task is resubmitted whole;
        import submitit  # its finished jobs are then skipped (specmd resumes them from results.json)

        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)


class _BatchedMixin:
    def __init__(self, jobs_per_task: int = 1, **params: Any) -> None:
        if int(jobs_per_task) < 1:
            raise ValueError(f"hydra.launcher.jobs_per_task={jobs_per_task} must be >= 1")
        self.jobs_per_task = int(jobs_per_task)
        super().__init__(**params)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        import submitit

        executor = self._executor()
        batches = [list(job_overrides[i:i + self.jobs_per_task])
                   for i in range(0, len(job_overrides), self.jobs_per_task)]
        from hydra.core.singleton import Singleton

        state = Singleton.get_state()
        args, idx = [], initial_job_idx
        for batch in batches:
            args.append([(list(o), "hydra.sweep.dir", idx + j, f"job_id_for_{idx + j}", state)
                         for j, o in enumerate(batch)])
            idx += len(batch)
        tasks = executor.map_array(_Batched(self), args)
        out: List[JobReturn] = []
        for task, batch in zip(tasks, args):
            try:  # every task is awaited; a lost one (timeout, OOM kill, node failure) fails its own jobs
                out += task.results()[0]
            except Exception as exc:  # noqa: BLE001 -- reported per job by Hydra's sweeper
                for _ in batch:
                    ret = JobReturn()
                    ret.status = JobStatus.FAILED
                    ret.return_value = exc
                    out.append(ret)
        return out

    def _executor(self):
        """Hydra's ``BaseSubmititLauncher.launch`` up to the submission: the executor with the queue's
        parameters, and the sweep directory."""
        import os
        from pathlib import Path

        import submitit
        from omegaconf import OmegaConf

        from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

        assert self.config is not None
        specific = {"max_num_timeout"}
        init = {"folder": self.params["submitit_folder"],
                **{f"{self._EXECUTOR}_{k}": v for k, v in self.params.items() if k in specific}}
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init)
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{k if k in base else f"{self._EXECUTOR}_{k}": v
                                      for k, v in self.params.items() if k not in specific | {"submitit_folder"}})
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:
            os.chmod(sweep_dir, mode=int(str(self.config.hydra.sweep.mode), 8))
        return executor


class LocalLauncher(_BatchedMixin, BaseSubmititLauncher):
    _EXECUTOR = "local"


class SlurmLauncher(_BatchedMixin, BaseSubmititLauncher):
    _EXECUTOR = "slurm"


@dataclass
class BatchedLocalConf(LocalQueueConf):
    _target_: str = "hydra_plugins.specmd_launchers.batched_submitit.LocalLauncher"
    jobs_per_task: int = 1  # jobs run one after another in each task (one process start per task)


@dataclass
class BatchedSlurmConf(SlurmQueueConf):
    _target_: str = "hydra_plugins.specmd_launchers.batched_submitit.SlurmLauncher"
    jobs_per_task: int = 1


ConfigStore.instance().store(group="hydra/launcher", name="specmd_submitit_local", node=BatchedLocalConf(),
                             provider="specmd")
ConfigStore.instance().store(group="hydra/launcher", name="specmd_submitit_slurm", node=BatchedSlurmConf(),
                             provider="specmd")
