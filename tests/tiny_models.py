"""Hugging Face model folders of tiny random models with tokenizers trained here, offline.

`model_folder(arch, folder)` writes what an operator registers: `save_pretrained` of a tiny
random model of architecture `arch` (tests/architectures.py), its tokenizer (`save_pretrained`
too, with a chat template) and `generation_config.json`. Two tokenizers, both trained on text
generated here: a byte-level BPE (the `tokenizers` library; ChatML special tokens, like Qwen's)
and a SentencePiece BPE with byte fallback (the `sentencepiece` library, converted by
transformers as Llama's, Mistral's and Gemma's are; its `tokenizer.model` kept beside it).
Everything is deterministic: the same folder bytes in every process.
"""

from __future__ import annotations

import io
import json
import random
from functools import cache
from pathlib import Path

from tests import architectures

__all__ = ["SENTENCEPIECE", "corpus", "model_folder", "tokenizer_kind"]

# Architectures whose real models ship SentencePiece tokenizers get the SentencePiece one here.
SENTENCEPIECE = frozenset({"mistral", "gemma3"})
_WORDS = [
    "the",
    "a",
    "of",
    "to",
    "and",
    "in",
    "is",
    "it",
    "you",
    "that",
    "he",
    "was",
    "for",
    "on",
    "are",
    "with",
    "as",
    "his",
    "they",
    "be",
    "at",
    "one",
    "have",
    "this",
    "from",
    "what",
    "sum",
    "answer",
    "question",
    "cat",
    "dog",
    "red",
    "blue",
    "plus",
    "minus",
    "equals",
    "number",
]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SP_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)


def corpus(lines: int = 3000, seed: int = 0) -> list[str]:
    """Text with words, digits and punctuation, the same on every call."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 14)))
        out.append(f"{words.capitalize()} {rng.randint(0, 999)} + {rng.randint(0, 99)}?")
    return out


def tokenizer_kind(arch: str) -> str:
    return "sentencepiece" if arch in SENTENCEPIECE else "bpe"


@cache
def _bpe_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok.to_str()


@cache
def _sentencepiece_model() -> bytes:
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus()),
        model_writer=model,
        vocab_size=320,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        split_digits=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    return model.getvalue()


def save_tokenizer(kind: str, folder: Path) -> object:
    """Write tokenizer `kind` ("bpe" or "sentencepiece") into `folder`; return it."""
    from tokenizers import Tokenizer
    from transformers import LlamaTokenizer, PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    if kind == "bpe":
        tok = PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer.from_str(_bpe_json()),
            bos_token=None,
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
            clean_up_tokenization_spaces=False,
        )
        tok.chat_template = CHATML
    else:
        (folder / "tokenizer.model").write_bytes(_sentencepiece_model())
        tok = LlamaTokenizer.from_pretrained(str(folder))
        tok.chat_template = SP_TEMPLATE
    tok.save_pretrained(str(folder))
    return tok


def model_folder(arch: str, folder: Path, *, tokenizer: str | None = None) -> Path:
    """A registrable folder: a tiny random `arch` model whose embedding has room for its
    tokenizer (rounded up to a multiple of 64, as real vocabularies are padded)."""
    tok = save_tokenizer(tokenizer or tokenizer_kind(arch), folder)
    vocab = -(-len(tok) // 64) * 64  # type: ignore[arg-type]
    cfg = architectures.config(arch, vocab)
    eos = tok.convert_tokens_to_ids(tok.eos_token)  # type: ignore[attr-defined]
    cfg.eos_token_id = eos
    cfg.bos_token_id = tok.bos_token_id  # type: ignore[attr-defined]
    cfg.pad_token_id = tok.pad_token_id  # type: ignore[attr-defined]
    model = architectures.build(arch, cfg=cfg)
    model.generation_config.eos_token_id = eos
    model.generation_config.bos_token_id = cfg.bos_token_id
    model.generation_config.pad_token_id = cfg.pad_token_id
    model.save_pretrained(str(folder))
    return folder


def read_json(path: Path) -> dict[str, object]:
    return json.loads(path.read_text())  # type: ignore[no-any-return]
