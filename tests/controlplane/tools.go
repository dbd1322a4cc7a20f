//go:build tools

// Package controlplane pins the Kubernetes commands the test control plane is built from
// (kube-apiserver, kube-controller-manager, kubectl), so `go mod tidy` keeps their dependencies in go.sum.
package controlplane

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
