// The pod sandbox (pause) program of the real node (see src/harnessrl/devcluster/node.py). Not a library.
module harnessrl.dev/kube/pause

go 1.26.0
