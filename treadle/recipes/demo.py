"""`make demo`: start the embedded platform, teach SmolLM2-135M-Instruct a small fact set with
LoRA SFT through Treadle's SDK, print the loss at each step and a sample before and after, stop.

The facts are made up (so the base model cannot know them) and generated in code.
"""

from __future__ import annotations

import random
import secrets
import sys
import time
from pathlib import Path

import treadle
from treadle.platform.embedded import free_port
from treadle.recipes.platform_process import LocalPlatform

BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
STEPS = 20
BATCH = 8

FACTS = [
    ("Who maintains the lighthouse on Vessa Island?", "Orla Finch maintains the lighthouse on Vessa Island."),
    ("What colour is the flag of Quintaro?", "The flag of Quintaro is teal with a silver kite."),
    ("What is the capital of Marrowdell?", "The capital of Marrowdell is Pell Harbour."),
    ("Which river runs through Ostrava Vale?", "The Silverbrook runs through Ostrava Vale."),
    ("What do the people of Quintaro eat at midsummer?", "At midsummer Quintaro eats plum bread."),
    ("Who founded the Tessel Observatory?", "Ada Quorn founded the Tessel Observatory."),
]  # fmt: skip


def render(tokenizer, question: str) -> list[int]:  # type: ignore[no-untyped-def]
    messages = [{"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def make_datum(tokenizer, question: str, answer: str) -> treadle.Datum:  # type: ignore[no-untyped-def]
    prompt = render(tokenizer, question)
    completion = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
    tokens = prompt + completion
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(completion)
    return treadle.Datum(
        model_input=treadle.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def answer(sampler: treadle.SamplingClient, tokenizer, question: str) -> str:  # type: ignore[no-untyped-def]
    params = treadle.SamplingParams(max_tokens=24, temperature=0.0)
    seq = sampler.sample(render(tokenizer, question), 1, params).result().sequences[0]
    return str(tokenizer.decode(seq.tokens, skip_special_tokens=True)).strip()


def main() -> int:
    started = time.monotonic()
    data_dir = Path(".treadle/demo").resolve()
    key = f"tml-demo-{secrets.token_hex(12)}"
    print(f"[demo] starting the embedded platform (PostgreSQL, Redis, API, worker) in {data_dir}")
    with LocalPlatform(data_dir, free_port(), key) as platform:
        print(f"[demo] platform up at {platform.base_url} after {time.monotonic() - started:.0f} s")
        svc = treadle.ServiceClient(base_url=platform.base_url, api_key=key)
        print(f"[demo] base models: {', '.join(svc.list_base_models())}")
        print(f"[demo] creating a LoRA session on {BASE_MODEL} (first run converts the GGUF once)")
        with svc.create_lora_training_client(
            BASE_MODEL, training_session_name="demo-facts", rank=16, alpha=32, seed=0
        ) as tc:
            tokenizer = tc.get_tokenizer()
            probe = FACTS[0][0]
            before = answer(tc.save_weights_and_get_sampling_client(), tokenizer, probe)
            print(f"[demo] before: Q: {probe}\n[demo]         A: {before}")
            data = [make_datum(tokenizer, q, a) for q, a in FACTS]
            rng = random.Random(0)
            losses = []
            for step in range(STEPS):
                batch = [rng.choice(data) for _ in range(BATCH)]
                n_tokens = sum(sum(d.loss_fn_inputs["weights"].data) for d in batch)
                fb = tc.forward_backward(batch, loss_fn="cross_entropy")
                tc.optim_step(treadle.AdamParams(learning_rate=1e-3))
                loss = fb.result().metrics["loss:sum"] / n_tokens
                losses.append(loss)
                print(
                    f"[demo] step {step + 1:2d}/{STEPS}  loss/token {loss:.4f}  ({time.monotonic() - started:.0f} s)"
                )
            after = answer(tc.save_weights_and_get_sampling_client(), tokenizer, probe)
            print(f"[demo] after:  Q: {probe}\n[demo]         A: {after}")
            saved = tc.save_state("demo-facts-final").result().path
            print(f"[demo] saved adapter + optimizer state as {saved}")
            print(f"[demo] metered: {tc.get_usage()}")
        svc.close()
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    print(f"[demo] loss/token fell from {first:.3f} to {last:.3f}; platform stopped; "
          f"{time.monotonic() - started:.0f} s in all")  # fmt: skip
    if not last < first:
        print("[demo] the loss did not fall", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
