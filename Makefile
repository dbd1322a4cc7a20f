# egress-operator: every entry point a developer or CI needs.
# `make test` and `make demo` install what they need first (`make setup`).

SHELL := /bin/bash
CARGO ?= cargo
BIN := target/debug/egress-operator

.PHONY: all setup build lint fmt generate test demo clean

all: build

## setup: install Debian packages and rustup targets the build and tests need (idempotent)
setup:
	@bash scripts/setup.sh

## build: build the workspace
build:
	$(CARGO) build --workspace --all-targets --locked

## lint: formatting and clippy, warnings denied
lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings

## fmt: format the code
fmt:
	$(CARGO) fmt --all

## generate: regenerate committed artefacts (JSON Schema); CI fails when they are stale
generate:
	$(CARGO) run --quiet --locked -p egress-operator -- config-schema > config/schema/providers-config.schema.json

## test: setup, lint, docs, then every test
test: setup lint
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --workspace --no-deps --locked --quiet
	@mkdir -p target
	set -o pipefail; $(CARGO) test --workspace --locked 2>&1 | tee target/test.log
	@bash scripts/test-summary.sh target/test.log

## demo: the main job on local defaults (today: validate the sample config and Proxy)
demo: setup
	$(CARGO) build --locked -p egress-operator
	$(BIN) validate-config config/samples/providers-config.yaml --proxy config/samples/proxy_kvm2.yaml

clean:
	$(CARGO) clean
