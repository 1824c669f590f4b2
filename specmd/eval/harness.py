"""Quality through lm-eval-harness: an ``HFLM`` wrapping the (hooked) model; no metric is re-implemented."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional, Union

from ..errors import ConfigError

# specmd task names -> lm-eval task names (the papers report TruthfulQA as mc2).
TASK_ALIASES = {"truthfulqa": "truthfulqa_mc2"}
SUPPORTED = ("wikitext", "mmlu", "gsm8k", "truthfulqa", "nq_open")
# The metric each paper reports per task (specmd task name -> results key, True when higher is better):
# SpecMD Table 1 (GSM8K strict match, TruthfulQA mc2, NQ exact match), Cache-Conditional Experts (WikiText
# word perplexity), MMLU accuracy. ``specmd report`` shows them for a sweep without a report spec.
QUALITY = {"gsm8k": ("exact_match/strict-match", True), "truthfulqa": ("acc", True),
           "nq_open": ("exact_match/remove_whitespace", True), "mmlu": ("acc", True),
           "wikitext": ("word_perplexity", False)}


@dataclass
class EvalConfig:
    tasks: list[str] = field(default_factory=lambda: ["wikitext"])
    # Documents per task (int) or fraction of each task (float < 1); null = all.
    limit: Optional[Union[int, float]] = None
    batch_size: int = 1
    # Few-shot examples; null = each task's own default. Tasks without a few-shot split ignore it.
    num_fewshot: Optional[int] = None
    # Cap on generated tokens for generation tasks (gsm8k, nq_open); null = the task's own.
    max_gen_toks: Optional[int] = None
    max_length: Optional[int] = None  # context window given to lm-eval; null = the model's, at most WINDOW_CAP
    seed: int = 1234
    # Score loglikelihoods one token at a time with a KV cache, so every token is a decode step whose
    # routing sees the cache state its predecessors left (Cache-Conditional Experts' evaluation of
    # perplexity vs miss rate). Slower by about the window length; logits equal a full-window pass up to
    # float rounding.
    token_by_token: bool = False
    # Speculative decoding of generation tasks through transformers' own generate: prompt_lookup (drafts copied
    # from the prompt's n-grams: no draft model, transformers' prompt_lookup_num_tokens) or assistant (a draft
    # model, eval.assistant: transformers' assistant_model at a constant K), each verify step K + 1 tokens of the
    # sequence through every layer (docs/semantics.md "Speculative decoding"); null: none
    speculative: Optional[str] = None
    speculative_tokens: int = 3  # K: drafts per verify step
    assistant: Optional[str] = None  # the draft model of speculative=assistant: a model config name (conf/model/)

    def __post_init__(self):
        twice = sorted({t for t in self.tasks if self.tasks.count(t) > 1})
        if twice:
            raise ConfigError(f"eval.tasks={self.tasks} lists {twice} twice: each task runs once (its scores would "
                              f"be one key of results.json)")
        if not 0 <= self.seed < 2**32:  # numpy's and lm-eval's seeds are unsigned 32-bit
            raise ConfigError(f"eval.seed={self.seed} must be in 0..{2**32 - 1}")
        if self.batch_size < 1:
            raise ConfigError(f"eval.batch_size={self.batch_size} must be >= 1")
        if self.limit is not None and not self.limit > 0:
            raise ConfigError(f"eval.limit={self.limit} must be positive or null")
        if isinstance(self.limit, float) and self.limit >= 1:
            if not self.limit.is_integer():
                raise ConfigError(f"eval.limit={self.limit}: a number of documents (a whole number) or a fraction "
                                  f"of each task (< 1)")
            self.limit = int(self.limit)
        if self.max_length is not None and self.max_length < 2:
            raise ConfigError(f"eval.max_length={self.max_length} must be >= 2 (a context window in tokens) or null")
        if self.max_gen_toks is not None and self.max_gen_toks < 1:
            raise ConfigError(f"eval.max_gen_toks={self.max_gen_toks} must be >= 1 or null")
        if self.speculative is not None and self.speculative not in SPECULATIVE:
            raise ConfigError(f"eval.speculative={self.speculative!r}; valid choices: {', '.join(SPECULATIVE)}, "
                              f"or null")
        if (self.speculative == "assistant") != (self.assistant is not None):
            raise ConfigError(f"eval.speculative={self.speculative} and eval.assistant={self.assistant}: a draft model "
                              f"is eval.speculative=assistant's, and it needs one (eval.assistant=<a model config, "
                              f"e.g. tiny>)")
        if not 1 <= self.speculative_tokens <= 64:
            raise ConfigError(f"eval.speculative_tokens={self.speculative_tokens}: valid choices are whole numbers in "
                              f"1..64 (drafts per verify step)")
        if self.speculative is not None and self.batch_size != 1:
            raise ConfigError(f"eval.speculative={self.speculative} runs transformers' assisted generation, which "
                              f"takes one sequence at a time: eval.batch_size={self.batch_size} must be 1")
        if self.speculative is not None and self.token_by_token:
            raise ConfigError(f"eval.speculative={self.speculative} drafts generated tokens, and eval.token_by_token "
                              f"scores loglikelihoods one token at a time: set one of them")
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise ConfigError(f"eval.num_fewshot={self.num_fewshot} must be >= 0 or null")


SPECULATIVE = ("prompt_lookup", "assistant")


def lm_eval_name(task: str) -> str:
    return TASK_ALIASES.get(task, task)


# The context window when eval.max_length is null: the model's declared maximum (lm-eval's rule) up to this
# many tokens. Without a cap a model declaring 131,072 positions (GPT-OSS, and the tiny_gpt_oss shaped like it)
# gets one WikiText document as a single eager-attention window: the process was killed for memory on 24 GB.
WINDOW_CAP = 4096
_WINDOW_ATTRS = ("n_positions", "max_position_embeddings", "n_ctx")  # lm-eval HFLM.max_length's order


def window(config, max_length: Optional[int]) -> Optional[int]:
    """The ``max_length`` given to lm-eval: ``eval.max_length`` when set; else the model's declared window
    capped at :data:`WINDOW_CAP`, with a warning naming the override that lifts the cap."""
    if max_length is not None:
        return max_length
    declared = next((getattr(config, a) for a in _WINDOW_ATTRS if isinstance(getattr(config, a, None), int)), None)
    if declared is not None and declared > WINDOW_CAP:
        logging.getLogger("specmd").warning(
            "the model declares %d positions; evaluating with a %d-token window (eval.max_length=%d uses them all)",
            declared, WINDOW_CAP, declared)
        return WINDOW_CAP
    return None


_INDEX: dict = {}


def task_index(tasks):
    """lm-eval's ``TaskManager`` for ``tasks``. For specmd's own tasks it indexes only their five folders
    of lm-eval's task tree (0.2 s) instead of all 14,683 task files (6-12 s, most of a small run's start-up);
    a task outside them gets the full index. Task names are checked here, so an unknown one is reported
    before the model loads (``Run`` calls this), with the valid choices -- at once when an earlier full index
    of this lm-eval's task tree is on record (:func:`_recorded_names`): a misspelt task is an error in a
    second, not after the 12 s index that would only say so."""
    import os

    import lm_eval.tasks
    from lm_eval.tasks import TaskManager

    full = any(t not in SUPPORTED for t in tasks)
    tm = _INDEX.get(full)
    if tm is None:
        if full:
            _refuse_unknown(tasks, _recorded_names())
            tm = TaskManager()
            _record_names(tm.all_tasks)
        else:
            root = os.path.dirname(lm_eval.tasks.__file__)
            tm = TaskManager(include_defaults=False, include_path=[os.path.join(root, t) for t in SUPPORTED])
        _INDEX[full] = tm
    _refuse_unknown(tasks, tm.all_tasks)
    return tm


def _refuse_unknown(tasks, names) -> None:
    """ConfigError naming the tasks that are not in ``names`` (None: no record, nothing refused)."""
    unknown = [t for t in tasks if names is not None and lm_eval_name(t) not in names]
    if unknown:
        raise ConfigError(f"unknown eval task(s) {unknown}; specmd's tasks: {', '.join(SUPPORTED)} "
                          "(any lm-eval task name also works when its data is reachable)")


def _names_file():
    """Where the full index's task names are recorded: one file per lm-eval version and state of its task tree
    (the tree's time changes when a task folder is added), under ``$SPECMD_CACHE``."""
    import os

    import lm_eval
    import lm_eval.tasks

    from ..quant.base import cache_dir

    tree = os.path.dirname(lm_eval.tasks.__file__)
    return cache_dir().parent / "lm_eval" / f"tasks-{lm_eval.__version__}-{os.stat(tree).st_mtime_ns}.json"


def _recorded_names():
    """The task names the last full index of this task tree found, or None."""
    import json

    try:
        return set(json.loads(_names_file().read_text()))
    except (OSError, ValueError):
        return None


def _record_names(names) -> None:
    """Record the full index's task names for the next run (best effort: a run never fails on it)."""
    import json

    from ..results import content_fill, write_file

    try:
        write_file(_names_file(), content_fill(json.dumps(sorted(names))), keep=False)
    except OSError:
        pass


def _flatten(metrics: dict) -> dict:
    out = {}
    for key, val in metrics.items():
        if key == "alias" or not isinstance(val, (int, float)) or isinstance(val, bool):
            continue
        metric, _, filt = key.partition(",")
        name = metric if filt in ("", "none") else f"{metric}/{filt}"
        out[name] = float(val)
    return out


class _Patched:
    """``module.name`` replaced by ``value`` inside a ``with`` block (one evaluation call; restored after)."""

    def __init__(self, module, name: str, value):
        self.module, self.name, self.value = module, name, value

    def __enter__(self):
        self.saved = getattr(self.module, self.name)
        setattr(self.module, self.name, self.value)

    def __exit__(self, *exc):
        setattr(self.module, self.name, self.saved)


def _finished_tracker(live, stops, eos, batch: int):
    """A stopping criterion, evaluated after HF's and lm-eval's own at every generation step, that tells the
    stack (``live``: :class:`specmd.hook.live.LiveTokens`) which sequences have stopped, so their next decode
    rows are no requests. Stopped = lm-eval's stop string seen (its ``MultiTokenEOSCriteria`` keeps a
    per-sequence ``done_tracker`` but stops the batch only when every sequence is done, so a finished
    sequence generates on) or the model's end-of-sequence token generated (transformers then feeds it pad
    tokens). Never stops anything itself."""
    import torch
    from transformers import StoppingCriteria

    eos_ids = torch.tensor([] if eos is None else [eos] if isinstance(eos, int) else list(eos), dtype=torch.long)

    class Finished(StoppingCriteria):
        def __init__(self):
            self.done = torch.zeros(batch, dtype=torch.bool)

        def __call__(self, input_ids, scores, **kwargs):
            done = self.done
            for c in stops:
                tracker = getattr(c, "done_tracker", None)
                if tracker is not None and len(tracker) == batch:
                    done |= torch.tensor(tracker, dtype=torch.bool)
            if eos_ids.numel():
                done |= torch.isin(input_ids[:, -1].to("cpu"), eos_ids)
            live.finish(done)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return Finished()


class _RowLengths:
    """The true lengths of a right-padded scoring batch's rows, noted as lm-eval pads it, and which positions
    of the batch are therefore requests (a mixin of PhaseBarLM: it needs no lm-eval import)."""

    _lengths = None  # the true lengths of the rows of the scoring batch about to be called

    def _record_lengths(self, max_length, tensors, padding_side="right"):
        """lm-eval's ``pad_and_concat``, noting each row's own length (its right padding is no request)."""
        self._lengths = [int(t.shape[-1]) for t in tensors] if padding_side == "right" else None
        return self._pad_and_concat(max_length, tensors, padding_side=padding_side)

    def _live_positions(self, inps):
        """[B, S] bool of a right-padded scoring batch, or None when no row is padded."""
        import torch

        lengths, self._lengths = self._lengths, None
        if lengths is None or len(lengths) != inps.shape[0] or min(lengths) >= inps.shape[1]:
            return None
        return torch.arange(inps.shape[1]).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)


def _tracking_criteria(original, live, eos):
    """lm-eval's ``stop_sequences_criteria`` (``original``) with a :func:`_finished_tracker` appended to its stops."""

    def criteria(tokenizer, stop_sequences, initial_length, batch_size):
        stops = original(tokenizer, stop_sequences, initial_length, batch_size)
        stops.append(_finished_tracker(live, list(stops), eos, batch_size))
        return stops

    return criteria


def _phase_bar_lm():
    import lm_eval.models.huggingface as hf
    from lm_eval.models.huggingface import HFLM

    from ..signals import check_interrupt

    class PhaseBarLM(_RowLengths, HFLM):
        """HFLM with one progress bar per request type. lm-eval 0.4.13's ``loglikelihood_rolling`` shows its
        own bar over the documents and then opens another one for every batch of windows it scores
        (``disable_tqdm=False`` hard-coded): a WikiText run printed a bar per document."""

        _rolling = False
        live = None  # the stack's LiveTokens (specmd.hook.live): which positions of a batch are requests

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            self._rolling = True
            try:
                return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)
            finally:
                self._rolling = False

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
            # lm-eval pads a scoring batch on the right inside this method and calls the model without a mask:
            # its padding helper is wrapped for the call so the rows' lengths reach the stack
            if self.live is None:
                return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm or self._rolling,
                                                     override_bs=override_bs)
            self._pad_and_concat = hf.pad_and_concat
            with _Patched(hf, "pad_and_concat", self._record_lengths):
                return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm or self._rolling,
                                                     override_bs=override_bs)

        # a safe point per batch (specmd.signals.check_interrupt): a signal whose exception a finalizer swallowed
        # stops the evaluation at its next model call, not after the last document
        def _model_call(self, inps, attn_mask=None, labels=None):
            check_interrupt()
            if self.live is not None:
                positions = self._live_positions(inps)
                if positions is not None:
                    self.live.expect(positions)
            return super()._model_call(inps, attn_mask, labels)

        speculation: dict = {}  # eval.speculative: generate's keywords (_speculation)

        def _model_generate(self, context, max_length, stop, **generation_kwargs):
            check_interrupt()
            generation_kwargs.update(self.speculation)
            if self.live is None or context.shape[0] == 1:  # one sequence: its stop ends the generation
                out = super()._model_generate(context, max_length, stop, **generation_kwargs)
                if self.live is not None:  # the tokens its decode passes produced (the prefill's first is not one)
                    self.live.generated += max(0, int(out.shape[1]) - int(context.shape[1]) - 1)
                return out
            live, eos = self.live, self.model.generation_config.eos_token_id
            criteria = _tracking_criteria(hf.stop_sequences_criteria, live, eos)
            with _Patched(hf, "stop_sequences_criteria", criteria):
                return super()._model_generate(context, max_length, stop, **generation_kwargs)

    return PhaseBarLM


def _speculation(cfg: EvalConfig, assistant) -> dict:
    """generate's keywords for ``eval.speculative``: prompt lookup's K, or the draft model set to draft exactly K a
    step (a constant schedule, no confidence threshold stopping a step early); {} without speculation."""
    if cfg.speculative == "prompt_lookup":
        return {"prompt_lookup_num_tokens": cfg.speculative_tokens}
    if assistant is None:
        return {}
    assistant.generation_config.num_assistant_tokens = cfg.speculative_tokens
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.generation_config.assistant_confidence_threshold = 0.0
    return {"assistant_model": assistant}


def _token_by_token_lm():
    import torch

    class TokenByTokenLM(_phase_bar_lm()):
        """HFLM whose scoring forward feeds the window one token at a time through the KV cache."""

        def _model_call(self, inps, attn_mask=None, labels=None):
            if attn_mask is not None or labels is not None or inps.shape[1] == 1:
                return super()._model_call(inps, attn_mask, labels)
            from transformers import DynamicCache

            past = DynamicCache(config=self.model.config)
            out = []
            positions = self._live_positions(inps) if self.live is not None else None
            with torch.no_grad():
                for t in range(inps.shape[1]):
                    if positions is not None:  # a right pad of a shorter row: not a request in this step
                        self.live.expect(positions[:, t:t + 1])
                    res = self.model(input_ids=inps[:, t:t + 1], past_key_values=past, use_cache=True)
                    past = res.past_key_values
                    out.append(res.logits)
            return torch.cat(out, dim=1)

    return TokenByTokenLM


def _quiet_git_hash():
    """lm-eval's ``get_git_commit_hash`` with git's stderr kept off the terminal (None outside a checkout)."""
    import subprocess

    try:
        out = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def evaluate(model, tokenizer, cfg: EvalConfig, device: str = "cpu", live=None, assistant=None) -> dict:
    """Run the tasks; returns ``{specmd task name: {metric: value}}``. ``live``: the installed stack's
    :class:`~specmd.hook.live.LiveTokens` (None: unhooked), told which positions of each batch are requests
    (right padding of a scoring batch, sequences of a generation batch that have stopped). ``assistant``: the
    draft model of ``eval.speculative=assistant`` (drafting ``speculative_tokens`` a step: a constant schedule,
    not transformers' default heuristic that changes K as drafts are accepted, and no confidence threshold that
    stops a step's drafting early -- the K of the run is the K a verify step has)."""
    if not cfg.tasks:
        return {}
    import lm_eval
    import lm_eval.evaluator

    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    # lm-eval records the working directory's git hash, and its `git describe` prints "fatal: not a git
    # repository" on the terminal outside a checkout; specmd's provenance records its own source's git state
    lm_eval.evaluator.get_git_commit_hash = _quiet_git_hash
    tm = task_index(cfg.tasks)
    names = [lm_eval_name(t) for t in cfg.tasks]
    cls = _token_by_token_lm() if cfg.token_by_token else _phase_bar_lm()
    lm = cls(pretrained=model, tokenizer=tokenizer, batch_size=cfg.batch_size, device=device,
             max_length=window(model.config, cfg.max_length))
    lm.live = live
    lm.speculation = _speculation(cfg, assistant)
    gen_kwargs = {"max_gen_toks": cfg.max_gen_toks} if cfg.max_gen_toks else None
    try:
        res = lm_eval.simple_evaluate(
            model=lm, tasks=names, num_fewshot=cfg.num_fewshot, limit=cfg.limit, task_manager=tm,
            gen_kwargs=gen_kwargs, log_samples=False, bootstrap_iters=0, random_seed=cfg.seed,
            numpy_random_seed=cfg.seed, torch_random_seed=cfg.seed, fewshot_random_seed=cfg.seed,
            verbosity="WARNING",
        )
    except AssertionError as exc:  # lm-eval's few-shot sampler: more examples asked for than the task has
        if "no documents available for sampling" not in str(exc):
            raise
        raise ConfigError(f"eval.num_fewshot={cfg.num_fewshot}: the task(s) {cfg.tasks} have fewer few-shot "
                          f"examples than that (lm-eval: {exc})") from None
    results = res["results"]
    return {t: _flatten(results.get(n, {})) for t, n in zip(cfg.tasks, names)}
