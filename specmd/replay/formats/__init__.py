"""Import routing traces exported by other engines into specmd's in-memory :class:`~specmd.replay.trace.Trace`.

``load_import(path, fmt, opts)`` with ``fmt`` a registered format: ``FORMATS.names()``, one module each in
this package (``jsonl``, ``llama_csv``, ``npy``, ``vllm``: their docstrings describe the files they read).

Adding a format is one module: a parser that reads the file into :class:`Records` (sequence ordinal, token
key, model layer id and top-k expert ids per record; optional weights and logits; ``loc`` naming a record
for messages), registered under its name::

    from specmd.replay.formats import Records, register_format

    @register_format("myfmt")
    def parse(path, opts, notes) -> Records:  # opts: ImportOptions; notes: lines shown with the trace
        ...

Placed in this package it is found on first use; elsewhere, importing it registers it
(``FORMATS.unregister(name)`` removes it). ``replay.format=myfmt`` then replays it. Everything after the
parser is common to every format (:mod:`.build`): the checks below, the layout, the geometry.

Semantics (all formats but ``vllm``'s prompt): every (sequence, token) becomes one one-token forward pass, kind
0 (prefill) for the first token of its sequence and 1 (decode) for the others, context = the token's ordinal
within its sequence + 1 (the tokens present, so a capture starting at position 100 still has context 1 for
its first token; a note says so). Passes are ordered by sequence (first appearance in the file), then token
(position; first appearance for the headerless llama.cpp layout); within a pass, layers ascending. The
sorted distinct layer ids become MoE ordinals ``0..L-1`` (``geometry["layer_ids"]`` keeps the originals). A
(sequence, token) lacking a layer that others have is a missing cell: up to ``ImportOptions.max_missing`` of
all cells they are skipped (the pass has fewer calls) with a note in ``Trace.notes`` and a warning; above it
a :class:`~specmd.errors.ConfigError`. Every input error is a ``ConfigError`` naming the file and the line
(or record) number.

Degenerate captures (all formats) are flagged before anything replays, with what looks wrong: every token of
the file routed identically in every layer (a logging hook that wrote one buffer over and over: an error
from 16 tokens on, a warning below); a layer id absent from every token (a gap in the ids: a layer the hook
never saw); decode tokens lacking layers that prompt tokens have (hooks skipped under CUDA-graph replay:
capture with ``enforce_eager=True``) and sequences whose last token lacks layers (a capture that stopped
mid-forward), both named in the missing-cells note or error.
"""

from .base import FORMATS, ImportOptions, Records, register_format  # noqa: F401
from .build import build_trace, load_import  # noqa: F401
