"""A second battery of malformed inputs (none of them in test_bad_inputs.py): non-finite numbers in every kind
of field, degenerate values that would run and report nonsense (a cache that holds no expert, a lookahead past
the last layer, a count above what the model has), unknown or repeated task names, devices specmd does not run
on, and NaN/inf in a trace's router weights and logits. Each is rejected with a message naming the key and
the value, at the stage named, leaving only failed.json in the run directory; a few go through the CLI for
the exit code and the one-line message."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specmd.ending import guarded
from hydra import compose, initialize_config_dir

from specmd import CONF_DIR
from specmd.app import execute
from specmd.errors import ConfigError, DataError

ROOT = Path(__file__).resolve().parent.parent
BASE = ["model=tiny", "eval.tasks=[wikitext]", "eval.limit=1", "eval.max_length=64", "logger=none"]
FINITE = "must be a finite number"


def _jsonl(tmp_path: Path, kind: str) -> str:
    """A 2-sequence, 4-layer routing capture of 16 experts (top-2, weights and 16 logits per record) with one
    bad value on its line 3 (``kind``); Python's json writes NaN and Infinity as JSON's readers accept them."""
    path = tmp_path / f"{kind}.jsonl"
    bad = {"nan_weight": ("weights", [float("nan"), 0.3]), "inf_logit": ("logits", [float("inf")] + [0.0] * 15),
           "neg_inf_weight": ("weights", [0.7, float("-inf")]), "huge_weight": ("weights", [1e6, 0.3]),
           "nan_logit": ("logits", [0.0] * 15 + [float("nan")]), "plain": (None, None)}[kind]
    lines = []
    for seq in range(2):
        for tok in range(3):
            for layer in range(4):
                rec = {"seq": seq, "token": tok, "layer": layer, "experts": [layer, 4 + tok],
                       "weights": [0.7, 0.3], "logits": [float(-abs(e - layer)) for e in range(16)]}
                if bad[0] is None:  # a clean capture without logits
                    del rec["logits"]
                elif len(lines) == 2:
                    rec[bad[0]] = bad[1]
                lines.append(json.dumps(rec))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _fill(override: str, tmp_path: Path) -> str:
    """``{jsonl:<kind>}``: a capture file (:func:`_jsonl`); ``{dir}``: a directory; ``{file}``: a plain file."""
    if "{dir}" in override:
        (tmp_path / "a_dir").mkdir(exist_ok=True)
        return override.replace("{dir}", str(tmp_path / "a_dir"))
    if "{file}" in override:
        (tmp_path / "a_file").write_text("not a directory")
        return override.replace("{file}", str(tmp_path / "a_file"))
    if "{jsonl:" not in override:
        return override
    head, kind = override.split("{jsonl:")
    return head + _jsonl(tmp_path, kind.rstrip("}"))


JSONL = ["replay.format=jsonl", "replay.num_experts=16", "prefetch=none", "hardware.experts_per_layer=2"]

# (overrides, substrings the message must hold, stage)
CASES = [
    # non-finite numbers in the hardware profile: NaN passes every range check (nan < 0 is false)
    (["hardware.latency_us=nan"], ["hardware.latency_us=nan", FINITE], "config"),
    (["hardware.bandwidth_gbps=inf"], ["hardware.bandwidth_gbps=inf", FINITE], "config"),
    (["hardware.peak_tflops=inf"], ["hardware.peak_tflops=inf", FINITE], "config"),
    (["hardware.mem_bandwidth_gbps=nan"], ["hardware.mem_bandwidth_gbps=nan", FINITE], "config"),
    (["hardware.host_tflops=-inf"], ["hardware.host_tflops=-inf", FINITE], "config"),
    (["hardware.host_mem_bandwidth_gbps=inf"], ["hardware.host_mem_bandwidth_gbps=inf", FINITE], "config"),
    (["hardware.capacity=nan"], ["hardware.capacity=nan", FINITE], "config"),
    (["hardware.capacity=inf"], ["hardware.capacity=inf", FINITE], "config"),
    (["hardware.experts_per_layer=nan"], ["hardware.experts_per_layer=nan", FINITE], "config"),
    (["hardware.experts_per_layer=inf"], ["hardware.experts_per_layer=inf", FINITE], "config"),
    (["hardware.layer_overhead_us=nan"], ["hardware.layer_overhead_us=nan", FINITE], "config"),
    (["hardware.transfer_issue_us=-inf"], ["hardware.transfer_issue_us=-inf", FINITE], "config"),
    (["hardware.unpack_overhead_us=inf"], ["hardware.unpack_overhead_us=inf", FINITE], "config"),
    # finite but beyond any device: an exponent typo whose times overflow or vanish
    (["hardware.latency_us=1e308"], ["hardware.latency_us=1e+308", "outside [0, 1e+12] us"], "config"),
    (["hardware.bandwidth_gbps=1e-300"], ["hardware.bandwidth_gbps=1e-300", "outside [1e-15, 1e+15] GB/s"],
     "config"),
    (["hardware.peak_tflops=1e308"], ["hardware.peak_tflops=1e+308", "TFLOP/s"], "config"),
    # ... in policy parameters
    (["prefetch=topk", "prefetch.overfetch=nan"], ["prefetch=topk: overfetch=nan", FINITE], "config"),
    (["prefetch=topk", "prefetch.overfetch=inf"], ["prefetch=topk: overfetch=inf", FINITE], "config"),
    (["prefetch=lookahead", "prefetch.overfetch=-inf"], ["overfetch=-inf", FINITE], "config"),
    (["prefetch=score", "prefetch.percentile=nan"], ["prefetch=score: percentile=nan", FINITE], "config"),
    (["routing=cumsum", "routing.p=nan"], ["routing=cumsum: p=nan", FINITE], "config"),
    (["routing=cache_prior", "routing.lambda=inf"], ["lambda=inf", FINITE], "config"),
    (["miss=substitute", "miss.alpha=nan"], ["miss=substitute: alpha=nan", FINITE], "config"),
    (["miss=fetch_priority", "miss.percentile=nan"], ["miss=fetch_priority: percentile=nan", FINITE], "config"),
    (["miss=drop_priority_cascade", "miss.percentile=-inf"], ["percentile=-inf", FINITE], "config"),
    (["eviction=lecar", "eviction.learning_rate=nan"], ["learning_rate=nan", FINITE], "config"),
    (["eviction=lecar", "eviction.lru_weight=inf"], ["lru_weight=inf", FINITE], "config"),
    # ... and in the other sections, where a float is no valid integer either
    (["eval.limit=nan"], ["eval.limit=nan", FINITE], "config"),
    (["eval.limit=inf"], ["eval.limit=inf", FINITE], "config"),
    (["eval.max_gen_toks=inf"], ["eval.max_gen_toks=inf", "an integer"], "config"),
    (["model.seed=nan"], ["model.seed=nan", "an integer"], "config"),
    (["quant=hqq", "quant.group_size=nan"], ["group_size=nan", "an integer"], "config"),
    (["replay.reuse_horizon=nan"], ["replay.reuse_horizon=nan", "an integer or null"], "config"),
    # task lists: an unknown name is never dropped, a repeated one never merged
    (["eval.tasks=[wikitext,wikitext2]"], ["wikitext2", "wikitext, mmlu, gsm8k"], "config"),
    (["eval.tasks=[gsm8k,foo,bar]"], ["['foo', 'bar']", "wikitext, mmlu, gsm8k"], "config"),
    (["eval.tasks=[wikitext,wikitext]"], ["eval.tasks", "['wikitext'] twice"], "config"),
    (["eval.tasks=[wikitext,3]"], ["eval.tasks[1]=3", "a string"], "config"),
    # devices: torch knows them, specmd does not run on them
    (["device=meta"], ["device=meta", "no data", "cpu, cuda, cuda:N, mps"], "config"),
    (["device=xla"], ["device=xla", "not xla"], "config"),
    (["device=cpu:3"], ["device=cpu:3", "one CPU device"], "config"),
    (["device=cuda:-1"], ["device='cuda:-1'", "not a torch device"], "config"),
    (["device=CPU"], ["device='CPU'", "cpu, cuda"], "config"),
    # degenerate values bounded by the model, checked as soon as its geometry is known (tiny: 4 MoE
    # layers, 64 experts of 147,456 bytes, top-8): a policy's settings from the model's config, before any
    # weight loads (issue 57: stage config), the cache's sizes once the stack is built
    (["hardware.capacity=1e-12"], ["hardware.capacity=1e-12", "0 bytes", "less than one expert",
                                   "native precision (147,456 bytes", "smallest capacity"], "stack"),
    (["hardware.capacity=0.001", "hardware.scope=per_layer"],
     ["hardware.capacity=0.001", "each of the 4 per-layer pools", "with scope=per_layer"], "stack"),
    pytest.param(["miss=fetch_priority", "hardware.capacity=1e-7"], ["hardware.capacity=1e-07", "at int2 precision"],
                 "stack", marks=pytest.mark.slow),  # (5.5 s of quantization; test_rounding pins the precision rule)
    (["hardware.experts_per_layer=0.005"], ["hardware.experts_per_layer=0.005", "rounds to 0 slots",
                                            "0.007812"], "stack"),
    (["prefetch=lookahead", "prefetch.depth=1000"], ["prefetch=lookahead: depth=1000", "at most 3"], "config"),
    (["prefetch=topk", "prefetch.overfetch=9"], ["prefetch=topk: overfetch=9", "72 experts", "at most 8"],
     "config"),
    (["routing=prune", "routing.h=9"], ["routing=prune: h=9", "top-k 8"], "config"),
    (["routing=replace_rank", "routing.rank=8"], ["routing=replace_rank: rank=8", "ranks 0..7"], "config"),
    (["prefetch=lookahead", "prefetch.overfetch=8.5"], ["prefetch=lookahead: overfetch=8.5", "68 experts"], "config"),
    (["miss=drop", "miss.J=9"], ["miss.J=9", "0..8"], "config"),
    (["trace.save=true", "trace.depth=4"], ["trace.depth=4", "at most 3"], "stack"),
    # found by a fresh battery: state that would not fit in memory, overflowing weights, a random model that
    # is no MoE model, empty strings for paths, settings a replay cannot honour
    (["eviction=score", "eviction.n=1000000000"], ["eviction=score: n=1000000000 needs", "GiB", "memory"], "config"),
    (["prefetch=score", "prefetch.window=1000000000"], ["prefetch=score: window=1000000000 needs", "GiB"], "config"),
    (["eviction=lecar", "eviction.learning_rate=1e308"], ["learning_rate=1e+308", "[0, 700]"], "config"),
    (["hardware.policy_overhead_us={prefetch/topk: true}"], ["policy_overhead_us['prefetch/topk']=True"], "config"),
    (["model=tiny_olmoe", "+model.tiny.num_experts=0"], ["0 experts per MoE layer", "model.tiny"], "config"),
    (["model=tiny_olmoe", "+model.tiny.hidden_size=nan"], ["model.tiny.hidden_size=nan", FINITE], "config"),
    (["model=tiny_olmoe", "+model.tiny.num_experts_per_tok=100"], ["top-k 100 must be in 1..64"], "config"),
    (["model=tiny_olmoe", "+model.tiny.num_hidden_layers=0"], ["no MoE layers found", "0 decoder layers"], "config"),
    (["model=tiny_olmoe", "+model.tiny.bogus_key=1"], ["model.tiny: unknown key(s) ['bogus_key']", "num_experts"],
     "config"),
    (["+model.tiny.num_experts=8"], ["model.pretrained=specmd:tiny-olmoe loads a checkpoint"], "config"),
    (["eval.seed=-1"], ["eval.seed=-1", "0..4294967295"], "config"),
    (["quant=hqq", "quant.precisions=[]"], ["precisions=[] stores no quantized copy"], "config"),
    (["quant=hqq", "quant.precisions=[int8,int8]"], ["['int8'] twice"], "config"),
    (["hardware.timing_as=''"], ["hardware.timing_as='' is empty"], "config"),
    (["model.pretrained=''"], ["model.pretrained='' is empty"], "config"),
    (["trace.save=true", "replay.trace={jsonl:nan_weight}", *JSONL], ["trace.save=true records a live run"],
     "config"),
    (["replay.trace={jsonl:plain}", "replay.format=jsonl", "replay.num_experts=2000000"],
     ["replay.num_experts=2000000 must be in 1..1,048,576"], "replay"),
    (["replay.trace={dir}", "replay.format=jsonl"], ["with replay.format=jsonl: a directory"], "replay"),
    (["replay.trace=record", "replay.cache={file}"], ["is a file, not a directory"], "replay"),
    (["eval.num_fewshot=100000"], ["eval.num_fewshot=100000", "fewer few-shot examples"], "evaluate"),
    (["logger=wandb", "logger.tags=[[a]]"], ["logger.tags=[['a']]", "a list of strings"], "config"),
    (["logger=wandb", "logger.init_timeout_s=inf"], ["logger.init_timeout_s=inf", "finite number of seconds"],
     "config"),
    (["logger=wandb", "logger.project=''"], ["logger.project=''", "non-empty string"], "config"),
    # trace files: NaN and inf router weights and logits, named by file and line
    (["replay.trace={jsonl:nan_weight}", *JSONL], ["nan_weight.jsonl, line 3", "router weight nan",
                                                    "not a finite number"], "replay"),
    (["replay.trace={jsonl:neg_inf_weight}", *JSONL], ["line 3", "router weight -inf"], "replay"),
    (["replay.trace={jsonl:huge_weight}", *JSONL], ["line 3", "router weight 1000000.0", "float16"], "replay"),
    (["replay.trace={jsonl:inf_logit}", *JSONL], ["inf_logit.jsonl, line 3", "router logit inf"], "replay"),
    (["replay.trace={jsonl:nan_logit}", *JSONL], ["line 3", "router logit nan"], "replay"),
]


@pytest.mark.parametrize("overrides,needles,stage", CASES,
                         ids=[" ".join(getattr(c, "values", c)[0]) for c in CASES])
def test_bad_number_rejected_with_a_clear_message(overrides, needles, stage, tmp_path, mirror, monkeypatch):
    monkeypatch.setenv("SPECMD_DATA_MIRROR", str(mirror))
    if stage == "config":  # found before any model work: a loader that fails the test proves it
        import specmd.models.loader as loader

        def no_load(*a, **k):
            raise AssertionError("the model was loaded for a config error")

        monkeypatch.setattr(loader, "load_model", no_load)
    overrides = [_fill(o, tmp_path) for o in overrides]
    run_dir = tmp_path / "run"
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*BASE, *overrides])
    with pytest.raises((ConfigError, DataError)) as exc:
        execute(cfg, run_dir=str(run_dir), overrides=overrides)
    msg = str(exc.value)
    assert all(n in msg for n in needles), msg
    assert sorted(p.name for p in run_dir.iterdir()) == ["failed.json"]
    failed = json.loads((run_dir / "failed.json").read_text())
    assert failed["stage"] == stage, failed["stage"]
    assert failed["kind"] == "config" and msg in failed["error"]
    assert "traceback" not in failed  # the user's input, not a bug


def _cli(args: list, cwd: Path, mirror: Path, inject: str = "pass") -> subprocess.CompletedProcess:
    """``python -m specmd BASE args`` (``inject``: Python run first in the process, to plant a fault)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPECMD_DATA_MIRROR": str(mirror)}
    env.pop("HYDRA_FULL_ERROR", None)
    code = f"import sys; {inject}; from specmd.__main__ import main; sys.argv[0] = 'specmd'; main()"
    return subprocess.run([sys.executable, "-c", code, *BASE, *args, f"hydra.run.dir={cwd / 'run'}"],
                          capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


@pytest.mark.parametrize("args,needle,code,stage", [
    # (the config-stage ones: 7 s, slow; a config error through the CLI stays in the default run with brackets)
    pytest.param(["device=meta"], "device=meta", 2, "config", marks=pytest.mark.slow),
    pytest.param(["hardware.latency_us=nan"], "hardware.latency_us=nan", 2, "config", marks=pytest.mark.slow),
    (["hardware.capacity=1e-12"], "less than one expert", 2, "stack"),
])
def test_the_cli_prints_one_line_and_exits_with_its_code(args, needle, code, stage, tmp_path, mirror):
    r = _cli(args, tmp_path, mirror)
    assert r.returncode == code, r.stderr
    assert "Traceback" not in r.stderr and needle in r.stderr, r.stderr
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name not in (".hydra", "__main__.log")) == \
        ["failed.json"]  # (Hydra's own: the composed config and the log)
    assert json.loads((tmp_path / "run" / "failed.json").read_text())["stage"] == stage


def test_an_unexpected_error_is_one_line_with_the_traceback_in_failed_json(tmp_path, mirror):
    """A failure that is not the user's input (a fault planted in the evaluation) exits 1 with one line naming
    the stage and the error; failed.json keeps the traceback."""
    plant = ("import specmd.eval.harness as h\n"
             "def evaluate(*a, **k): raise FloatingPointError('planted: the logits went NaN')\n"
             "h.evaluate = evaluate")
    r = _cli([], tmp_path, mirror, inject=f"exec({plant!r})")
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert "in stage evaluate: FloatingPointError: planted: the logits went NaN" in r.stderr, r.stderr
    failed = json.loads((tmp_path / "run" / "failed.json").read_text())
    assert failed["kind"] == "error" and failed["stage"] == "evaluate"
    assert failed["traceback"].startswith("Traceback (most recent call last)") and "planted" in failed["traceback"]
    assert not (tmp_path / "run" / "results.json").exists()


def test_threads_beyond_the_cores_are_capped_with_a_warning(tmp_path, mirror, monkeypatch, caplog):
    """threads=100000 made torch crash (SIGSEGV, no failed.json): it is capped at the cores this process may
    use, with a warning, before torch sees it (threads is a resource, not part of the config hash)."""
    import torch

    from specmd.app import Run
    from specmd.jobs import usable_cores

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*BASE, "threads=100000"])
    before = torch.get_num_threads()
    with caplog.at_level("WARNING", logger="specmd"):
        run = Run(cfg)
    assert run.threads == usable_cores()
    assert "threads=100000 is more than the" in caplog.text and f"capped at {usable_cores()}" in caplog.text
    assert torch.get_num_threads() == before  # validation never touches torch
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        assert Run(compose(config_name="config", overrides=[*BASE, f"threads={usable_cores()}"])).threads == \
            usable_cores()


def test_a_specmd_trace_with_a_nan_logit_is_rejected_naming_its_row(tmp_path):
    import numpy as np

    from specmd.replay.trace import check_finite_rows

    a = np.zeros((200_000, 4), dtype=np.float32)
    check_finite_rows(a, "logits.bin", chunk=1 << 16)
    a[150_001, 2] = np.nan  # in the third chunk
    with pytest.raises(ConfigError, match=r"logits.bin: row 150001 holds a value that is not a finite number \(nan\)"):
        check_finite_rows(a, "logits.bin", chunk=1 << 16)
    b = np.zeros((10, 2, 4), dtype=np.float16)
    b[3, 1, 0] = np.inf
    with pytest.raises(ConfigError, match=r"row 3 .*\(inf\)"):
        check_finite_rows(b, "signal_logits.bin")


def test_a_figure_that_is_not_finite_fails_the_run_instead_of_writing_null(tmp_path, mirror, monkeypatch):
    """results.json writes a non-finite float as null (not measured): a figure specmd computed that is NaN or inf
    (a numeric bug; the hardware ranges keep the clock's own arithmetic finite) fails the run at the write
    stage naming the figure, and leaves only failed.json."""
    import specmd.app as app
    from specmd.checks import NumericError

    monkeypatch.setenv("SPECMD_DATA_MIRROR", str(mirror))
    real = app.collect

    def collect(*a, **k):  # plant a NaN where the clock's figures go
        out = real(*a, **k)
        out["timing"]["ttft_s"] = float("nan")
        return out

    monkeypatch.setattr(app, "collect", collect)
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=BASE)
    with pytest.raises(NumericError, match=r"timing.ttft_s=nan: a figure specmd computed is not a finite number"):
        execute(cfg, run_dir=str(tmp_path / "run"))
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["failed.json"]
    failed = json.loads((tmp_path / "run" / "failed.json").read_text())
    assert failed["stage"] == "write" and failed["kind"] == "error" and "NumericError" in failed["error"]


def test_specmd_mrc_rejects_repeated_or_non_finite_points_and_unknown_policies():
    from specmd.commands.mrc import parse

    trace = "replay.trace=/nonexistent"  # parse checks the arguments only
    with pytest.raises(ConfigError, match=r"mrc.capacities: \[nan\] must be fractions"):
        parse([trace, "mrc.capacities=[0.1,nan]"])
    with pytest.raises(ConfigError, match=r"mrc.capacities lists \[0.5\] twice"):
        parse([trace, "mrc.capacities=[0.5,0.5]"])
    with pytest.raises(ConfigError, match=r"eviction lists \['lru'\] twice"):
        parse([trace, "eviction=[lru,lru]"])
    with pytest.raises(ConfigError, match=r"eviction: unknown policy\(s\) \['warp'\]; valid choices: arc, belady"):
        parse([trace, "eviction=[lru,warp]"])


def test_a_sweep_directory_whose_multirun_yaml_is_garbage_is_a_clear_error(tmp_path):
    from specmd.sweeps import load_sweep

    (tmp_path / "multirun.yaml").write_bytes(bytes(range(256)) * 2)
    with pytest.raises(ConfigError, match="its multirun.yaml or .hydra files cannot be read as a Hydra sweep"):
        load_sweep(tmp_path)


def test_a_decode_only_measure_on_a_trace_without_decode_passes_is_an_error():
    from tests.replay.test_replay import flat_trace

    from specmd.compose import spec_of
    from specmd.replay.driver import check

    trace = flat_trace([0, 1, 2, 1, 0], num_experts=4)
    check(trace, spec_of(prefetch="none", measure="decode"))  # it has decode passes
    trace.passes[:, 0] = 0  # prefill only
    with pytest.raises(ConfigError, match="stack.measure=decode counts decode passes only, and the trace .* has none"):
        check(trace, spec_of(prefetch="none", measure="decode"))


def test_the_cli_prints_a_message_with_brackets_as_it_is(tmp_path, mirror):
    """The one-line error goes through rich, whose markup would eat ``[tokens, layers, k]``: it is escaped."""
    import numpy as np

    np.save(tmp_path / "floats.npy", np.zeros((2, 2)))
    r = _cli([f"replay.trace={tmp_path / 'floats.npy'}", "replay.format=npy", "replay.num_experts=8"], tmp_path,
             mirror)
    assert r.returncode == 2, r.stderr
    assert "expected an integer array [tokens, layers, k], got shape (2, 2)" in r.stderr, r.stderr


def test_a_sweep_whose_launcher_would_run_no_job_is_one_line_and_exit_2(tmp_path, mirror):
    """joblib's n_jobs=0 failed inside the launcher with a traceback: the sweep's start callback rejects it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPECMD_DATA_MIRROR": str(mirror)}
    r = subprocess.run([sys.executable, "-m", "specmd", "-m", *BASE, "hydra/launcher=specmd_joblib",
                        "hydra.launcher.n_jobs=0", "eviction=lru,fifo", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "hydra.launcher.n_jobs=0 runs no job" in r.stderr, r.stderr


def test_calibrate_rejects_an_unknown_model_on_stderr_before_measuring(capsys):
    from specmd.commands.calibrate import main

    assert guarded("specmd calibrate", main, ["--model", "gpt9", "--quick"]) == 2
    out = capsys.readouterr()
    assert "--model 'gpt9': no such model config; valid choices: deep_mixtral, deep_olmoe" in out.err and not out.out
