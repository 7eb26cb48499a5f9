"""A sharded group's embeddings and output head, split by vocabulary rows (`distributed.vocabulary`)
on gloo ranks: each rank keeps only its rows, and the model computes what the whole weights
compute, bit for bit (logits, and grads through the head), with a vocabulary the ranks do not
divide; a tied weight stays whole; ranks whose passes need different numbers of output-head chunks still pair
their gathers up when the chunks are planned for the largest pass."""

from __future__ import annotations

import copy
import datetime
import os
import socket
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests import architectures
from treadle.engine.distributed.vocabulary import ShardedEmbedding, ShardedHead, shard_vocabulary
from treadle.engine.losses.chunked_logprobs import target_logprobs

VOCAB = 1001  # not a multiple of 2 or 3: the last rank's rows end in padding


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _model(name: str, tied: bool) -> Any:
    cfg = architectures.config(name, vocab_size=VOCAB)
    cfg.tie_word_embeddings = tied
    torch.manual_seed(0)
    model = architectures.build(name, vocab_size=VOCAB, cfg=cfg).float().eval()
    model.requires_grad_(False)
    model.tie_weights()
    return model


def _rank(rank: int, world_size: int, port: int, out: dict[str, Any]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    timeout = datetime.timedelta(seconds=60)  # a rank whose gathers went unpaired fails
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)
    try:
        for name, tied in (("llama3", True), ("qwen3", False), ("mistral", False)):
            whole = _model(name, tied)
            sharded = copy.deepcopy(whole)
            rows = shard_vocabulary(sharded, dist.group.WORLD, None)
            if tied:  # stays whole (see vocabulary's docstring): nothing replaced
                out[f"{name} {rank} tied kept"] = not rows and not any(
                    isinstance(m, (ShardedEmbedding, ShardedHead)) for m in sharded.modules()
                )
                continue
            assert isinstance(sharded.get_input_embeddings(), ShardedEmbedding)
            assert isinstance(sharded.get_output_embeddings(), ShardedHead)
            held = sum(p.numel() for p in rows)
            vocab_weights = 2 * VOCAB * whole.config.hidden_size
            # each rank's own rows only (its share, rounded up), never the whole weights
            out[f"{name} {rank} held"] = (held, vocab_weights)
            # ranks run different batches (a sharded group's ranks compute different parts)
            generator = torch.Generator().manual_seed(rank)
            tokens = torch.randint(0, VOCAB, (1 + rank, 5 + 3 * rank), generator=generator)
            results = {}
            for label, model in (("whole", whole), ("sharded", sharded)):
                norm = model.get_decoder().norm.weight
                norm.requires_grad_(True)  # a grad that flows back through the head
                norm.grad = None
                logits = model(input_ids=tokens, use_cache=False).logits
                (logits.float().square().mean()).backward()
                results[label] = (logits.detach(), norm.grad.clone())
                norm.requires_grad_(False)
            same_logits = torch.equal(results["whole"][0], results["sharded"][0])
            same_grads = torch.equal(results["whole"][1], results["sharded"][1])
            out[f"{name} {rank} equal"] = (same_logits, same_grads)
            # chunked logprobs: this rank's pass needs 1 + rank chunks of 4 positions; planned
            # for the largest pass, every rank runs as many
            planned = max((1 + r) * (5 + 3 * r) for r in range(world_size))
            mask = torch.ones_like(tokens, dtype=torch.bool)
            picked = {}
            for label, model in (("whole", whole), ("sharded", sharded)):
                norm = model.get_decoder().norm.weight
                norm.requires_grad_(True)
                norm.grad = None
                lp = target_logprobs(
                    model, tokens, mask, tokens.roll(-1, 1), logits_per_chunk=4 * VOCAB,
                    plan_tokens=planned,
                )  # fmt: skip
                lp.sum().backward()
                picked[label] = (lp.detach(), norm.grad.clone())
                norm.requires_grad_(False)
            out[f"{name} {rank} chunked"] = (
                torch.equal(picked["whole"][0], picked["sharded"][0]),
                torch.equal(picked["whole"][1], picked["sharded"][1]),
            )
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_vocabulary_computes_what_the_whole_weights_do(world_size: int) -> None:
    out: dict[str, Any] = mp.Manager().dict()
    mp.spawn(_rank, args=(world_size, _free_port(), out), nprocs=world_size)
    for rank in range(world_size):
        assert out[f"llama3 {rank} tied kept"], rank
    for name in ("qwen3", "mistral"):
        for rank in range(world_size):
            held, whole = out[f"{name} {rank} held"]
            assert held <= whole / world_size + whole / VOCAB, (name, rank, held, whole)
            assert out[f"{name} {rank} equal"] == (True, True), (name, rank)
            assert out[f"{name} {rank} chunked"] == (True, True), (name, rank)
