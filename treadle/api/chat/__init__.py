"""Chat and text completions over a sample, shared by the surfaces that serve them: OpenAI's
request bodies (`schemas`), the answer and its server-sent event stream (`answers`) and the
admission and wait of one such request (`serving`). The OpenAI-compatible routes and SageMaker's
SampleTrainingSession call it; the Anthropic routes admit and wait through `serving` too. Imports platform only; never torch.
"""
