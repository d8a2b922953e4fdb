"""``scripts/kube.sh build|up|down|env|status|images``: the test control plane for people.

``up`` starts a cluster that outlives the command, recorded in ``HARNESSRL_KUBE_DIR`` (default
``/tmp/harnessrl-kube``); ``env`` prints the shell lines that point kubectl at it; ``down`` stops it by PID.
Every failure prints one line naming the component and its log file, and exits 1.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from harnessrl.devcluster.build import BuildError, ensure_binaries, ensure_node_binaries
from harnessrl.devcluster.cluster import Cluster, ClusterError, start_cluster
from harnessrl.devcluster.images import ImageError, ensure_images, import_images
from harnessrl.devcluster.node import NodeError, image_store, preflight, running_image_store


def _dir() -> Path:
    return Path(os.environ.get("HARNESSRL_KUBE_DIR", "/tmp/harnessrl-kube"))


def _say(line: str) -> None:
    click.echo(line, err=True)


@click.group()
def main() -> None:
    """A real Kubernetes control plane on 127.0.0.1 (etcd, apiserver, controller manager, scheduler, kwok)."""


@main.command()
@click.option(
    "--node", is_flag=True, help="Also the real node's binaries, and install the Debian packages it runs (root)."
)
def build(node: bool) -> None:
    """Build the binaries once (cached under ~/.cache/harnessrl) and print what each build measured."""
    sets = [ensure_binaries(_say)]
    if node:
        preflight(_say)
        sets.append(ensure_node_binaries(_say))
    for binaries in sets:
        for name, measured in binaries.measurements().items():
            click.echo(f"{name}: {measured['seconds']:.0f} s, peak RSS {measured['peak_rss_mib']:.0f} MiB")
        click.echo(f"binaries: {binaries.dir / 'bin'}")


@main.command()
@click.option("--nodes", type=int, default=None, help="Fake (kwok) nodes to create [default: 3, 0 with --real-node].")
@click.option("--port", type=int, default=None, help="kube-apiserver port (default: a free one).")
@click.option(
    "--real-node",
    is_flag=True,
    help="Also join a real node (containerd, kubelet, kube-proxy, CoreDNS, volumes, NetworkPolicies); needs root.",
)
def up(nodes: int | None, port: int | None, real_node: bool) -> None:
    """Start a cluster that keeps running after this command; `down` stops it."""
    directory = _dir()
    if (directory / "cluster.json").exists():
        existing = Cluster.load(directory)
        if any(existing.running().values()):
            raise ClusterError(
                f"a cluster is already running from {directory} at {existing.server}; "
                "run `scripts/kube.sh down` first"
            )
        existing.stop()
    if nodes is None:
        nodes = 0 if real_node else 3
    cluster = start_cluster(directory, nodes=nodes, port=port, attached=False, real_node=real_node, log=_say)
    click.echo(f"export KUBECONFIG={cluster.kubeconfig}")


@main.command()
@click.argument("names", nargs=-1)
@click.option(
    "--node-store",
    is_flag=True,
    help="With no real node up, import them into its image store anyway (a containerd started for the import "
    "alone), so the next `up --real-node` starts with them: CI does this while the control plane compiles.",
)
def images(names: tuple[str, ...], node_store: bool) -> None:
    """Build the images the chart and operator run (all, or NAMES) from images/ with podman, cached in podman's
    store by their inputs; with a real node up (or --node-store), import them into its containerd."""
    built = ensure_images(names or None, _say)
    for item in built:
        took = f"built in {item.seconds:.0f} s" if item.seconds else "cached"
        click.echo(f"{item.image.ref}: {item.size_bytes / 2**20:.0f} MiB ({took})")
    if node_store or running_image_store():
        with image_store(_say) as address:
            import_images("ctr", address, built=built, log=_say)


@main.command()
def down() -> None:
    """Stop every process of the cluster by PID and remove its files (a real node: its pods, mounts, network
    namespaces, bridge and iptables chains too)."""
    directory = _dir()
    if not (directory / "cluster.json").exists():
        _say(f"kube: no cluster in {directory}")
        return
    Cluster.load(directory).stop()
    _say("kube: cluster stopped")


@main.command()
def env() -> None:
    """Print `export` lines for KUBECONFIG and PATH (eval "$(scripts/kube.sh env)")."""
    cluster = Cluster.load(_dir())
    for name, value in cluster.env().items():
        click.echo(f"export {name}={value}")


@main.command()
def status() -> None:
    """Each component's PID and whether it is still running."""
    cluster = Cluster.load(_dir())
    click.echo(f"server: {cluster.server}")
    for name, alive in cluster.running().items():
        click.echo(f"{name}: pid {cluster.pids[name]} {'running' if alive else 'NOT RUNNING'}")
    if cluster.node and cluster.running().get("kube-apiserver"):
        nodes = cluster.kubectl("get", "nodes", "-o", "wide", check=False)
        click.echo((nodes.stdout or nodes.stderr).rstrip())


if __name__ == "__main__":
    try:
        main(standalone_mode=False)
    except (BuildError, ClusterError, NodeError, ImageError) as exc:
        _say(str(exc))
        sys.exit(1)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
