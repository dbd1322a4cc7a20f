#!/usr/bin/env bash
# etcd (loopback) + kube-apiserver (on APISERVER_IP: the bridge IP, or the host end of the
# node netns veth) + kube-controller-manager + kube-scheduler for the spike.
set -euo pipefail
cd /work/node-spike
cp=/root/.cache/egress-operator/controlplane/k8s-v1.33.13-etcd-v3.5.21-2b88551e7ad0
p=/work/node-spike/pki
mkdir -p logs pids etcd
setsid "$cp/etcd" --name=spike --data-dir=/work/node-spike/etcd \
  --listen-client-urls=http://127.0.0.1:23791 --advertise-client-urls=http://127.0.0.1:23791 \
  --listen-peer-urls=http://127.0.0.1:23801 --initial-advertise-peer-urls=http://127.0.0.1:23801 \
  --initial-cluster=spike=http://127.0.0.1:23801 --unsafe-no-fsync --log-level=warn \
  --listen-metrics-urls= > logs/etcd.log 2>&1 < /dev/null &
echo $! > pids/etcd
start=$(date +%s.%N)
setsid "$cp/kube-apiserver" --etcd-servers=http://127.0.0.1:23791 \
  --secure-port=26443 --bind-address=${APISERVER_IP:-10.244.0.1} --advertise-address=${APISERVER_IP:-10.244.0.1} \
  --cert-dir=/work/node-spike/apiserver-certs \
  --tls-cert-file=$p/apiserver.crt --tls-private-key-file=$p/apiserver.key \
  --client-ca-file=$p/ca.crt \
  --kubelet-client-certificate=$p/apiserver-kubelet-client.crt \
  --kubelet-client-key=$p/apiserver-kubelet-client.key \
  --kubelet-certificate-authority=$p/ca.crt \
  --kubelet-preferred-address-types=InternalIP \
  --service-cluster-ip-range=10.0.0.0/24 \
  --service-account-issuer=https://kubernetes.default.svc \
  --service-account-key-file=$p/sa.pub --service-account-signing-key-file=$p/sa.key \
  --authorization-mode=Node,RBAC --enable-admission-plugins=NodeRestriction \
  --allow-privileged=true --endpoint-reconciler-type=lease --v=1 \
  > logs/kube-apiserver.log 2>&1 < /dev/null &
echo $! > pids/kube-apiserver
export KUBECONFIG=/work/node-spike/kubeconfig/admin.kubeconfig
until "$cp/kubectl" get --raw=/readyz >/dev/null 2>&1; do sleep 0.5; done
echo "apiserver ready in $(echo "$(date +%s.%N) - $start" | bc)s"
setsid "$cp/kube-controller-manager" --kubeconfig=/work/node-spike/kubeconfig/controller-manager.kubeconfig \
  --controllers=serviceaccount,root-ca-cert-publisher,endpointslice,endpoint,namespace,garbagecollector,deployment,replicaset,clusterrole-aggregation,nodelifecycle \
  --root-ca-file=$p/ca.crt --service-account-private-key-file=$p/sa.key \
  --use-service-account-credentials=true --leader-elect=false --secure-port=0 --v=1 \
  > logs/kube-controller-manager.log 2>&1 < /dev/null &
echo $! > pids/kube-controller-manager
setsid bin/kube-scheduler --kubeconfig=/work/node-spike/kubeconfig/scheduler.kubeconfig \
  --leader-elect=false --secure-port=0 --v=1 > logs/kube-scheduler.log 2>&1 < /dev/null &
echo $! > pids/kube-scheduler
