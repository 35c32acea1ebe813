# pytgi on a CUDA runtime image: `docker run --gpus all --shm-size 1g -p 8080:80 -v $PWD/data:/data pytgi`
# serves the bundled demo model; add `--model-id org/name` (or -e MODEL_ID=...) for a Hub model,
# downloaded once into the /data volume.
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv curl ca-certificates \
    && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/pytgi
ENV PATH=/opt/pytgi/bin:$PATH

WORKDIR /src
# Dependencies first, so code edits rebuild only the last layers.
COPY pyproject.toml README.md ./
RUN pip install --upgrade pip \
    && python3 -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies']['cuda']))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt
COPY proto proto
COPY router router
COPY shard shard
COPY launcher launcher
COPY bench bench
RUN pip install --no-deps . && rm -rf /src/build

# TGI's conventions: the Hub cache on the /data volume, the HTTP port 80.
ENV HF_HOME=/data \
    HUGGINGFACE_HUB_CACHE=/data/hub \
    PORT=80 \
    SHARD_UDS_PATH=/tmp/text-generation-server
VOLUME /data
EXPOSE 80
WORKDIR /
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s \
    CMD curl -fsS "http://127.0.0.1:${PORT}/health" || exit 1

ENTRYPOINT ["pytgi-launcher"]
CMD []
