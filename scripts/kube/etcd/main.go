// Command etcd is etcd's own server entry point; `go install` cannot build it from its module directly.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
