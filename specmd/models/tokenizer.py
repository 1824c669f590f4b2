"""A byte-level tokenizer built in code (no download): 256 byte tokens + <bos>, <eos>, <pad>.

Used by the random ``tiny_*`` models. Every string round-trips exactly.
"""

from __future__ import annotations

from functools import lru_cache

SPECIALS = ("<bos>", "<eos>", "<pad>")


@lru_cache(maxsize=1)
def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_order = sorted(alphabet)
    vocab = {ch: i for i, ch in enumerate(byte_order)}
    for i, tok in enumerate(SPECIALS):
        vocab[tok] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        model_max_length=2048,
    )
    return fast
