# egress-operator: every entry point a developer or CI needs.
# `make test` and `make demo` install what they need first (`make setup`).

SHELL := /bin/bash
CARGO ?= cargo
# Honour CARGO_TARGET_DIR so a shared or out-of-tree target directory works too.
TARGET_DIR := $(or $(CARGO_TARGET_DIR),target)
BIN := $(TARGET_DIR)/debug/egress-operator

# Template plugins (and the hostile test plugins) are wasm32-wasip2 components; they are
# copied to target/plugins/ under the file names the sample config uses.
PLUGINS := domain-default vendor-data-default
TEST_PLUGINS := sdk-example hostile-domain hostile-fs
WASM_DIR := $(TARGET_DIR)/wasm32-wasip2/release
PLUGIN_DIR := $(TARGET_DIR)/plugins

.PHONY: all setup build plugins lint fmt generate test demo bench clean guide

all: build

## setup: install Debian packages and rustup targets the build and tests need (idempotent)
setup:
	@bash scripts/setup.sh

## build: build the workspace and the plugins
build: plugins
	$(CARGO) build --workspace --all-targets --locked

## plugins: build the template plugins for wasm32-wasip2 into target/plugins/
plugins:
	$(CARGO) build --locked --release --target wasm32-wasip2 $(addprefix -p ,$(PLUGINS) $(TEST_PLUGINS))
	@mkdir -p $(PLUGIN_DIR)
	@for p in $(PLUGINS) $(TEST_PLUGINS); do cp $(WASM_DIR)/$${p//-/_}.wasm $(PLUGIN_DIR)/$$p.wasm; done
	@ls -l $(PLUGIN_DIR)

## lint: formatting and clippy, warnings denied
lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings

## fmt: format the code
fmt:
	$(CARGO) fmt --all

## generate: regenerate committed artefacts (JSON Schema, CRDs, the plugin output allow-list); CI fails when they are stale
## (the binary is built first, so a build failure leaves the committed files untouched)
generate:
	$(CARGO) build --quiet --locked -p egress-operator --bin egress-operator
	$(BIN) config-schema > config/schema/providers-config.schema.json
	set -o pipefail; $(BIN) crd | bash scripts/split-crds.sh config/crd/bases
	$(BIN) rules > templates-sdk/src/rules.md

## test: setup, lint, docs, the guest image and the test control plane, then every test
## and every bench once in its quick mode (`cargo test --benches`: each step on small inputs,
## so a broken bench fails here; log $(TARGET_DIR)/bench-quick.log)
## (tests/tests/guest_e2e.rs boots the guest; the cluster tier runs against a local etcd and
## kube-apiserver, or the cluster of KUBECONFIG when set; the node tier, tests/tests/node*.rs,
## runs a real kubelet node from scripts/node.sh and the operator's image on it). The guest
## image (mostly downloads and dpkg), the control plane (Go builds of etcd, kube-apiserver,
## kube-controller-manager, kubectl, and the node's kube-scheduler, kubelet and kube-proxy;
## cached by version) and the images' debian:12-slim base build in the background while the
## code compiles; their logs are $(TARGET_DIR)/guest-image.log, controlplane.log and
## image-base.log.
test: setup
	@mkdir -p $(TARGET_DIR)
	set -euo pipefail; \
	bash scripts/guest-image.sh $(GUEST_IMAGE) > $(TARGET_DIR)/guest-image.log 2>&1 & image=$$!; \
	bash scripts/controlplane.sh > $(TARGET_DIR)/controlplane.log 2>&1 & plane=$$!; \
	bash scripts/mdbook.sh > $(TARGET_DIR)/mdbook.log 2>&1 & book=$$!; \
	bash scripts/operator-image.sh base > $(TARGET_DIR)/image-base.log 2>&1 & base=$$!; \
	trap 'kill $$image $$plane $$book $$base 2>/dev/null || true' EXIT; \
	$(MAKE) --no-print-directory lint plugins; \
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --workspace --no-deps --locked --quiet; \
	$(CARGO) test --workspace --locked --no-run --quiet; \
	if ! wait $$image; then tail -n 40 $(TARGET_DIR)/guest-image.log; echo "make test: the guest image build failed (log above)" >&2; exit 1; fi; \
	tail -n 3 $(TARGET_DIR)/guest-image.log; \
	if ! wait $$plane; then tail -n 40 $(TARGET_DIR)/controlplane.log; echo "make test: the control plane build failed (log above)" >&2; exit 1; fi; \
	tail -n 2 $(TARGET_DIR)/controlplane.log; \
	export EGRESS_CONTROLPLANE_DIR="$$(tail -n 1 $(TARGET_DIR)/controlplane.log)"; \
	if ! wait $$book; then tail -n 40 $(TARGET_DIR)/mdbook.log; echo "make test: building mdbook failed (log above)" >&2; exit 1; fi; \
	export EGRESS_MDBOOK="$$(tail -n 1 $(TARGET_DIR)/mdbook.log)"; \
	if ! wait $$base; then tail -n 40 $(TARGET_DIR)/image-base.log; echo "make test: making the images' debian:12-slim base failed (log above)" >&2; exit 1; fi; \
	$(CARGO) test --workspace --locked --no-fail-fast 2>&1 | tee $(TARGET_DIR)/test.log; \
	$(CARGO) test --workspace --locked --benches 2>&1 | tee $(TARGET_DIR)/bench-quick.log
	@bash scripts/test-summary.sh $(TARGET_DIR)/test.log $(TARGET_DIR)/bench-quick.log

## controlplane: build (or find cached) etcd, kube-apiserver, kube-controller-manager and
## kubectl for the cluster tier and the demo (scripts/controlplane.sh); prints their directory
.PHONY: controlplane
controlplane:
	@bash scripts/controlplane.sh

## guide: build the guide (docs/guide, an mdBook) into $(TARGET_DIR)/guide; mdbook is built
## once and cached (scripts/mdbook.sh)
guide:
	@mdbook="$$(bash scripts/mdbook.sh | tail -n 1)" && "$$mdbook" build docs/guide --dest-dir $(abspath $(TARGET_DIR))/guide
	@echo "the guide: $(abspath $(TARGET_DIR))/guide/index.html"

## guest-image: build the real Debian 12 guest (cloud kernel, cloud-init NoCloud, qemu-guest-agent,
## tinyproxy) from Debian packages; cached, rebuilt only when its recipe changes (scripts/guest-image.sh)
GUEST_IMAGE := $(TARGET_DIR)/guest/debian-12.qcow2
.PHONY: guest-image demo-image
guest-image:
	bash scripts/guest-image.sh $(GUEST_IMAGE)

## demo-image: the tiny busybox guest (boots in seconds, no cloud-init) for quick manual tries
DEMO_IMAGE := $(TARGET_DIR)/demo/demo.qcow2
demo-image:
	bash scripts/demo-image.sh $(DEMO_IMAGE)

## demo: the main job on local defaults, the operator as users run it: a one-node
## Kubernetes cluster (etcd, kube-apiserver, controllers, scheduler, containerd, kubelet,
## kube-proxy; built here, in its own network namespace), the operator's image built from
## the Dockerfile and installed with `kubectl apply -k config/default`, sshd and an
## isolated libvirtd (network namespace, bridge with no route out, an HTTP server inside);
## then a pool of 2 proxy VMs, a workload pod's pages through the pool's Service and then
## a lease's, `kubectl delete`, and a check that nothing is left. Ctrl-C tears everything
## down.
demo: setup plugins guest-image controlplane
	$(CARGO) build --locked -p egress-operator --bin egress-operator
	$(CARGO) build --locked -p integration-tests --bin egress-demo
	EGRESS_CONTROLPLANE_DIR="$$(bash scripts/controlplane.sh | tail -n 1)" $(TARGET_DIR)/debug/egress-demo $(GUEST_IMAGE) $(BIN)

## bench: timings printed as ratios against a peer measured in the same run
bench: setup plugins guest-image
	$(CARGO) bench --locked -p integration-tests --bench templates
	$(CARGO) bench --locked -p integration-tests --bench transport
	$(CARGO) bench --locked -p integration-tests --bench provider
	EGRESS_CONTROLPLANE_DIR="$$(bash scripts/controlplane.sh | tail -n 1)" \
	  $(CARGO) bench --locked -p integration-tests --bench scale
	EGRESS_CONTROLPLANE_DIR="$$(bash scripts/controlplane.sh | tail -n 1)" \
	  $(CARGO) bench --locked -p integration-tests --bench drift
	EGRESS_CONTROLPLANE_DIR="$$(bash scripts/controlplane.sh | tail -n 1)" \
	  $(CARGO) bench --locked -p integration-tests --bench traffic
	EGRESS_CONTROLPLANE_DIR="$$(bash scripts/controlplane.sh | tail -n 1)" \
	  $(CARGO) bench --locked -p integration-tests --bench traffic_guests

clean:
	$(CARGO) clean
