"""The harnessrl Kubernetes operator (imported as ``harnessrl.operator``, never as the stdlib ``operator``)."""
