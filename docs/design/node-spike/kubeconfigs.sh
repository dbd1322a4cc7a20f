#!/usr/bin/env bash
set -euo pipefail
cd /work/node-spike; mkdir -p kubeconfig
for who in admin kubelet kube-proxy controller-manager scheduler; do
cat > kubeconfig/$who.kubeconfig <<EOC
apiVersion: v1
kind: Config
clusters:
- name: spike
  cluster:
    server: https://${APISERVER_IP:-10.244.0.1}:26443
    certificate-authority: /work/node-spike/pki/ca.crt
users:
- name: $who
  user:
    client-certificate: /work/node-spike/pki/$who.crt
    client-key: /work/node-spike/pki/$who.key
contexts:
- name: spike
  context: {cluster: spike, user: $who}
current-context: spike
EOC
done
