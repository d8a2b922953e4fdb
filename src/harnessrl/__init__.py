"""harnessrl: harnessed agentic RL on Kubernetes."""

__version__ = "0.1.0"
