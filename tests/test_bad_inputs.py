"""A battery of malformed inputs: each is rejected with a message naming the bad value (and the valid choices
where there is a list), before any model work where the value does not depend on the model, and leaves
nothing in its run directory but failed.json (stage and error)."""

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from specmd import CONF_DIR
from specmd.app import execute
from specmd.errors import ConfigError, DataError

BASE = ["model=tiny", "eval.tasks=[wikitext]", "eval.limit=1", "eval.max_length=64", "logger=none"]


def _ckpt(tmp_path: Path, kind: str) -> str:
    d = tmp_path / f"ckpt_{kind}"
    d.mkdir()
    if kind == "corrupt_config":
        (d / "config.json").write_text('{"model_type": "olmoe", ')
    if kind == "corrupt_weights":
        from specmd.models.loader import tiny_config

        tiny_config("olmoe").save_pretrained(d)
        (d / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    if kind == "zaya":  # a family specmd does not run; garbage weights: refused before any is read
        from transformers import AutoConfig

        AutoConfig.for_model("zaya").save_pretrained(d)
        (d / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    if kind == "no_model_type":
        (d / "config.json").write_text('{"hidden_size": 64}')
    return str(d)


def _with_ckpt(override: str, tmp_path: Path) -> str:
    if "{ckpt:" not in override:
        return override
    head, kind = override.split("{ckpt:")
    return head + _ckpt(tmp_path, kind.rstrip("}"))


# (overrides, substrings the message must hold, stage); "{ckpt:<kind>}" is replaced by a checkpoint directory
CASES = [
    # hardware
    (["hardware.capacity=0"], ["hardware.capacity=0", "(0, 1]"], "config"),
    (["hardware.capacity=1.5"], ["hardware.capacity=1.5", "(0, 1]"], "config"),
    (["hardware.capacity=-0.1"], ["hardware.capacity=-0.1"], "config"),
    (["hardware.capacity=lots"], ["hardware.capacity", "lots"], "config"),
    (["hardware.experts_per_layer=1.5"], ["hardware.experts_per_layer=1.5", "whole number"], "config"),
    (["hardware.experts_per_layer=0"], ["hardware.experts_per_layer=0"], "config"),
    (["hardware.experts_per_layer=-2"], ["hardware.experts_per_layer=-2"], "config"),
    # (bounded by the model: checked from its config before any weight loads, issue 57)
    (["hardware.experts_per_layer=1000"], ["hardware.experts_per_layer=1000", "experts per layer"], "config"),
    (["routing=piggyback", "routing.k0=1000000"], ["k0=1000000", "top-k 8"], "config"),
    (["routing=budget", "routing.max_experts=1000000000000"], ["max_experts=1000000000000"], "config"),
    (["hardware.scope=diagonal"], ["diagonal", "global, per_layer"], "config"),
    (["hardware.bandwidth_gbps=0"], ["hardware.bandwidth_gbps=0", "positive"], "config"),
    (["hardware.bandwidth_gbps=-2"], ["hardware.bandwidth_gbps=-2", "positive"], "config"),
    (["hardware.latency_us=-1"], ["hardware.latency_us=-1"], "config"),
    (["hardware.peak_tflops=0"], ["hardware.peak_tflops=0"], "config"),
    (["hardware.mem_bandwidth_gbps=-5"], ["hardware.mem_bandwidth_gbps=-5"], "config"),
    (["hardware.host_tflops=0"], ["hardware.host_tflops=0"], "config"),
    (["hardware.timing_as=gpt9"], ["gpt9", "olmoe"], None),
    # routing (J is checked against the model's top-k as soon as the geometry is known)
    (["routing=cumsum", "routing.J=-1"], ["routing.J=-1"], "config"),
    (["routing=cumsum", "routing.J=99"], ["routing.J=99", "top-k"], "config"),
    (["routing=cumsum", "routing.p=1.5"], ["p=1.5"], "config"),
    (["routing=cache_prior", "routing.lambda=-0.5"], ["lambda"], "config"),
    (["routing=prune", "routing.h=-1"], ["h=-1"], "config"),
    (["routing=max_rank", "routing.M=-1"], ["M=-1"], "config"),
    (["routing=nope"], ["routing/nope", "standard"], "compose"),
    # miss handling and precisions (before the model loads)
    (["miss.precision=int9"], ["int9", "int8"], "config"),
    (["miss=fetch_priority", "miss.precisions=int4:8"], ["int4:8"], "config"),
    (["miss=fetch_priority", "miss.precisions=int9:4"], ["int9"], "config"),
    (["miss=fetch_priority", "miss.percentile=150"], ["percentile=150"], "config"),
    (["miss=drop", "miss.J=-1"], ["miss=drop", "J=-1"], "config"),
    (["miss=substitute", "miss.alpha=-1"], ["alpha=-1"], "config"),
    (["miss=fetch_priority", "quant=none"], ["quant=none", "int8"], "config"),
    (["quant=hqq", "quant.precisions=[int9]"], ["int9"], "config"),
    (["quant=hqq", "quant.group_size=0"], ["group_size=0"], "config"),
    (["miss=warp"], ["miss/warp", "fetch"], "compose"),
    # eviction and prefetch
    (["eviction=belady"], ["belady", "trace"], "config"),
    (["prefetch=oracle"], ["oracle", "trace"], "config"),
    (["eviction=ml", "eviction.weights=/nonexistent/ml.safetensors"], ["/nonexistent/ml.safetensors"], "config"),
    (["model=tiny_mixtral", "eviction=ml"], ["eviction=ml", "ships none", "specmd train-eviction"], "config"),
    (["model=olmoe", "eviction=ml"], ["allenai/OLMoE-1B-7B-0924", "not found"], "config"),
    (["eviction=score", "eviction.n=0"], ["n=0"], "config"),
    (["eviction=score", "eviction.unit=fortnight"], ["fortnight"], "config"),
    (["eviction=fld", "eviction.distance=sideways"], ["sideways"], "config"),
    (["eviction=lecar", "eviction.learning_rate=-1"], ["learning_rate=-1"], "config"),
    (["eviction=least_stale", "eviction.order=random"], ["random", "left_then_right"], "config"),
    (["prefetch=topk", "prefetch.overfetch=-1"], ["overfetch=-1"], "config"),
    (["prefetch=score", "prefetch.percentile=150"], ["percentile=150"], "config"),
    (["prefetch=score", "prefetch.window=0"], ["window=0"], "config"),
    (["prefetch=lookahead", "prefetch.depth=0"], ["depth=0"], "config"),
    (["+prefetch.lookahead=3"], ["lookahead", "overfetch"], "config"),
    # eval
    (["eval.limit=0"], ["eval.limit=0"], "config"),
    (["eval.limit=-1"], ["eval.limit=-1"], "config"),
    (["eval.limit=1.5"], ["eval.limit=1.5"], "config"),
    (["eval.batch_size=0"], ["eval.batch_size=0"], "config"),
    (["eval.max_length=0"], ["eval.max_length=0"], "config"),
    (["eval.max_length=1"], ["eval.max_length=1"], "config"),
    (["eval.max_length=-5"], ["eval.max_length=-5"], "config"),
    (["eval.max_gen_toks=0"], ["eval.max_gen_toks=0"], "config"),
    (["eval.num_fewshot=-1"], ["eval.num_fewshot=-1"], "config"),
    (["eval.tasks=wikitext"], ["eval.tasks", "list"], "config"),
    (["eval.tasks=[wikitxt]"], ["wikitxt", "wikitext, mmlu"], "config"),
    (["eval.seed=abc"], ["eval.seed", "abc"], "config"),
    (["eval.token_by_token=maybe"], ["eval.token_by_token", "maybe"], "config"),
    # stack and trace
    (["stack.enabled=maybe"], ["stack.enabled", "maybe"], "config"),
    (["stack.measure=sometimes"], ["sometimes", "all"], "config"),
    (["stack.measure=decode"], ["stack.measure=decode", "gsm8k"], "config"),
    (["trace.save=notabool"], ["trace.save", "notabool"], "config"),
    (["trace.depth=-1"], ["trace.depth=-1"], "config"),
    (["trace.logits=fp8"], ["fp8", "fp32"], "config"),
    # model, device, threads
    (["model.family=gpt2", "eval.tasks=[]"], ["gpt2", "olmoe"], "config"),
    (["model.dtype=float8"], ["float8", "float32"], "config"),
    (["model.pretrained=/nonexistent/ckpt"], ["/nonexistent/ckpt", "no such directory"], "config"),
    (["model.pretrained=./missing_ckpt"], ["./missing_ckpt", "no such directory"], "config"),
    (["model.pretrained={ckpt:empty}"], ["config.json", "not found"], "config"),
    (["model.pretrained={ckpt:corrupt_config}"], ["config.json", "not valid JSON"], "config"),
    (["model.pretrained={ckpt:corrupt_weights}"], ["ckpt_corrupt_weights"], "load"),
    (["model.pretrained=specmd:nope"], ["specmd:nope", "deep-olmoe"], "config"),
    # the family from config.json, before any weight loads (issue 55: refused only after a full load)
    (["model=hf", "model.pretrained={ckpt:zaya}"], ["'zaya' model", "does not run", "returns 4 value(s)",
                                                      "deepseek_v3"], "config"),
    (["model=deepseek_v3", "model.pretrained={ckpt:corrupt_weights}"],
     ["'olmoe' model", "model.family='deepseek_v3'", "model=hf"], "config"),
    (["model=hf", "model.pretrained={ckpt:no_model_type}"], ["names no model_type"], "config"),
    (["model=hf"], ["model.family=auto", "model.pretrained"], "config"),
    (["device=cuda"], ["device=cuda", "no CUDA"], "config"),
    (["device=cuda:3"], ["device=cuda:3"], "config"),
    (["device=tpu9"], ["tpu9", "cpu"], "config"),
    (["threads=0"], ["threads=0"], "config"),
    (["threads=many"], ["threads", "many"], "config"),
    # replay
    (["replay.trace=/nonexistent/trace"], ["/nonexistent/trace"], None),
    (["replay.trace=/tmp", "replay.format=xml"], ["xml", "specmd"], "config"),
    (["replay.reuse_horizon=-1"], ["reuse_horizon=-1"], "config"),
    # several at once
    (["hardware.capacity=2", "eval.limit=0", "trace.logits=fp8"], ["3 config errors", "hardware.capacity=2",
                                                                   "eval.limit=0", "fp8"], "config"),
]


@pytest.mark.parametrize("overrides,needles,stage", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_input_rejected_with_a_clear_message(overrides, needles, stage, tmp_path, mirror, monkeypatch):
    monkeypatch.setenv("SPECMD_DATA_MIRROR", str(mirror))
    if stage == "config" and not any("{ckpt:" in o for o in overrides):  # found before any model work: a
        import specmd.models.loader as loader  # loader that fails the test proves it

        def no_load(*a, **k):
            raise AssertionError("the model was loaded for a config error")

        monkeypatch.setattr(loader, "load_model", no_load)
    overrides = [_with_ckpt(o, tmp_path) for o in overrides]
    run_dir = tmp_path / "run"
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        if stage == "compose":  # an unknown option of a group: Hydra's own error, with the choices
            from hydra.errors import MissingConfigException

            with pytest.raises(MissingConfigException) as exc:
                compose(config_name="config", overrides=[*BASE, *overrides])
            msg = str(exc.value) + " " + " ".join(getattr(exc.value, "options", None) or [])
            assert all(n in msg for n in needles), msg
            return
        cfg = compose(config_name="config", overrides=[*BASE, *overrides])
    with pytest.raises((ConfigError, DataError)) as exc:
        execute(cfg, run_dir=str(run_dir), overrides=overrides)
    msg = str(exc.value)
    assert all(n in msg for n in needles), msg
    assert "Traceback" not in msg
    assert sorted(p.name for p in run_dir.iterdir()) == ["failed.json"]
    failed = json.loads((run_dir / "failed.json").read_text())
    assert failed["error"].endswith(msg.splitlines()[-1]) or msg.splitlines()[0] in failed["error"]
    if stage is not None:
        assert failed["stage"] == stage, failed["stage"]
    else:
        assert failed["stage"] in ("config", "replay", "stack"), failed["stage"]


def test_capacity_and_experts_per_layer_are_mutually_exclusive(tmp_path, mirror, monkeypatch):
    monkeypatch.setenv("SPECMD_DATA_MIRROR", str(mirror))
    ov = ["hardware.capacity=0.1", "hardware.experts_per_layer=4"]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*BASE, *ov])
    with pytest.raises(ConfigError, match="mutually exclusive"):
        execute(cfg, run_dir=str(tmp_path / "run"), overrides=ov)
    assert json.loads((tmp_path / "run" / "failed.json").read_text())["stage"] == "config"


def test_a_misspelt_task_is_refused_from_the_recorded_index(tmp_path, monkeypatch):
    """A task outside specmd's five needs lm-eval's full index (12 s); once a run has built it, its names are on
    record and a misspelt task is refused without building it again."""
    import json

    import lm_eval.tasks

    from specmd.errors import ConfigError
    from specmd.eval import harness

    monkeypatch.setenv("SPECMD_CACHE", str(tmp_path))
    monkeypatch.setattr(harness, "_INDEX", {})
    path = harness._names_file()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(["gsm8k", "hellaswag"]))

    def no_index(*args, **kwargs):
        raise AssertionError("built the full index to refuse a name the record does not have")

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", no_index)
    with pytest.raises(ConfigError, match=r"unknown eval task\(s\) \['wikitxt'\]; specmd's tasks: wikitext"):
        harness.task_index(["wikitxt"])
    with pytest.raises(AssertionError, match="built the full index"):  # a recorded name: the index, to run it
        harness.task_index(["hellaswag"])
