"""OpenAI-compatible serving, without HTTP.

Owns what an OpenAI request's `model` names and the sampler that serves it (`openai_models`),
and prompts to token ids through the model's chat template, the Sample payload, and a result as
OpenAI choices, logprobs and usage (`openai_serving`).

May import the platform's top modules, `eventlog`, `models`, `tenancy`, `sessions`,
`checkpoints` and `operations`. Called by the API's OpenAI routes only.
"""
