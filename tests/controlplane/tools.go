//go:build tools

// Package controlplane pins the Kubernetes commands the test control plane is built from
// (kube-apiserver, kube-controller-manager, kubectl) and the node tier's (kube-scheduler,
// kubelet, kube-proxy), so `go mod tidy` keeps their dependencies in go.sum.
package controlplane

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
