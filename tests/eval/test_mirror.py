import pytest

from specmd.errors import DataError
from specmd.eval import mirror as M


def test_wikitext_documents_match_lm_eval_split(mirror):
    ds = M._wikitext(mirror, "wikitext-2-raw-v1")
    assert ds["test"].num_rows == 62  # EleutherAI/wikitext_document_level, wikitext-2-raw-v1 test
    assert ds["test"][0]["page"].startswith(" = Robert Boulter = ")


def test_mmlu_truthfulqa_nq_gsm8k_schemas(mirror):
    mmlu = M._mmlu(mirror, "abstract_algebra")
    assert mmlu["test"].num_rows == 100 and mmlu["dev"].num_rows == 5
    row = mmlu["test"][0]
    assert set(row) == {"question", "subject", "choices", "answer"} and len(row["choices"]) == 4
    tqa = M._truthfulqa(mirror, "multiple_choice")["validation"]
    assert tqa.num_rows == 817
    assert tqa[0]["mc2_targets"]["labels"][0] == 1
    assert M._nq_open(mirror, None)["validation"].num_rows == 3610
    assert M._gsm8k(mirror, "main")["test"].num_rows == 1319


def test_unknown_dataset_is_a_clear_error(mirror):
    import datasets

    with M.mirrored(mirror):
        with pytest.raises(DataError, match="not in the data mirror.*serves"):
            datasets.load_dataset("allenai/ai2_arc", "ARC-Easy")
    assert datasets.load_dataset.__module__.startswith("datasets")  # restored


def test_no_mirror_and_no_hub_fails_fast(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    M.hub_reachable.cache_clear()
    try:
        with pytest.raises(DataError, match="data.mirror"):
            M.require_hub_for("eval.tasks=['wikitext']")
    finally:
        M.hub_reachable.cache_clear()
