"""The database schema, as SQLAlchemy Core tables.

Alembic migrations (`migrations/versions`) are the only way the schema changes; a test checks
that these tables and the migrations never drift. Imports nothing from api, engine, worker or torch.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB

metadata = sa.MetaData()

NOW = sa.text("now()")

# A disabled tenant's keys are refused (403) until the operator enables it again.
tenants = sa.Table(
    "tenants",
    metadata,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("name", sa.Text, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    sa.Column("disabled_at", sa.DateTime(timezone=True)),
)

# An API key `tml-<public id>-<secret>`: only the SHA-256 of the whole key is stored. `created_by`
# and `revoked_by` are key ids (None for a key seeded from TREADLE_ADMIN_KEY); `last_used_at` is
# refreshed at most once a minute.
api_keys = sa.Table(
    "api_keys",
    metadata,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("tenant_id", sa.Text, sa.ForeignKey("tenants.id"), nullable=False),
    sa.Column("secret_hash", sa.Text, nullable=False),
    sa.Column("role", sa.Text, nullable=False),
    sa.Column("name", sa.Text),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    sa.Column("created_by", sa.Text),
    sa.Column("last_used_at", sa.DateTime(timezone=True)),
    sa.Column("revoked_at", sa.DateTime(timezone=True)),
    sa.Column("revoked_by", sa.Text),
    # A key minted with an AWS-style access key pair (`treadle keys create --aws`, migration
    # 0012) for SigV4-signed requests: the access key id, and the secret access key encrypted
    # under the operator's TREADLE_SECRETS_KEY (SigV4 needs the secret itself, not a hash).
    sa.Column("access_key_id", sa.Text),
    sa.Column("secret_ciphertext", sa.Text),
    sa.CheckConstraint("role IN ('operator', 'admin', 'member')", name="ck_api_keys_role"),
    sa.Index("uq_api_keys_secret_hash", "secret_hash", unique=True),
    sa.Index("ix_api_keys_tenant", "tenant_id"),
    sa.Index(
        "uq_api_keys_access_key_id",
        "access_key_id",
        unique=True,
        postgresql_where=sa.text("access_key_id IS NOT NULL"),
    ),
)

# A client session (Tinker `create_session`): groups the training and sampling sessions that
# one ServiceClient opens, and carries its heartbeat.
client_sessions = sa.Table(
    "client_sessions",
    metadata,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("tenant_id", sa.Text, sa.ForeignKey("tenants.id"), nullable=False),
    sa.Column("tags", JSONB, nullable=False, server_default=sa.text("'[]'::jsonb")),
    sa.Column("user_metadata", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    sa.Column("created_by", sa.Text),  # the key that opened it: its owner in listings
    sa.Column("display_name", sa.Text),  # the SDK's label for it (not unique)
    sa.Index("ix_client_sessions_tenant_created", "tenant_id", "created_at"),
)

workers = sa.Table(
    "workers",
    metadata,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("started_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    sa.Column("info", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
)

# A session: one event stream. `training` = base model + LoRA adapter (a Tinker model id
# "<client session>:train:<n>"); `sampling` = a base-model sampler with no adapter.
sessions = sa.Table(
    "sessions",
    metadata,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("tenant_id", sa.Text, sa.ForeignKey("tenants.id"), nullable=False),
    sa.Column("client_session_id", sa.Text, sa.ForeignKey("client_sessions.id"), nullable=False),
    sa.Column("kind", sa.Text, nullable=False),
    sa.Column("name", sa.Text),
    sa.Column("base_model", sa.Text, nullable=False),
    sa.Column("lora_config", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    sa.Column("user_metadata", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    sa.Column("model_package_group", sa.Text),
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("worker_id", sa.Text),
    sa.Column("lease_epoch", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("last_applied_seq", sa.BigInteger, nullable=False, server_default="-1"),
    sa.Column("last_event_seq", sa.BigInteger, nullable=False, server_default="0"),
    # Metering: the session's spend cap (max_cost_usd at creation), what it spent, what it holds.
    sa.Column("max_cost_micro_usd", sa.BigInteger),
    sa.Column("spent_micro_usd", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("reserved_micro_usd", sa.BigInteger, nullable=False, server_default="0"),
    # A replay or fork: built from this session's log up to this seq_id (NULL: an ordinary one).
    sa.Column("source_session_id", sa.Text),
    sa.Column("source_seq", sa.BigInteger),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    sa.Index("ix_sessions_tenant", "tenant_id"),
    sa.Index("ix_sessions_worker", "worker_id"),
    sa.Index("ix_sessions_source", "source_session_id"),
    sa.Index("ix_sessions_tenant_created", "tenant_id", "created_at"),
)

events = sa.Table(
    "events",
    metadata,
    sa.Column("position", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("session_id", sa.Text, nullable=False),
    sa.Column("seq", sa.BigInteger, nullable=False),
    sa.Column("type", sa.Text, nullable=False),
    sa.Column("data", JSONB, nullable=False),
    sa.Column("blob_key", sa.Text),
    sa.Column("tenant_id", sa.Text, nullable=False),
    sa.Column("actor", sa.Text),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    sa.UniqueConstraint("session_id", "seq", name="uq_events_session_seq"),
)

samplers = sa.Table(
    "samplers",
    metadata,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("tenant_id", sa.Text, sa.ForeignKey("tenants.id"), nullable=False),
    sa.Column("client_session_id", sa.Text, sa.ForeignKey("client_sessions.id"), nullable=False),
    sa.Column("session_id", sa.Text, sa.ForeignKey("sessions.id"), nullable=False),
    sa.Column("base_model", sa.Text, nullable=False),
    sa.Column("snapshot_id", sa.Text),
    sa.Column("model_path", sa.Text),
    sa.Column("checkpoint_prefix", sa.Text),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    # clones that joined it (join_sampling_session); the original client is 0
    sa.Column("clients_joined", sa.BigInteger, nullable=False, server_default="0"),
    # the next seq_id of an OpenAI-compatible route's sampler (platform/openai_models)
    sa.Column("next_seq_id", sa.BigInteger, nullable=False, server_default="0"),
)

# Projection: one row per requested operation. Training operations are keyed by
# (session_id, seq_id); sample operations by (sampler_id, seq_id).
operations = sa.Table(
    "operations",
    metadata,
    sa.Column("request_id", sa.Text, primary_key=True),
    sa.Column("tenant_id", sa.Text, nullable=False),
    sa.Column("session_id", sa.Text, sa.ForeignKey("sessions.id"), nullable=False),
    sa.Column("sampler_id", sa.Text),
    sa.Column("seq_id", sa.BigInteger, nullable=False),
    sa.Column("type", sa.Text, nullable=False),
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("payload_hash", sa.Text, nullable=False),
    sa.Column("request_position", sa.BigInteger, nullable=False),
    sa.Column("result", JSONB),
    sa.Column("error", JSONB),
    sa.Column("state", JSONB),  # state hashes recorded when a state-changing operation completed
    sa.Column("actor", sa.Text),  # the key that requested it (billed on its usage row)
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    sa.Column("completed_at", sa.DateTime(timezone=True)),
    sa.Index(
        "uq_operations_training_seq",
        "session_id",
        "seq_id",
        unique=True,
        postgresql_where=sa.text("sampler_id IS NULL"),
    ),
    sa.Index(
        "uq_operations_sample_seq",
        "sampler_id",
        "seq_id",
        unique=True,
        postgresql_where=sa.text("sampler_id IS NOT NULL"),
    ),
    # The few pending rows, for the lease keeper's stalled-operation check, the workers' queue
    # depth and `treadle status` (migration 0008).
    sa.Index(
        "ix_operations_pending",
        "session_id",
        "created_at",
        postgresql_where=sa.text("status = 'pending'"),
    ),
)

# Projection: every saved checkpoint, registered as a version of its model package group.
checkpoints = sa.Table(
    "checkpoints",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("tenant_id", sa.Text, sa.ForeignKey("tenants.id"), nullable=False),
    sa.Column("session_id", sa.Text, sa.ForeignKey("sessions.id"), nullable=False),
    sa.Column("kind", sa.Text, nullable=False),
    sa.Column("name", sa.Text, nullable=False),
    sa.Column("tinker_path", sa.Text, nullable=False),
    sa.Column("storage_prefix", sa.Text, nullable=False),
    sa.Column("model_package_group", sa.Text, nullable=False),
    sa.Column("version", sa.BigInteger, nullable=False),
    sa.Column("size_bytes", sa.BigInteger, nullable=False),
    sa.Column("has_optimizer", sa.Boolean, nullable=False),
    sa.Column("is_merged", sa.Boolean, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    sa.Column("expires_at", sa.DateTime(timezone=True)),
    sa.Column("deleted_at", sa.DateTime(timezone=True)),
    # published (NULL: private): readable by any tenant's keys (migrations/versions/0007)
    sa.Column("published_at", sa.DateTime(timezone=True)),
    sa.Column("published_by", sa.Text),
    # made by copy_weights: the source path and the request's idempotency key
    sa.Column("copied_from", sa.Text),
    sa.Column("copy_request_key", sa.Text),
    # what the save said of itself (SageMaker's saveWeights/saveState `description`)
    sa.Column("description", sa.Text),
    sa.Index("ix_checkpoints_tenant", "tenant_id"),
    sa.Index(
        "uq_checkpoints_copy_request",
        "tenant_id",
        "copy_request_key",
        unique=True,
        postgresql_where=sa.text("copy_request_key IS NOT NULL"),
    ),
    sa.Index(
        "uq_checkpoints_live_path",
        "tinker_path",
        unique=True,
        postgresql_where=sa.text("deleted_at IS NULL"),
    ),
    sa.UniqueConstraint(
        "tenant_id", "model_package_group", "version", name="uq_checkpoints_version"
    ),
)

# Model package groups a tenant created by name (SageMaker's CreateModelPackageGroup, or the first
# SageMaker training session naming one); checkpoints name their group by text, so a group a
# Tinker session's saves made exists without a row (migration 0012).
model_package_groups = sa.Table(
    "model_package_groups",
    metadata,
    sa.Column("tenant_id", sa.Text, sa.ForeignKey("tenants.id"), primary_key=True),
    sa.Column("name", sa.Text, primary_key=True),
    sa.Column("description", sa.Text),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    sa.Column("created_by", sa.Text),
)

# Projection: the platform's own checkpoints of a session, from which recovery starts. `kind` is
# "auto" (every N optimizer steps) or "loaded" (a copy of a checkpoint the session loaded).
auto_checkpoints = sa.Table(
    "auto_checkpoints",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("tenant_id", sa.Text, sa.ForeignKey("tenants.id"), nullable=False),
    sa.Column("session_id", sa.Text, sa.ForeignKey("sessions.id"), nullable=False),
    sa.Column("seq_id", sa.BigInteger, nullable=False),
    sa.Column("kind", sa.Text, nullable=False),
    sa.Column("storage_prefix", sa.Text, nullable=False),
    sa.Column("state", JSONB, nullable=False),
    sa.Column("size_bytes", sa.BigInteger, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    sa.Column("deleted_at", sa.DateTime(timezone=True)),
    sa.Index(
        "uq_auto_checkpoints_live_seq",
        "session_id",
        "seq_id",
        unique=True,
        postgresql_where=sa.text("deleted_at IS NULL"),
    ),
)

# Download tokens of a client session's trace export (only a token's SHA-256 is stored).
trace_exports = sa.Table(
    "trace_exports",
    metadata,
    sa.Column("token_hash", sa.Text, primary_key=True),
    sa.Column("tenant_id", sa.Text, sa.ForeignKey("tenants.id"), nullable=False),
    sa.Column("client_session_id", sa.Text, sa.ForeignKey("client_sessions.id"), nullable=False),
    sa.Column("created_by", sa.Text),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
)

# One-hour tokens of external weights download links (only a token's SHA-256 is stored).
checkpoint_downloads = sa.Table(
    "checkpoint_downloads",
    metadata,
    sa.Column("token_hash", sa.Text, primary_key=True),
    sa.Column("tenant_id", sa.Text, sa.ForeignKey("tenants.id"), nullable=False),
    sa.Column("checkpoint_id", sa.BigInteger, sa.ForeignKey("checkpoints.id"), nullable=False),
    sa.Column("created_by", sa.Text),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
)

# seq_ids whose request was refused at admission: the worker moves past them without waiting.
refused_seqs = sa.Table(
    "refused_seqs",
    metadata,
    sa.Column("session_id", sa.Text, sa.ForeignKey("sessions.id"), primary_key=True),
    sa.Column("seq_id", sa.BigInteger, primary_key=True),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
)

# A sample requested with record_stability_info (migration 0010): its sequences
# `<request_id>:<i>` may be named by training data's provenance. The sequences themselves are the
# sample operation's result (`operations.result`); this row says who owns them (the training
# session whose weights were sampled, NULL for a base model; then the client session's
# training sessions may use them), with which weights, and until when they may be used: each use
# moves `expires_at` to now + TREADLE_RECORDED_SAMPLE_TTL_SECONDS.
recorded_samples = sa.Table(
    "recorded_samples",
    metadata,
    sa.Column("request_id", sa.Text, primary_key=True),
    sa.Column("tenant_id", sa.Text, sa.ForeignKey("tenants.id"), nullable=False),
    sa.Column("session_id", sa.Text, sa.ForeignKey("sessions.id")),
    sa.Column("client_session_id", sa.Text, sa.ForeignKey("client_sessions.id"), nullable=False),
    sa.Column("sampler_id", sa.Text, nullable=False),
    sa.Column("snapshot_id", sa.Text),
    sa.Column("model_path", sa.Text),
    sa.Column("weights_seq", sa.BigInteger),  # the save_weights_for_sampler that wrote them
    sa.Column("prompt", JSONB, nullable=False),
    sa.Column("num_samples", sa.Integer, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    sa.Index("ix_recorded_samples_expires", "expires_at"),
)

# --- SageMaker's training-session API (see migrations/versions/0012_sagemaker.py) ------------

# A training session created through SageMaker's CreateTrainingSession: its name (unique among
# the tenant's undeleted ones; the runtime addresses the session by it) and the request's
# attributes Describe echoes (RoleArn, OutputConfig, VpcConfig, Tags, the base model's ARN).
sagemaker_sessions = sa.Table(
    "sagemaker_sessions",
    metadata,
    sa.Column("session_id", sa.Text, sa.ForeignKey("sessions.id"), primary_key=True),
    sa.Column("tenant_id", sa.Text, sa.ForeignKey("tenants.id"), nullable=False),
    sa.Column("name", sa.Text, nullable=False),
    sa.Column("attributes", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    sa.Column("deleted_at", sa.DateTime(timezone=True)),
    sa.Index(
        "uq_sagemaker_sessions_live_name",
        "tenant_id",
        "name",
        unique=True,
        postgresql_where=sa.text("deleted_at IS NULL"),
    ),
)

# An operation submitted through SageMaker's runtime: the operation it was there (forward,
# forwardBackward, ..., computeLogprobs) and the client token that makes a resubmission answer
# the same operation id.
sagemaker_operations = sa.Table(
    "sagemaker_operations",
    metadata,
    sa.Column("request_id", sa.Text, sa.ForeignKey("operations.request_id"), primary_key=True),
    sa.Column("session_id", sa.Text, sa.ForeignKey("sessions.id"), nullable=False),
    sa.Column("kind", sa.Text, nullable=False),
    sa.Column("client_token", sa.Text),
    sa.Index(
        "uq_sagemaker_operations_token",
        "session_id",
        "client_token",
        unique=True,
        postgresql_where=sa.text("client_token IS NOT NULL"),
    ),
)

# --- metering (see migrations/versions/0005_metering.py) --------------------------------------

# USD per million tokens, as integer micro-dollars, per base model and token class; a row takes
# effect at `effective_from`, and the newest in effect at a moment is the price then.
prices = sa.Table(
    "prices",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("base_model", sa.Text, nullable=False),
    sa.Column("token_class", sa.Text, nullable=False),
    sa.Column("micro_usd_per_million", sa.BigInteger, nullable=False),
    sa.Column("effective_from", sa.DateTime(timezone=True), nullable=False),
    sa.Column("created_by", sa.Text),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    sa.CheckConstraint("micro_usd_per_million >= 0", name="ck_prices_not_negative"),
    sa.CheckConstraint(
        "token_class IN ('prefill', 'sample', 'train')", name="ck_prices_token_class"
    ),
    sa.Index("ix_prices_model_class_from", "base_model", "token_class", "effective_from"),
)

# The ledger: one row per completed operation, written in its settlement's transaction.
usage = sa.Table(
    "usage",
    metadata,
    sa.Column("request_id", sa.Text, primary_key=True),
    sa.Column("tenant_id", sa.Text, nullable=False),
    sa.Column("session_id", sa.Text, nullable=False),
    sa.Column("sampler_id", sa.Text),
    sa.Column("actor", sa.Text),
    sa.Column("base_model", sa.Text, nullable=False),
    sa.Column("op_type", sa.Text, nullable=False),
    sa.Column("prefill_tokens", sa.BigInteger, nullable=False),
    sa.Column("prefill_price", sa.BigInteger),  # micro-USD per million; NULL: unpriced
    sa.Column("prefill_micro_usd", sa.BigInteger, nullable=False),
    sa.Column("sample_tokens", sa.BigInteger, nullable=False),
    sa.Column("sample_price", sa.BigInteger),  # micro-USD per million; NULL: unpriced
    sa.Column("sample_micro_usd", sa.BigInteger, nullable=False),
    sa.Column("train_tokens", sa.BigInteger, nullable=False),
    sa.Column("train_price", sa.BigInteger),  # micro-USD per million; NULL: unpriced
    sa.Column("train_micro_usd", sa.BigInteger, nullable=False),
    sa.Column("cost_micro_usd", sa.BigInteger, nullable=False),
    sa.Column("unpriced", sa.Boolean, nullable=False),  # a token class had no price: billed at 0
    sa.Column("completed_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    sa.Index("ix_usage_tenant_completed", "tenant_id", "completed_at"),
    sa.Index("ix_usage_session", "session_id"),
)

# What admitted operations may still cost, held until they settle, fail or are stopped.
reservations = sa.Table(
    "reservations",
    metadata,
    sa.Column("request_id", sa.Text, primary_key=True),
    sa.Column("tenant_id", sa.Text, nullable=False),
    sa.Column("session_id", sa.Text, nullable=False),
    sa.Column("month", sa.Date, nullable=False),
    sa.Column("micro_usd", sa.BigInteger, nullable=False),
    sa.Column("tokens", sa.BigInteger, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    sa.Index("ix_reservations_session", "session_id"),
)

# Per tenant and calendar month (UTC): settled and reserved spend; every admission locks it.
tenant_months = sa.Table(
    "tenant_months",
    metadata,
    sa.Column("tenant_id", sa.Text, primary_key=True),
    sa.Column("month", sa.Date, primary_key=True),
    sa.Column("settled_micro_usd", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("settled_tokens", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("reserved_micro_usd", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("reserved_tokens", sa.BigInteger, nullable=False, server_default="0"),
)

# Per tenant limits; a missing row or a NULL column is no limit.
quotas = sa.Table(
    "quotas",
    metadata,
    sa.Column("tenant_id", sa.Text, sa.ForeignKey("tenants.id"), primary_key=True),
    sa.Column("monthly_micro_usd", sa.BigInteger),
    sa.Column("monthly_tokens", sa.BigInteger),
    sa.Column("max_sessions", sa.Integer),
    sa.Column("requests_per_second", sa.Float),
    sa.Column("max_request_tokens", sa.BigInteger),
    sa.Column("updated_by", sa.Text),
    sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
)

# --- the model registry (see migrations/versions/0011_base_models.py) --------------------------

# Base models the operator registered (the built-ins are not rows): `info` is the registry entry
# (platform/models/catalog.py BaseModelInfo.to_json), written once; retiring one stops new
# sessions on it. A projection of the BaseModelRegistered / BaseModelRetired events.
base_models = sa.Table(
    "base_models",
    metadata,
    sa.Column("name", sa.Text, primary_key=True),
    sa.Column("info", JSONB, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    sa.Column("created_by", sa.Text),
    sa.Column("retired_at", sa.DateTime(timezone=True)),
    sa.Column("retired_by", sa.Text),
)
