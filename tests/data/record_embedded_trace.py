"""Records tests/data/embedded_trace (the golden-value fixture of tests/system/test_golden.py): the embedded model
(specmd:tiny-olmoe) on two fixed 24-token prompts, each prefilled and decoded 4 steps greedily, prefetch
signal depth 2, fp32 logits. Re-record only on purpose (the golden values change with it):

    python tests/data/record_embedded_trace.py
"""

import shutil
from pathlib import Path

import torch

from specmd.compose import spec_of
from specmd.hook import install
from specmd.models.loader import ModelConfig, load_model
from specmd.replay.trace import TraceWriter

OUT = Path(__file__).resolve().parent / "embedded_trace"


def main():
    model, _ = load_model(ModelConfig(family="olmoe", pretrained="specmd:tiny-olmoe"))
    shutil.rmtree(OUT, ignore_errors=True)
    stack = install(model, spec_of(prefetch="none"))
    stack.writer = TraceWriter(OUT, stack.geom, stack.scoring, stack.store, depth=2,
                               source={"model": "specmd:tiny-olmoe", "recorded_by": "tests/data/record_embedded_trace.py"})
    g = torch.Generator().manual_seed(7)
    with torch.no_grad(), stack:
        for _ in range(2):
            ids = torch.randint(0, 4000, (1, 24), generator=g)
            model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    stack.writer.close()
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
