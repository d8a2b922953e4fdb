// Command pause is the pod sandbox's process: it holds the pod's namespaces and does nothing else. Built
// here because the usual registry.k8s.io/pause image cannot be pulled on the dev node.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM)
	<-signals
}
