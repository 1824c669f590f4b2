"""The training corpora, read through the data mirror (:mod:`.mirror`) or the hub: WikiText-2 validation (the
embedded models' training text, ``specmd train``, and the routing ``specmd train-eviction`` records) and GSM8K
train, each as lm-eval presents it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional


def wikitext2_valid(mirror: Optional[Path]) -> list[str]:
    """WikiText-2 validation articles, detokenized exactly as lm-eval's wikitext task presents text."""
    from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer

    from .mirror import require_hub_for, wikitext_documents

    if mirror is not None:
        text = (mirror / "wikitext2" / "tokens" / "wiki.valid.tokens").read_text(encoding="utf-8")
    else:
        require_hub_for("training data wikitext2_valid without a data mirror")
        import datasets

        rows = datasets.load_dataset("wikitext", "wikitext-2-v1", split="validation")
        text = "".join(r["text"] for r in rows)
    return [wikitext_detokenizer({"page": d}) for d in wikitext_documents(text)]


def gsm8k_train(mirror: Optional[Path]) -> list[str]:
    """GSM8K train problems in lm-eval's gsm8k prompt format ("Question: ...\\nAnswer: ...")."""
    from .mirror import require_hub_for

    if mirror is not None:
        with open(mirror / "gsm8k" / "train.jsonl", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    else:
        require_hub_for("training data gsm8k_train without a data mirror")
        import datasets

        rows = datasets.load_dataset("openai/gsm8k", "main", split="train")
    return [f"Question: {r['question']}\nAnswer: {r['answer']}" for r in rows]
