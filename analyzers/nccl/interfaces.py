"""Which network interfaces NCCL chose are not a path between nodes.

NCCL picks its bootstrap and socket interfaces by a preference order that a container, a
VM host or a VPN can defeat: a docker bridge, a veth pair, a libvirt bridge, a tunnel or
the loopback then carries traffic that other nodes cannot route to (a hang at init) or
routes through a slow overlay. Kinds by interface name, as Linux and the usual container,
VM and VPN stacks name them, and by address (loopback, link-local).
"""

from __future__ import annotations

import ipaddress
import re

# (pattern on the interface name, kind): the first match wins.
VIRTUAL_NAMES: tuple[tuple[str, str], ...] = (
    (r"lo(?::.*)?", "loopback"),
    (r"docker\d*|br-[0-9a-f]+|cni\d*|podman\d*|cbr\d*", "container bridge"),
    (r"veth\w*", "container veth pair"),
    (r"flannel[.\w]*|cali\w+|weave|vxlan[.\w]*|cilium_\w+|kube-ipvs\d*", "container overlay"),
    (r"virbr\d+(?:-nic)?|vnet\d+|vmnet\d+", "virtual-machine bridge"),
    (r"ip6tnl\d*|ip6gre\d*|sit\d+|gre\d*|gretap\d*|ipip\d*|tunl\d*|tun\d*|tap\d*|erspan\d*", "tunnel"),
    (r"wg\d*|tailscale\d*|zt\w+|utun\d*|ppp\d*", "VPN"),
)
_VIRTUAL = [(re.compile(p), kind) for p, kind in VIRTUAL_NAMES]


def interface_kind(name: str, address: str | None = None) -> str | None:
    """Why this interface is no path between nodes ("loopback", "tunnel", ...), or None."""
    for pattern, kind in _VIRTUAL:
        if pattern.fullmatch(name or ""):
            return kind
    try:
        ip = ipaddress.ip_address((address or "").split("%", 1)[0])
    except ValueError:
        return None
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link-local address"
    return None
