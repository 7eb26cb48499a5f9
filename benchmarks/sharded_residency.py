"""How much of a base model each rank of a sharded worker group holds after a forward, after a
training step and after a sample, and at each one's peak: its shard of every decoder layer and
its rows of the embeddings and head, the layers FSDP holds gathered, the vocabulary's weights
gathered for a lookup or the head, and the final norm, against the whole model;
and each rank's host memory while it loads the model, sampled every 2 ms above what it held
before: its own (resident anonymous) memory, and the pages of the model's file it maps (the page
cache: the kernel's, shared by every rank that maps the file, and reclaimable).

Two ranks (gloo on the CPU, one process each, torchrun's environment) run the engine in the
sharded layout, rank 0 driving through a `GroupExecutor` as a worker does. The model's files are
prepared first (SmolLM2's GGUF converted into the cache), so the ranks measure loading alone.
`--whole` loads as the engine did before `engine/models/weight_files.py`: the whole model into
each rank's host memory, then sharded.

`--untied` runs the model with its output head untied (a copy of the embedding), as models big
enough to shard keep it: a tied weight stays whole on every rank (`distributed.vocabulary`).

`--shape 8b` runs instead a random Llama in Llama 3.1 8B's proportions, small: 32 layers of hidden
256 (grouped-query attention 4:1, an MLP 3.5x wide, as 8B's) and a vocabulary of 8,000, so that
each vocabulary weight (embedding, head; untied) is the same share of the model as 8B's
(0.065): SmolLM2's vocabulary is a fifth of it, which no other model of the sizes sharding is
for comes near.

    python benchmarks/sharded_residency.py [--model NAME] [--whole] [--untied | --shape 8b]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.tiny_models, for --shape

MIB = 2**20


def resident_bytes() -> tuple[int, int]:
    """This process's resident (anonymous, file-backed) memory (`RssAnon`, `RssFile`): what it
    holds itself, and the pages of files it maps (the safetensors file read while loading: the
    page cache, shared by every process that maps the file, and reclaimable)."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) * 1024
    return fields["RssAnon"], fields["RssFile"]


class PeakRss:
    """This process's largest resident anonymous and file-backed memory while the block runs,
    sampled by a thread every `every_seconds`."""

    def __init__(self, every_seconds: float = 0.002) -> None:
        self.every = every_seconds

    def __enter__(self) -> PeakRss:
        import threading

        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self.before = self.peak = resident_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.after = resident_bytes()
        self._note(self.after)

    def _note(self, now: tuple[int, int]) -> None:
        self.peak = (max(self.peak[0], now[0]), max(self.peak[1], now[1]))

    def _sample(self) -> None:
        while not self._done.wait(self.every):
            self._note(resident_bytes())


def load_whole_as_before() -> None:
    """Have the engine load a sharded model as it did before reading it a layer at a time: the
    whole model into host memory, then sharded."""
    from treadle.engine import engine as engine_module
    from treadle.engine.models.loading import load_base_model

    def whole(info: Any, cache_dir: Path, device: Any, dtype: Any) -> Any:
        model, tokenizer = load_base_model(info, cache_dir, device, dtype, on_host=True)
        return model, tokenizer, None

    engine_module.load_deferred = whole  # type: ignore[attr-defined]


def resident(engine: Any, model_name: str, transient: int = 0) -> dict[str, float]:
    """This rank's bytes of the base model: layers' shards, layers held gathered, the rest
    (its rows of the embeddings and head, the final norm), plus `transient` bytes gathered
    outside FSDP (the vocabulary's), against the whole model's."""
    base = engine._bases[model_name]
    model = base.model
    layers = model.get_decoder().layers
    in_layers = {id(p) for p in layers.parameters()}
    size = next(model.parameters()).element_size()
    whole = base.parameters * size  # counted before sharding
    rest = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in in_layers)
    shards = gathered = 0
    for layer in layers:
        group = layer._get_fsdp_state()._fsdp_param_group
        for param in (fsdp.sharded_param for fsdp in group.fsdp_params):  # DTensors
            shards += param.to_local().numel() * param.element_size()
            if group.is_unsharded:  # the whole layer is held gathered too
                gathered += param.numel() * param.element_size()
    held = rest + shards + gathered + transient
    return {"whole_mib": whole / MIB, "held_mib": held / MIB, "fraction": held / whole}


class PeakHeld:
    """The most of the base model this rank holds while the block runs: `resident` at every
    moment it grows, i.e. each time FSDP has gathered a layer and each time the vocabulary's
    weights are gathered (`distributed.vocabulary`: the whole head, or a piece of a lookup)."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.engine, self.model_name = engine, model_name
        self.peak: dict[str, float] | None = None

    def note(self, transient: int = 0) -> None:
        now = resident(self.engine, self.model_name, transient)
        if self.peak is None or now["held_mib"] > self.peak["held_mib"]:
            self.peak = now

    def __enter__(self) -> PeakHeld:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        from treadle.engine.distributed.vocabulary import VocabRows

        self._patched = [
            (FSDPParamGroup, "wait_for_unshard", FSDPParamGroup.wait_for_unshard),
            (VocabRows, "whole", VocabRows.whole),
            (VocabRows, "row_pieces", VocabRows.row_pieces),
        ]
        wait, whole, pieces = (original for _, _, original in self._patched)
        peak = self

        def waited(group: Any, *args: Any, **kwargs: Any) -> Any:
            out = wait(group, *args, **kwargs)
            peak.note()
            return out

        def gathered_whole(rows: Any) -> Any:
            weight = whole(rows)
            peak.note(weight.numel() * weight.element_size())
            return weight

        def gathered_pieces(rows: Any) -> Any:
            for piece, blocks in pieces(rows):
                peak.note(piece.numel() * piece.element_size())
                yield piece, blocks

        FSDPParamGroup.wait_for_unshard = waited  # type: ignore[method-assign]
        VocabRows.whole = gathered_whole  # type: ignore[method-assign]
        VocabRows.row_pieces = gathered_pieces  # type: ignore[method-assign]
        self.note()
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in self._patched:
            setattr(owner, name, original)


UNTIED_NAME = "benchmark/untied"
SHAPE_8B_NAME = "benchmark/llama-8b-shape"


def write_8b_shape(into: Path) -> None:
    """A registrable folder: a random Llama in Llama 3.1 8B's proportions (see the module's
    docstring), with a small tokenizer trained here (tests/tiny_models.py)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.tiny_models import save_tokenizer

    tok: Any = save_tokenizer("bpe", into)
    hidden = 256
    config = LlamaConfig(
        vocab_size=8000,
        hidden_size=hidden,
        intermediate_size=hidden * 7 // 2,
        num_hidden_layers=32,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        eos_token_id=tok.convert_tokens_to_ids(tok.eos_token),
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(into))


def write_untied(folder: Path, into: Path, tokenizer_files: dict[str, bytes]) -> None:
    """The model in `folder` with its output head untied (a copy of the embedding as
    `lm_head.weight`, as models big enough to shard keep it: Llama 3.1 8B, Qwen3 8B) and its
    tokenizer, a folder to register."""
    import shutil

    from safetensors.torch import load_file, save_file

    into.mkdir(parents=True, exist_ok=True)
    for name, data in tokenizer_files.items():
        (into / name).write_bytes(data)
    for item in folder.iterdir():
        if item.name not in ("config.json", "model.safetensors"):
            shutil.copy(item, into / item.name)
    config = json.loads((folder / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (into / "config.json").write_text(json.dumps(config))
    tensors = load_file(folder / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, into / "model.safetensors", metadata={"format": "pt"})


def rank_main(
    model_name: str, cache_dir: Path, out: Path, whole: bool, folder: Path | None
) -> None:
    import numpy as np

    from treadle.engine import (
        Engine,
        EngineDatum,
        GroupExecutor,
        LoraSpec,
        SampleRequest,
        SamplingSpec,
        follow,
    )
    from treadle.engine.distributed import group as worker_group

    group = worker_group.init_from_env(timeout_seconds=600, device="cpu", layout="sharded")
    models: dict[str, Any] = {}
    if folder is not None:  # a folder written here, registered as `model_name`
        from treadle.platform.models import model_files

        models["models"] = {
            model_name: model_files.inspect_folder(model_name, folder, model_files.Options())
        }.__getitem__
    engine = Engine(cache_dir=cache_dir, device="cpu", parallel=group, **models)
    if whole:
        load_whole_as_before()
    engine.tokenizer(model_name)  # not part of loading the weights
    with PeakRss() as rss:  # every rank at once: sharding is a collective
        engine.load_base(model_name)
    base = engine._bases[model_name]
    whole_bytes = base.parameters * next(base.model.parameters()).element_size()
    loading = {
        "whole_mib": whole_bytes / MIB,
        "anon_peak_mib": (rss.peak[0] - rss.before[0]) / MIB,
        "anon_kept_mib": (rss.after[0] - rss.before[0]) / MIB,
        "file_peak_mib": (rss.peak[1] - rss.before[1]) / MIB,
        "file_kept_mib": (rss.after[1] - rss.before[1]) / MIB,
    }
    if not group.is_leader:
        out.with_suffix(f".rank{group.rank}").write_text(json.dumps(loading))
        follow(engine, group)
        worker_group.leave(engine)
        return
    leader = GroupExecutor(engine, group)
    try:
        leader.create_adapter("a", model_name, LoraSpec(rank=16, alpha=32.0, seed=1))
        rng = np.random.default_rng(0)
        tokens = rng.integers(1, min(49_000, engine.tokenizer(model_name).vocab_size), 257)
        data = [
            EngineDatum(
                tuple(int(t) for t in tokens[:-1]),
                {"target_tokens": tokens[1:].astype(np.int64), "weights": np.ones(256)},
            )
        ]
        result: dict[str, Any] = {"loading rank 0": loading}
        result["loaded"] = resident(engine, model_name)
        with PeakHeld(engine, model_name) as peak:
            leader.forward_backward("a", data, "cross_entropy", forward_only=True)
        result["after a forward"] = resident(engine, model_name)
        result["forward, at its peak"] = peak.peak
        with PeakHeld(engine, model_name) as peak:
            leader.forward_backward("a", data, "cross_entropy")
        result["after a training step"] = resident(engine, model_name)
        result["training, at its peak"] = peak.peak
        leader.snapshot("a", "s")
        request = SampleRequest(model_name, "s", (5, 6, 7), 2, SamplingSpec(max_tokens=8, seed=1))
        with PeakHeld(engine, model_name) as peak:
            leader.sample_batch([request])
        result["after a sample"] = resident(engine, model_name)
        result["sampling, at its peak"] = peak.peak
    finally:
        leader.close()
    out.write_text(json.dumps(result))


def main() -> int:
    from treadle.platform.embedded import free_port
    from treadle.platform.models.catalog import SMOLLM2_NAME

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=SMOLLM2_NAME)
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--whole", action="store_true", help="load as before: whole, then shard")
    parser.add_argument(
        "--untied", action="store_true", help="the model with its head untied (a copy)"
    )
    parser.add_argument(
        "--shape", choices=["8b"], default=None, help="a random Llama in 8B's proportions"
    )
    parser.add_argument("--folder", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rank-mode", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cache_dir = args.cache_dir or Path(tmp)
        if args.rank_mode:
            rank_main(args.model, cache_dir, args.out, args.whole, args.folder)
            return 0
        from treadle.engine.models.loading import model_dir
        from treadle.platform.models.catalog import get_base_model

        extra = ["--whole"] if args.whole else []
        if args.shape:
            args.model = SHAPE_8B_NAME
            write_8b_shape(Path(tmp) / "shape")
            extra += ["--folder", str(Path(tmp) / "shape")]
        elif (info := get_base_model(args.model)).kind == "gguf":
            folder = model_dir(info, cache_dir)  # converted once, before the ranks measure loading
            if args.untied:
                from treadle.platform.models.tokenizers import tokenizer_files

                untied = Path(tmp) / "untied"
                write_untied(folder, untied, tokenizer_files(info, cache_dir))
                extra += ["--folder", str(untied)]
                args.model = UNTIED_NAME
        elif args.untied:
            raise SystemExit("--untied needs a model converted from GGUF (SmolLM2)")
        out, port = Path(tmp) / "out.json", str(free_port())
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--rank-mode",
                    "--model",
                    args.model,
                    "--cache-dir",
                    str(cache_dir),
                    "--out",
                    str(out),
                    *extra,
                ],
                env={
                    **os.environ,
                    "RANK": str(rank),
                    "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": "2",
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": port,
                    "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
                },
            )  # fmt: skip
            for rank in range(2)
        ]
        if any(p.wait() for p in procs):
            raise SystemExit("a rank failed")
        results = json.loads(out.read_text())
        results["loading rank 1"] = json.loads(out.with_suffix(".rank1").read_text())
        for when in [w for w in results if w.startswith("loading")]:
            r = results.pop(when)
            whole = r["whole_mib"]
            print(
                f"{when:>22}: own memory peak {r['anon_peak_mib']:6.1f} MiB "
                f"({r['anon_peak_mib'] / whole:.2f}), kept {r['anon_kept_mib']:6.1f} "
                f"({r['anon_kept_mib'] / whole:.2f}); file pages mapped peak "
                f"{r['file_peak_mib']:6.1f} ({r['file_peak_mib'] / whole:.2f}), kept "
                f"{r['file_kept_mib']:6.1f} ({r['file_kept_mib'] / whole:.2f}); of a "
                f"{whole:.1f} MiB model"
            )
        for when, r in results.items():
            print(
                f"{when:>22}: rank 0 holds {r['held_mib']:7.1f} of {r['whole_mib']:7.1f} MiB "
                f"({r['fraction']:.2f} of the model)"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
