#!/usr/bin/env bash
# Builds mdbook once (cached by version, as the control plane is) for the guide: `make test`
# builds and link-checks docs/guide with it (tests/tests/guide.rs). Debian 12 has no mdbook
# package, so cargo builds it, without the `serve`/`watch` features nothing here uses.
# Prints the binary's path as its last line.
set -euo pipefail
VERSION=0.5.4
root="${XDG_CACHE_HOME:-$HOME/.cache}/egress-operator/mdbook-$VERSION"
bin="$root/bin/mdbook"
if [ -x "$bin" ] && "$bin" --version 2>/dev/null | grep -q "v$VERSION"; then
  echo "mdbook: cached: $("$bin" --version)"
else
  echo "mdbook: building $VERSION with cargo (once; cached in $root)"
  cargo install mdbook --version "$VERSION" --locked --no-default-features --root "$root" --quiet
fi
echo "$bin"
