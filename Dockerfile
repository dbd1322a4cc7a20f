# syntax=docker/dockerfile:1
# The egress-operator image: the operator binary and the default template plugins.
#   docker build -t egress-operator:0.1.0 .
#
# BINARIES picks the stage the binary and plugins come from: `build` (the default)
# compiles them here. `prebuilt` copies them from `image-input/` in the build context
# (egress-operator and plugins/*.wasm), for builders that cannot make the Rust base:
# scripts/operator-image.sh builds this file with buildah that way, from a context of
# its own, because no registry can be reached where the tests run (it makes
# debian:12-slim itself, with debootstrap).
ARG BINARIES=build

# ---- build: the operator (native) and the plugins (wasm32-wasip2 components) ----
FROM rust:1.95-bookworm AS build
# libvirt-dev: headers and the link library of the `virt` crate.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libvirt-dev pkg-config \
 && rm -rf /var/lib/apt/lists/*
RUN rustup target add wasm32-wasip2
WORKDIR /src
COPY . .
# The target directory is a cache mount, so the results are copied out in the same step.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --locked --release -p egress-operator --bin egress-operator \
 && cargo build --locked --release --target wasm32-wasip2 -p domain-default -p vendor-data-default \
 && mkdir -p /out/plugins \
 && cp target/release/egress-operator /out/egress-operator \
 && cp target/wasm32-wasip2/release/domain_default.wasm /out/plugins/domain-default.wasm \
 && cp target/wasm32-wasip2/release/vendor_data_default.wasm /out/plugins/vendor-data-default.wasm

# ---- prebuilt: the same files, built outside the image ----
FROM scratch AS prebuilt
COPY image-input/ /out/

FROM ${BINARIES} AS binaries

# ---- runtime ----
FROM debian:12-slim
# libvirt0: libvirt's client library, which the `virt` crate links against (the
# operator talks to remote libvirtd through its own SSH tunnel; no ssh binary needed).
# ca-certificates: the system trust store.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libvirt0 ca-certificates \
 && rm -rf /var/lib/apt/lists/*
# A fixed non-root user (the Deployment runs as 65532:65532). libvirt's client looks up
# the user's home for its client config, so the user exists; HOME is the /tmp emptyDir.
RUN groupadd --system --gid 65532 egress \
 && useradd --system --uid 65532 --gid 65532 --home-dir /tmp --no-create-home \
      --shell /usr/sbin/nologin egress
COPY --from=binaries /out/egress-operator /usr/local/bin/egress-operator
COPY --from=binaries /out/plugins/ /usr/lib/egress-operator/plugins/
ENV HOME=/tmp
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/egress-operator"]
CMD ["--help"]
