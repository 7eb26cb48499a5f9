"""The published SageMaker training-sessions GSM8K GRPO example, as a user runs it: the official
`sagemaker-train` SDK, unmodified and unpatched, pointed at Treadle by the environment alone
(AWS_ENDPOINT_URL, an access key pair, AWS_REGION, HF_ENDPOINT for the tokenizer). Its loop is
the example's, call for call (reference/sagemaker-sdk-calls.md records them); only its data is
replaced, GSM8K by generated arithmetic word problems, and its base model by BASE_MODEL.

After the loop it makes the follow-up calls the example describes, then everything a test needs
to check them, and writes a JSON report to the path given as its argument. Run as a separate
process by tests/compat/test_sagemaker_example.py: nothing of Treadle is imported here.
"""

from __future__ import annotations

import json
import os
import random
import re
import sys

from sagemaker.train.training_session import (
    AdamParams,
    Datum,
    ModelInput,
    ModelPackageKind,
    SamplingParams,
    ServiceClient,
    TensorData,
)

BASE_MODEL = os.environ.get("BASE_MODEL", "openai/gpt-oss-20b")
ROLE_ARN = "arn:aws:iam::123456789012:role/SageMakerTrainingSessionsRole"
REGION = os.environ.get("AWS_REGION", "us-west-2")
MODEL_PACKAGE_GROUP_ARN = f"arn:aws:sagemaker:{REGION}:123456789012:model-package-group/gsm8k-grpo"
S3_OUTPUT_PATH = "s3://my-training-bucket/gsm8k-grpo"
SESSION_NAME = os.environ.get("SESSION_NAME", "gsm8k-grpo-demo")

NUM_STEPS = int(os.environ.get("NUM_STEPS", "2"))
BATCH_SIZE = int(os.environ.get("BATCH_SIZE", "2"))  # problems per step
GROUP_SIZE = int(os.environ.get("GROUP_SIZE", "2"))  # samples per problem
LEARNING_RATE = 1e-5


def word_problems(count: int, seed: int = 0) -> list[tuple[str, int]]:
    """GSM8K-style questions with integer answers, generated instead of downloaded."""
    rng = random.Random(seed)
    names = ["Ana", "Ben", "Chloe", "Dev", "Eli", "Fatima"]
    things = ["apples", "marbles", "stickers", "books", "coins"]
    problems = []
    for _ in range(count):
        name, thing = rng.choice(names), rng.choice(things)
        a, b, c = rng.randint(2, 20), rng.randint(2, 20), rng.randint(1, 5)
        question = (
            f"{name} has {a} {thing}. {name} buys {b} more, then gives away {c}. "
            f"How many {thing} does {name} have now?"
        )
        problems.append((question, a + b - c))
    return problems


def reward(completion: str, answer: int) -> float:
    numbers = re.findall(r"-?\d+", completion.split("####")[-1])
    return 1.0 if numbers and int(numbers[-1]) == answer else 0.0


def build_training_datum(prompt_tokens, completion_tokens, completion_logprobs, advantage):
    tokens = prompt_tokens + completion_tokens
    n_prompt = len(prompt_tokens) - 1
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": TensorData(data=tokens[1:]),
            "weights": TensorData(data=[0.0] * n_prompt + [1.0] * len(completion_tokens)),
            "logprobs": TensorData(data=[0.0] * n_prompt + list(completion_logprobs)),
            "advantages": TensorData(data=[0.0] * n_prompt + [advantage] * len(completion_tokens)),
        },
    )


def main(report_path: str) -> None:
    report: dict = {"steps": []}
    service_client = ServiceClient(role_arn=ROLE_ARN, region=REGION)
    report["base_models"] = service_client.list_base_models()
    training_client = service_client.create_lora_training_client(
        BASE_MODEL,
        training_session_name=SESSION_NAME,
        rank=32,
        alpha=64,
        model_package_group_arn=MODEL_PACKAGE_GROUP_ARN,
        s3_output_path=S3_OUTPUT_PATH,
    )
    tokenizer = training_client.get_tokenizer()
    sampling_client = training_client.create_sampling_client()
    sampling_params = SamplingParams(max_tokens=512, temperature=0.7, top_p=0.9)
    problems = word_problems(NUM_STEPS * BATCH_SIZE)

    def prompt_of(question: str) -> list[int]:
        messages = [{"role": "user", "content": f"{question} Give the final answer after ####."}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)

    last_samples = []
    for step in range(NUM_STEPS):
        batch = problems[step * BATCH_SIZE : (step + 1) * BATCH_SIZE]
        prompts = [prompt_of(question) for question, _ in batch]
        futures = [
            sampling_client.sample(
                ModelInput.from_ints(prompt),
                num_samples=GROUP_SIZE,
                sampling_params=sampling_params,
            )
            for prompt in prompts
        ]
        datums, rewards = [], []
        for (_, answer), prompt, future in zip(batch, prompts, futures, strict=True):
            result = future.result()
            group = [reward(tokenizer.decode(s.tokens), answer) for s in result.sequences]
            mean = sum(group) / len(group)
            rewards += group
            for sequence, r in zip(result.sequences, group, strict=True):
                datums.append(
                    build_training_datum(prompt, list(sequence.tokens), sequence.logprobs, r - mean)
                )
                last_samples.append((prompt, list(sequence.tokens), list(sequence.logprobs)))
        fwd_bwd = training_client.forward_backward(datums, loss_fn="ppo")
        optim = training_client.optim_step(AdamParams(learning_rate=LEARNING_RATE))
        fwd_bwd_result, optim_result = fwd_bwd.result(), optim.result()
        print(f"step {step}: reward {sum(rewards) / len(rewards):.2f}", fwd_bwd_result.metrics)
        sampling_client = training_client.save_weights_and_get_sampling_client()
        report["steps"].append(
            {
                "reward": sum(rewards) / len(rewards),
                "fb_metrics": fwd_bwd_result.metrics,
                "optim_metrics": optim_result.metrics,
                "datums": len(datums),
                "sampler": sampling_client.model_package_arn,
            }
        )

    # --- the follow-up calls the example describes ------------------------------------------
    prompt, completion, completion_logprobs = last_samples[-1]
    report["compute_logprobs"] = sampling_client.compute_logprobs(
        ModelInput.from_ints(prompt)
    ).result()
    with_prompt = sampling_client.sample(
        ModelInput.from_ints(prompt),
        num_samples=1,
        sampling_params=SamplingParams(max_tokens=512, temperature=0.7, seed=7),
        include_prompt_logprobs=True,
    ).result()
    report["prompt_logprobs"] = with_prompt.prompt_logprobs
    report["prompt"] = prompt
    tokens = prompt + completion
    forward = training_client.forward(
        [
            Datum(
                model_input=ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": TensorData(data=tokens[1:]),
                    "weights": TensorData(data=[1.0] * (len(tokens) - 1)),
                },
            )
        ],
        loss_fn="cross_entropy",
    ).result()
    report["forward_tokens"] = tokens
    report["forward_logprobs"] = forward.loss_fn_outputs[0]["logprobs"]["data"]
    report["merged_arn"] = (
        training_client.save_weights_for_sampler(merge_weights=True).result().model_package_arn
    )
    report["state_arn"] = training_client.save_state().result().model_package_arn

    # One more step on the uninterrupted session, then the same step on a session resumed from
    # the saved state: the test compares the two sessions' weights.
    resume_datums = [
        build_training_datum(p, c, lp, 1.0 if i % 2 == 0 else -1.0)
        for i, (p, c, lp) in enumerate(last_samples)
    ]
    training_client.forward_backward(resume_datums, loss_fn="ppo").result()
    training_client.optim_step(AdamParams(learning_rate=LEARNING_RATE)).result()
    training_client.stop()

    group = {"model_package_group_arn": MODEL_PACKAGE_GROUP_ARN}
    report["packages"] = [p.model_package_arn for p in service_client.list_model_packages(**group)]
    report["model_packages"] = [
        p.model_package_arn
        for p in service_client.list_model_packages(kind=ModelPackageKind.MODEL, **group)
    ]
    latest = service_client.get_latest_model_package(ModelPackageKind.CHECKPOINT, **group)
    report["latest_checkpoint"] = latest.model_package_arn if latest else None
    with service_client.create_training_client_from_state_with_optimizer(
        report["state_arn"],
        training_session_name=f"{SESSION_NAME}-resume",
        model_package_group_arn=MODEL_PACKAGE_GROUP_ARN,
        s3_output_path=S3_OUTPUT_PATH,
    ) as resumed:
        resumed.forward_backward(resume_datums, loss_fn="ppo").result()
        resumed.optim_step(AdamParams(learning_rate=LEARNING_RATE)).result()
        report["resumed_session"] = resumed.training_session_name
    report["sessions"] = [s.training_session_name for s in service_client.list_sessions()]
    service_client.delete_session(SESSION_NAME, stop_if_active=True)
    report["sessions_after_delete"] = [
        s.training_session_name for s in service_client.list_sessions()
    ]
    first_weights = report["steps"][0]["sampler"]
    deleted = service_client.delete_model_package(first_weights, delete_artifacts=True)
    again = service_client.delete_model_package(first_weights, delete_artifacts=True)
    report["deleted"] = [deleted.model_package_deleted, again.model_package_deleted]
    report["session_name"] = SESSION_NAME
    with open(report_path, "w") as out:
        json.dump(report, out)


if __name__ == "__main__":
    main(sys.argv[1])
