// Command etcd is etcd's own server entry point, built from the go.etcd.io/etcd/server/v3
// module at the version kube-apiserver's module pins, so the test control plane's two
// halves come from one dependency graph.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
