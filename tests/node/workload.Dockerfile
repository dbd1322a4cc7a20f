# The node tier's workload: a client that fetches through a proxy, as a pod of a user's
# would (HTTPS_PROXY / HTTP_PROXY). curl, because it is what users run, and it speaks
# CONNECT for https and absolute-form requests for http. Built by scripts/operator-image.sh.
FROM debian:12-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends curl ca-certificates \
 && rm -rf /var/lib/apt/lists/*
USER 65532:65532
CMD ["sleep", "infinity"]
