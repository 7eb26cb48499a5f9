"""Which of a base model's vocabulary-sized weights a sharded group splits by rows.

Owns `split_by_rows`: the input embedding and the output head that `distributed.vocabulary`
shards (each rank keeping a share of the rows) and the admission footprint counts so: a plain
`nn.Embedding` and a bias-free `nn.Linear` to the vocabulary, unless they are one tied weight,
which stays whole (why, with the numbers: `distributed.vocabulary`).
Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

from torch import nn

__all__ = ["split_by_rows"]


def split_by_rows(model: nn.Module) -> tuple[nn.Embedding | None, nn.Linear | None]:
    """`model`'s input embedding and output head where a sharded group splits them by
    vocabulary rows (None for one it keeps whole). A head wrapped by LoRA (kept as `base`)
    counts as its linear."""
    get_in, get_out = model.get_input_embeddings, model.get_output_embeddings
    embedding = get_in() if callable(get_in) else None
    head = get_out() if callable(get_out) else None
    base = getattr(head, "base", None)
    head = base if isinstance(base, nn.Linear) else head
    tied = (
        isinstance(embedding, nn.Module)
        and isinstance(head, nn.Module)
        and getattr(head, "weight", None) is getattr(embedding, "weight", object())
    )
    if tied:
        return None, None
    plain_embedding = type(embedding) is nn.Embedding and embedding.max_norm is None
    plain_head = type(head) is nn.Linear and head.bias is None
    return (
        embedding if plain_embedding else None,  # type: ignore[return-value]
        head if plain_head else None,  # type: ignore[return-value]
    )
