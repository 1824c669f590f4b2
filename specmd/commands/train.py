"""Train an embedded model: ``python -m specmd.commands.train [overrides]`` (config: ``specmd/conf/train.yaml``; the deeper
models: ``--config-name train_deep_olmoe`` / ``train_deep_mixtral``).

An MoE of one of specmd's families (``architecture``: ``olmoe`` or ``mixtral`` for the embedded models, whose
transformers classes are ``OlmoeForCausalLM`` / ``MixtralForCausalLM``) with the load-balancing auxiliary
loss, on WikiText-2 *validation* + GSM8K *train* read through the data mirror (or the hub), with a
byte-level BPE tokenizer trained on the same text. Seeded: the data order of step s is a function of
(seed, s), so a run interrupted and resumed from its checkpoint continues exactly.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from ..errors import DataError

from .. import CONF_DIR
EOS, PAD = "<|endoftext|>", "<|pad|>"
SOURCES = ("wikitext2_valid", "gsm8k_train")


# ---- corpus ------------------------------------------------------------------------------------------
def load_corpus(cfg) -> tuple[list[str], list[str]]:
    """(train documents, held-out validation documents), deterministic."""
    from ..eval.corpora import gsm8k_train, wikitext2_valid
    from ..eval.mirror import resolve_mirror

    mirror = resolve_mirror(cfg.data.mirror)
    loaders = {"wikitext2_valid": wikitext2_valid, "gsm8k_train": gsm8k_train}
    train, valid = [], []
    for name in cfg.data.sources:
        if name not in loaders:
            raise DataError(f"unknown training source {name!r}; valid choices: {', '.join(SOURCES)}")
        docs = loaders[name](mirror)
        if cfg.data.max_docs:
            docs = docs[: cfg.data.max_docs]
        g = torch.Generator().manual_seed(cfg.seed)
        perm = torch.randperm(len(docs), generator=g).tolist()
        n_valid = max(1, int(len(docs) * cfg.data.valid_fraction))
        valid += [docs[i] for i in perm[:n_valid]]
        train += [docs[i] for i in perm[n_valid:]]
    return train, valid


# ---- tokenizer ---------------------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=PAD,
                                   unk_token=None, model_max_length=1 << 30)


def pack(tokenizer, docs: list[str], seq_len: int) -> torch.Tensor:
    """Concatenate documents (each followed by EOS) and cut into [N, seq_len + 1] blocks."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for ids_doc in tokenizer(docs, add_special_tokens=False)["input_ids"]:
        ids.extend(ids_doc)
        ids.append(eos)
    n = (len(ids) - 1) // seq_len
    if n < 1:
        raise DataError(f"training text too short: {len(ids)} tokens for seq_len={seq_len}")
    t = torch.tensor(ids[: n * seq_len + 1])
    return torch.stack([t[i * seq_len: (i + 1) * seq_len + 1] for i in range(n)])


def batch_indices(step: int, batch_size: int, n_blocks: int, seed: int) -> torch.Tensor:
    """Blocks of step ``step``: epochs are seeded permutations, so the order depends only on (seed, step)."""
    start = step * batch_size
    out = []
    while len(out) < batch_size:
        epoch, pos = divmod(start + len(out), n_blocks)
        perm = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        take = min(batch_size - len(out), n_blocks - pos)
        out.extend(perm[pos: pos + take].tolist())
    return torch.tensor(out)


# ---- model / optimisation ----------------------------------------------------------------------------
def build_model(cfg, tokenizer):
    """The ``architecture``'s transformers model from the ``model`` fields: any family with an adapter
    (:func:`specmd.models.adapters.families`; the embedded models are ``olmoe``: fine-grained experts, softmax
    top-k without renormalisation, and ``mixtral``: few coarse experts, renormalised top-k), built as its
    causal-LM class directly (no hub, transformers' own seeded initialisation)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from ..models.adapters import families

    arch = cfg.get("architecture", "olmoe")
    if arch not in families():
        raise ValueError(f"architecture={arch!r}; valid: {sorted(families())}")
    mc = AutoConfig.for_model(arch, vocab_size=len(tokenizer), bos_token_id=tokenizer.eos_token_id,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                              output_router_logits=True, **OmegaConf.to_container(cfg.model, resolve=True))
    torch.manual_seed(cfg.seed)
    return MODEL_FOR_CAUSAL_LM_MAPPING[type(mc)](mc)


def lr_at(step: int, cfg) -> float:
    o = cfg.optim
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    frac = (step - o.warmup_steps) / max(1, cfg.steps - o.warmup_steps)
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


@torch.no_grad()
def evaluate_loss(model, blocks: torch.Tensor, batch_size: int, max_batches: int) -> float:
    model.eval()
    losses = []
    for i in range(0, min(len(blocks), batch_size * max_batches), batch_size):
        b = blocks[i: i + batch_size]
        out = model(input_ids=b[:, :-1], labels=b[:, 1:].contiguous(), output_router_logits=False)
        losses.append(float(_lm_loss(out.logits, b[:, 1:])))
    model.train()
    return sum(losses) / len(losses)


def balance_loss(router_logits, top_k: int, usage: list | None = None, window: int = 1) -> torch.Tensor:
    """Switch-style load-balancing loss computed *per MoE layer* and averaged: E * sum_e f_e * P_e, with f_e
    the fraction of the layer's token-expert assignments that went to e and P_e its mean router probability
    (1.0 when perfectly balanced). transformers' own OLMoE aux loss concatenates all layers before
    balancing, which lets one layer leave experts dead while another overuses the same indices.

    ``window`` > 1 balances over a *global batch*: f_e is a moving average of the assignment fractions of the
    last ~``window`` steps (``usage`` holds one tensor per layer and is updated in place), not of this batch
    alone. Qiu et al. 2025 ("Demons in the Detail", global-batch load balancing) find that balancing each
    small batch suppresses expert specialisation: it pushes every sequence towards using all experts. Our
    reading is that the same push lowers the token-to-token locality that caching exploits; balancing over
    many batches keeps the experts equally used overall without it. Measured on the OLMoE-shaped recipe:
    the weakest layer's locality 0.184 (window 1) vs 0.205 (window 16); the Mixtral-shaped one stayed below
    its bound with either (docs/models.md "The embedded models"). ``window`` = 1 is the per-batch loss exactly."""
    losses = []
    for i, logits in enumerate(router_logits):
        probs = logits.float().softmax(dim=-1)  # [T, E]
        num_experts = probs.shape[-1]
        sel = probs.topk(top_k, dim=-1).indices
        f = torch.zeros(num_experts, dtype=probs.dtype).index_add_(
            0, sel.reshape(-1), torch.ones(sel.numel(), dtype=probs.dtype)) / sel.numel()  # [E]
        if window > 1:
            if len(usage) <= i:
                usage.append(torch.full_like(f, 1.0 / num_experts))
            f = usage[i].mul_(1.0 - 1.0 / window).add_(f, alpha=1.0 / window)
        losses.append(num_experts * (f * probs.mean(0)).sum())
    return torch.stack(losses).mean()


def _lm_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def _save_atomic(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _tokenizer(cfg, out: Path, train_docs: list[str]):
    """The run's tokenizer: the one saved in ``out`` when resuming, else one trained on the train documents (saved
    there)."""
    from transformers import PreTrainedTokenizerFast

    tok_path = out / "tokenizer.json"
    if cfg.resume and tok_path.exists():
        return PreTrainedTokenizerFast(tokenizer_file=str(tok_path), bos_token=EOS, eos_token=EOS,
                                       pad_token=PAD, model_max_length=1 << 30)
    tokenizer = train_tokenizer(train_docs, cfg.tokenizer.vocab_size)
    tokenizer.backend_tokenizer.save(str(tok_path))
    return tokenizer


def _optimizer(model, o):
    """AdamW over the model's parameters, with weight decay on its matrices only."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=o.lr, betas=tuple(o.betas))


def _resume(ckpt: Path, model, opt, usage: list) -> tuple[int, list, list]:
    """Restore the model, optimizer and RNG from ``ckpt``; (its step, its history, its balance usage)."""
    state = torch.load(ckpt, weights_only=False)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    step, history = state["step"], state["history"]
    torch.set_rng_state(state["rng"])
    return step, history, state.get("usage", usage)


def _train_step(cfg, model, opt, train_blocks: torch.Tensor, step: int, usage: list, window: int):
    """One optimisation step on step ``step``'s batch; (its LM loss, its balance loss)."""
    for group in opt.param_groups:
        group["lr"] = lr_at(step, cfg)
    b = train_blocks[batch_indices(step, cfg.batch_size, len(train_blocks), cfg.seed)]
    outp = model(input_ids=b[:, :-1], labels=b[:, 1:].contiguous())
    lm = _lm_loss(outp.logits, b[:, 1:])
    bal = balance_loss(outp.router_logits, model.config.num_experts_per_tok, usage, window)
    loss = lm + cfg.balance_coef * bal
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
    opt.step()
    return lm, bal


def _train_loop(cfg, model, opt, train_blocks: torch.Tensor, valid_blocks: torch.Tensor, ckpt: Path, step: int,
                history: list, usage: list, window: int) -> int:
    """Train from ``step`` to the last step (or ``stop_after``), recording ``history`` and checkpointing;
    the step reached."""
    from tqdm.auto import tqdm

    bar = tqdm(total=cfg.steps, initial=step, desc="train", dynamic_ncols=True)
    stop = min(cfg.steps, cfg.stop_after) if cfg.get("stop_after") else cfg.steps
    while step < stop:
        lm, bal = _train_step(cfg, model, opt, train_blocks, step, usage, window)
        step += 1
        rec = {"step": step, "loss": lm.item(), "aux": bal.item(), "lr": lr_at(step - 1, cfg)}
        if step % cfg.eval_every == 0 or step == cfg.steps:
            rec["valid_loss"] = evaluate_loss(model, valid_blocks, cfg.batch_size, cfg.eval_batches)
        history.append(rec)
        bar.update(1)
        bar.set_postfix(loss=f"{rec['loss']:.3f}", aux=f"{rec['aux']:.3f}",
                        **({"valid": f"{rec['valid_loss']:.3f}"} if "valid_loss" in rec else {}))
        if step % cfg.ckpt_every == 0 or step == stop:
            _save_atomic({"model": model.state_dict(), "optim": opt.state_dict(), "step": step,
                          "history": history, "rng": torch.get_rng_state(), "usage": usage}, ckpt)
    bar.close()
    return step


def _save_model(cfg, model, tokenizer, out: Path) -> None:
    """Save the trained model (at ``save_dtype``, without router logits) and its tokenizer into ``out/model``."""
    model.eval()
    final_dir = out / "model"
    model.config.output_router_logits = False
    model.to(getattr(torch, cfg.save_dtype)).save_pretrained(final_dir, safe_serialization=True)
    model.float()
    tokenizer.save_pretrained(final_dir)


def train(cfg: DictConfig) -> dict:
    """Run (or resume) the recipe; returns the summary that the model card reports."""
    from ..eval.mirror import set_offline

    if cfg.data.mirror:
        set_offline()
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train_docs, valid_docs = load_corpus(cfg)
    tokenizer = _tokenizer(cfg, out, train_docs)
    train_blocks = pack(tokenizer, train_docs, cfg.seq_len)
    valid_blocks = pack(tokenizer, valid_docs, cfg.seq_len)
    model = build_model(cfg, tokenizer)
    model.train()
    opt = _optimizer(model, cfg.optim)
    ckpt = out / "checkpoint.pt"
    step, history = 0, []
    window = int(cfg.get("balance_window") or 1)
    if window < 1:
        raise ValueError(f"balance_window={window}: must be a number of steps >= 1 (1 = per-batch balance)")
    usage: list[torch.Tensor] = []  # balance_window's running f_e per MoE layer (filled on the first step)
    if cfg.resume and ckpt.exists():
        step, history, usage = _resume(ckpt, model, opt, usage)
    t0 = time.time()
    step = _train_loop(cfg, model, opt, train_blocks, valid_blocks, ckpt, step, history, usage, window)
    if step < cfg.steps:  # stopped early on purpose (stop_after): resume later from the checkpoint
        return {"stopped_at": step}
    _save_model(cfg, model, tokenizer, out)
    summary = {
        "steps": step, "batch_size": cfg.batch_size, "seq_len": cfg.seq_len,
        "train_tokens_seen": step * cfg.batch_size * cfg.seq_len,
        "corpus": {"train_docs": len(train_docs), "valid_docs": len(valid_docs),
                   "train_tokens": int(train_blocks[:, :-1].numel()), "valid_tokens": int(valid_blocks[:, :-1].numel())},
        "final_train_loss": sum(h["loss"] for h in history[-20:]) / min(20, len(history)),
        "final_valid_loss": evaluate_loss(model, valid_blocks, cfg.batch_size, 10**9),
        "params": sum(p.numel() for p in model.parameters()),
        "wall_s_this_run": time.time() - t0,
    }
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2))
    (out / "history.json").write_text(json.dumps(history))
    return summary


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="train")
def main(cfg: DictConfig):
    summary = train(cfg)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
