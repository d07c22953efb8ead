"""A byte-level tokenizer behind megatron's tokenizer interface, so megatron's datasets accept it.

Token ``i`` is the byte ``i`` of the UTF-8 text: a vocabulary of 256, the same as ``StdlibBytes``,
so a model trained on either corpus has the same shape. Megatron's ``GPTDataset`` needs two special
ids, the end of a document (``eod``, appended after each document when the corpus is written) and
padding (``pad``, masked out of the loss). Both are bytes that never occur in UTF-8 (``0xFF`` and
``0xFE``), so no text can produce them and they cost no extra vocabulary rows.

It implements ``megatron.core.tokenizers.MegatronTokenizerBase`` (``tokenize``, ``detokenize``,
``vocab``, ``vocab_size``, ``apply_chat_template``) and what megatron's datasets read besides
(``eod``, ``pad``, ``unique_identifiers``, which enter the hash naming the dataset's index cache).

Example::

    tok = ByteTokenizer()
    tok.tokenize("hé")          # [104, 195, 169]
    tok.detokenize([104, 195, 169, tok.eod])   # 'hé' (special ids are dropped)
"""

from __future__ import annotations

from collections import OrderedDict

from megatron.core.tokenizers import MegatronTokenizerBase

#: token ids are byte values
BYTE_VOCAB_SIZE = 256
#: end of document: the byte 0xFF, which no UTF-8 text contains
EOD_ID = 0xFF
#: padding: the byte 0xFE, which no UTF-8 text contains either
PAD_ID = 0xFE


class ByteTokenizer(MegatronTokenizerBase):
    """UTF-8 bytes as tokens, with ``eod`` and ``pad`` on the two bytes UTF-8 never uses."""

    def __init__(self) -> None:
        super().__init__(path="bytes", config={})

    # -------------------------------------------------------------- MegatronTokenizerBase
    def tokenize(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text`` (never ``eod`` or ``pad``)."""
        return list(text.encode("utf-8"))

    def detokenize(self, ids: list[int]) -> str:
        """The text of ``ids``; ``eod`` and ``pad`` are dropped, an invalid sequence is replaced."""
        return bytes(int(i) for i in ids if int(i) not in (EOD_ID, PAD_ID)).decode("utf-8", errors="replace")

    @property
    def vocab(self) -> dict[str, int]:
        """Each byte value's hex form (``"0x41"``) to its id."""
        return {f"0x{i:02x}": i for i in range(BYTE_VOCAB_SIZE)}

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB_SIZE

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError("ByteTokenizer has no chat template: it tokenizes plain text for pretraining")

    # ------------------------------------------------------------ what megatron's datasets read
    @property
    def eod(self) -> int:
        return EOD_ID

    @property
    def pad(self) -> int:
        return PAD_ID

    @property
    def unique_identifiers(self) -> OrderedDict:
        """Identifies the tokenizer in the description (and hash) of a dataset's cached indices."""
        return OrderedDict({"class": f"{type(self).__module__}.{type(self).__qualname__}",
                            "vocab_size": BYTE_VOCAB_SIZE, "eod": EOD_ID, "pad": PAD_ID})


__all__ = ["BYTE_VOCAB_SIZE", "ByteTokenizer", "EOD_ID", "PAD_ID"]
