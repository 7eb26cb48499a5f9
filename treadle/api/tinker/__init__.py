"""The Tinker protocol's routes, bodies and wire format, so the official `tinker` SDK, its CLI
and tinker-cookbook run against Treadle unmodified.

Sessions and client bootstrap (`routes_sessions`), training (`routes_training`), sampling
(`routes_sampling`), futures (`routes_futures`, `routes_futures_extra`), checkpoints and their
sharing (`routes_checkpoints`, `routes_checkpoint_sharing`), billing (`routes_billing`), the
session listings (`routes_client_sessions`), the rest of the surface (`routes_extras`) and the
Hugging Face hub view of the tokenizers (`routes_hf`); their bodies (`schemas*`) and the
protobuf wire format (`wire`, with the SDK's schema loaded by `proto`).

Imports the shared `treadle.api` modules and `treadle.platform`; never another surface.
"""
