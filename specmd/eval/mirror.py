"""The data mirror: lm-eval's built-in tasks read local files instead of the Hugging Face hub.

A mirror is a directory laid out like ``../shared/data`` (see docs/models.md "Data mirror"):

    wikitext2/raw/wiki.test.raw                       -> EleutherAI/wikitext_document_level (test)
    mmlu/{test,dev}/<subject>_{test,dev}.csv          -> cais/mmlu, hails/mmlu_no_train (test, dev)
    gsm8k/{train,test}.jsonl                          -> openai/gsm8k, gsm8k "main" (train, test)
    truthfulqa/v0/mc_task.json                        -> truthfulqa/truthful_qa "multiple_choice" (validation)
    nq_open/NQ-open.dev.jsonl                         -> google-research-datasets/nq_open (validation)

While :func:`mirrored` is active, ``datasets.load_dataset`` (which lm-eval's tasks call) is answered from
these files; a dataset the mirror does not hold raises :class:`DataError` naming what it does hold. The HF
offline variables are set so that nothing waits on the network.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import socket
from functools import lru_cache
from pathlib import Path
from typing import Callable, Optional

from ..errors import DataError

OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def set_offline() -> None:
    for var in OFFLINE_VARS:
        os.environ[var] = "1"


@lru_cache(maxsize=1)
def hub_reachable(timeout: float = 3.0) -> bool:
    if any(os.environ.get(v) == "1" for v in OFFLINE_VARS[:2]):
        return False
    host = re.sub(r"^https?://", "", os.environ.get("HF_ENDPOINT", "huggingface.co")).split("/")[0]
    try:
        with socket.create_connection((host.split(":")[0], 443), timeout=timeout):
            return True
    except OSError:
        return False


def require_hub_for(what: str, repo_id: Optional[str] = None) -> None:
    """Fail fast (instead of hanging) when ``what`` needs the hub and it is unreachable. A model repo
    already in the local HF cache is fine offline."""
    if repo_id is not None:
        try:
            from huggingface_hub import try_to_load_from_cache

            if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
                os.environ["HF_HUB_OFFLINE"] = os.environ.get("HF_HUB_OFFLINE") or ("0" if hub_reachable() else "1")
                return
        except Exception:
            pass
    if not hub_reachable():
        raise DataError(
            f"{what} needs the Hugging Face hub, which is unreachable (or HF_HUB_OFFLINE=1). "
            "Use a local path, or a model/data mirror (data.mirror=/path or SPECMD_DATA_MIRROR)."
        )


# ---- loaders: one per HF dataset lm-eval asks for --------------------------------------------------------
def _ds(splits: dict[str, list[dict]]):
    import datasets

    return datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()})


def _jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def wikitext_documents(text: str) -> list[str]:
    """Split raw WikiText into articles at top-level headings `` = Title = `` (as the
    EleutherAI/wikitext_document_level builder does)."""
    docs, cur = [], []
    for line in text.split("\n"):
        stripped = line.strip()
        is_title = re.fullmatch(r"= [^=].*[^=] =", stripped) is not None
        if is_title and cur:
            page = "\n".join(cur)
            if page.strip():
                docs.append(page)
            cur = []
        cur.append(line)
    page = "\n".join(cur)
    if page.strip():
        docs.append(page)
    return docs


def _wikitext(root: Path, name: Optional[str]):
    if name not in (None, "wikitext-2-raw-v1"):
        raise DataError(f"the mirror holds wikitext-2-raw-v1 only, not {name!r}")
    path = root / "wikitext2" / "raw" / "wiki.test.raw"
    pages = [{"page": p} for p in wikitext_documents(path.read_text(encoding="utf-8"))]
    # Only the test split exists in raw form; train/validation are empty (never used at 0-shot).
    return _ds({"test": pages, "train": [], "validation": []})


def _mmlu(root: Path, name: Optional[str]):
    subjects = sorted(p.name[: -len("_test.csv")] for p in (root / "mmlu" / "test").glob("*_test.csv"))
    wanted = subjects if name in (None, "all") else [name]
    if any(s not in subjects for s in wanted):
        raise DataError(f"mmlu subject {name!r} not in the mirror; it has: {', '.join(subjects)}")
    splits = {}
    for split in ("test", "dev"):
        rows = []
        for subj in wanted:
            with open(root / "mmlu" / split / f"{subj}_{split}.csv", encoding="utf-8", newline="") as f:
                for r in csv.DictReader(f):
                    rows.append({"question": r["question"], "subject": subj,
                                 "choices": [r[f"choice{i}"] for i in range(4)], "answer": int(r["answer"])})
        splits[split] = rows
    splits["validation"] = splits["dev"]
    return _ds(splits)


def _gsm8k(root: Path, name: Optional[str]):
    if name not in (None, "main"):
        raise DataError(f"the mirror holds gsm8k 'main' only, not {name!r}")
    return _ds({s: _jsonl(root / "gsm8k" / f"{s}.jsonl") for s in ("train", "test")})


def _truthfulqa(root: Path, name: Optional[str]):
    if name != "multiple_choice":
        raise DataError(f"the mirror holds truthful_qa 'multiple_choice' (mc1/mc2) only, not {name!r}")
    items = json.loads((root / "truthfulqa" / "v0" / "mc_task.json").read_text(encoding="utf-8"))

    def targets(d):
        return {"choices": list(d.keys()), "labels": [int(v) for v in d.values()]}

    rows = [{"question": it["question"], "mc1_targets": targets(it["mc1_targets"]),
             "mc2_targets": targets(it["mc2_targets"])} for it in items]
    return _ds({"validation": rows})


def _nq_open(root: Path, name: Optional[str]):
    rows = _jsonl(root / "nq_open" / "NQ-open.dev.jsonl")
    rows = [{"question": r["question"], "answer": list(r["answer"])} for r in rows]
    # The mirror has no NQ-open train split: few-shot nq_open needs the hub.
    return _ds({"validation": rows, "train": []})


LOADERS: dict[str, Callable] = {
    "EleutherAI/wikitext_document_level": _wikitext,
    "cais/mmlu": _mmlu,
    "hails/mmlu_no_train": _mmlu,
    "openai/gsm8k": _gsm8k,
    "gsm8k": _gsm8k,
    "truthfulqa/truthful_qa": _truthfulqa,
    "truthful_qa": _truthfulqa,
    "google-research-datasets/nq_open": _nq_open,
    "nq_open": _nq_open,
}


def resolve_mirror(path: Optional[str]) -> Optional[Path]:
    if path in (None, ""):
        return None
    root = Path(path).expanduser().resolve()
    if not root.is_dir():
        raise DataError(f"data.mirror={path} is not a directory")
    return root


@contextlib.contextmanager
def mirrored(root: Optional[Path]):
    """Answer ``datasets.load_dataset`` from the mirror while active (no-op when ``root`` is None)."""
    if root is None:
        yield
        return
    import datasets

    set_offline()
    original = datasets.load_dataset
    cache: dict = {}

    def load_dataset(path=None, name=None, *args, **kwargs):
        if path not in LOADERS:
            raise DataError(
                f"dataset {path!r} (config {name!r}) is not in the data mirror {root}; "
                f"the mirror serves: {', '.join(sorted(LOADERS))}"
            )
        key = (path, name)
        if key not in cache:
            try:
                cache[key] = LOADERS[path](root, name)
            except FileNotFoundError as exc:
                raise DataError(f"data mirror {root} lacks a file for {path!r}: {exc.filename}") from None
        return cache[key]

    datasets.load_dataset = load_dataset
    try:
        yield
    finally:
        datasets.load_dataset = original
