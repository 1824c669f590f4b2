"""The training recipe on a tiny slice: the loss falls, and an interrupted run resumes exactly."""

import pytest
import torch
from hydra import compose, initialize_config_dir

from tests.conftest import ROOT
from specmd import CONF_DIR

SMALL = ["steps={steps}", "batch_size=4", "seq_len=32", "data.max_docs=10", "tokenizer.vocab_size=300",
         "model.hidden_size=32", "model.num_hidden_layers=2", "model.num_attention_heads=2",
         "model.num_key_value_heads=2", "model.num_experts=8", "model.num_experts_per_tok=2",
         "model.intermediate_size=16", "optim.warmup_steps=2", "eval_every=1000", "eval_batches=2"]


def cfg(tmp, steps, mirror, ckpt_every=1000, stop_after=None, window=1):
    overrides = [o.format(steps=steps) for o in SMALL] + [f"out_dir={tmp}", f"data.mirror={mirror}",
                                                          f"ckpt_every={ckpt_every}", f"balance_window={window}"]
    if stop_after:
        overrides.append(f"stop_after={stop_after}")
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def test_loss_falls(tmp_path, mirror):
    from specmd.commands.train import train

    summary = train(cfg(tmp_path, 40, mirror))
    hist = __import__("json").loads((tmp_path / "history.json").read_text())
    first = sum(h["loss"] for h in hist[:5]) / 5
    last = sum(h["loss"] for h in hist[-5:]) / 5
    assert last < first - 0.5, (first, last)
    assert summary["final_valid_loss"] < first
    assert (tmp_path / "model" / "model.safetensors").exists() and (tmp_path / "model" / "tokenizer.json").exists()


@pytest.mark.parametrize("window", [1, 4])  # 4: the global-batch balance's running usage is checkpointed too
def test_interrupted_run_resumes_exactly(tmp_path, mirror, window):
    from safetensors.torch import load_file

    from specmd.commands.train import train

    train(cfg(tmp_path / "straight", 8, mirror, window=window))
    assert train(cfg(tmp_path / "split", 8, mirror, ckpt_every=3, stop_after=4, window=window)) == {"stopped_at": 4}
    train(cfg(tmp_path / "split", 8, mirror, ckpt_every=3, window=window))  # resumes from the step-4 checkpoint
    a = load_file(tmp_path / "straight" / "model" / "model.safetensors")
    b = load_file(tmp_path / "split" / "model" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_batches_depend_only_on_seed_and_step():
    from specmd.commands.train import batch_indices

    a = [batch_indices(s, 4, 10, 0).tolist() for s in range(6)]
    assert a == [batch_indices(s, 4, 10, 0).tolist() for s in range(6)]
    # every block once per epoch: steps 0-1 plus half of step 2 cover blocks 0..9
    first_epoch = sum(a[:2], []) + a[2][:2]
    assert sorted(first_epoch) == list(range(10))


def test_balance_loss_per_batch_and_over_a_window_by_hand():
    from specmd.commands.train import balance_loss

    # one layer, 4 tokens, 2 experts, top-1: tokens 0-2 pick expert 0, token 3 expert 1 -> f = [3/4, 1/4]
    logits = torch.log(torch.tensor([[0.8, 0.2], [0.6, 0.4], [0.6, 0.4], [0.2, 0.8]]))
    p = torch.tensor([0.55, 0.45])  # mean router probability
    assert balance_loss([logits], 1).item() == pytest.approx(2 * (0.75 * 0.55 + 0.25 * 0.45))
    # window 2: f = 1/2 * running usage (uniform at the start) + 1/2 * this batch = [0.625, 0.375]
    usage = []
    assert balance_loss([logits], 1, usage, 2).item() == pytest.approx(2 * float((torch.tensor([0.625, 0.375]) * p).sum()))
    assert torch.allclose(usage[0], torch.tensor([0.625, 0.375]))  # carried to the next step
    # next step, same batch: f = 1/2 * [0.625, 0.375] + 1/2 * [0.75, 0.25] = [0.6875, 0.3125]
    assert balance_loss([logits], 1, usage, 2).item() == pytest.approx(2 * float((torch.tensor([0.6875, 0.3125]) * p).sum()))
