"""The recipes' shared layer: each module owns one thing and every recipe uses it, none copies it.

- options:     the command line every recipe takes (platform, client, model, run folder)
- connect:     a service client for the run: Treadle's SDK or the plain tinker SDK, on a running
               platform or on an embedded one started for the run
- runs:        the run folder: checkpoints (save_state) and --resume
- metrics:     per-step metrics as JSON lines, the progress bar, the learning-curve PNG
- chat:        chat rendering with the model's template, supervised and RL datums
- batching:    deterministic batches for step n (a resumed run sees the same data)
- advantages:  group-centred and per-token reverse-KL advantages
- evaluate:    concurrent sampling (one request per prompt, all in flight) and scoring
- envs:        environments (what the model sees, the reward, another turn or not), episodes,
               groups played turn by turn, and datums weighted on the model's own tokens
- rollouts:    a pool of rollout workers playing ahead of the trainer, with a staleness policy

Client code: imports `tinker`, `treadle` (the SDK) and the recipes' own modules, never the
platform's server side.
"""
