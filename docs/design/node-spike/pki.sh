#!/usr/bin/env bash
# Spike PKI: one CA; apiserver serving cert; client certs for admin, the kubelet
# (system:node:<name>), kube-proxy, and the apiserver's kubelet client; SA keypair.
set -euo pipefail
d=/work/node-spike/pki; node=${NODE_NAME:-spike-node}; nodeip=${NODE_IP:-10.244.0.1}
mkdir -p "$d"; cd "$d"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
  -keyout ca.key -out ca.crt -subj "/CN=node-spike CA" 2>/dev/null
cert() { # name subject [san]
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout "$1.key" -out "$1.csr" -subj "$2" 2>/dev/null
  ext=$(mktemp)
  { echo "basicConstraints=CA:FALSE"; echo "keyUsage=critical,digitalSignature,keyEncipherment"
    if [ -n "${3:-}" ]; then echo "extendedKeyUsage=serverAuth"; echo "subjectAltName=$3"
    else echo "extendedKeyUsage=clientAuth"; fi; } > "$ext"
  openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 -out "$1.crt" -extfile "$ext" 2>/dev/null
  rm -f "$ext" "$1.csr"
}
cert apiserver "/CN=kube-apiserver" "IP:127.0.0.1,IP:10.244.0.1,IP:10.245.0.1,IP:10.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc"
cert kubelet-serving "/CN=$node" "IP:$nodeip,DNS:$node"
cert admin "/O=system:masters/CN=admin"
cert kubelet "/O=system:nodes/CN=system:node:$node"
cert kube-proxy "/CN=system:kube-proxy"
cert apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client"
cert controller-manager "/CN=system:kube-controller-manager"
cert scheduler "/CN=system:kube-scheduler"
openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out sa.key 2>/dev/null
openssl pkey -in sa.key -pubout -out sa.pub
chmod 600 *.key
