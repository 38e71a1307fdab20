"""What bus bandwidth a topology should reach, and what a measured table reached.

nccl-tests' busbw is normalised so that, for every collective, it can be compared with
the bandwidth of the slowest link a rank uses: the GPU's NVLink or PCIe link inside a
node, the node's network interfaces between nodes. This module holds:

- LINKS: a table of link speeds (GB/s = 10^9 bytes/s, one direction) with the share of
  that raw speed NCCL's large messages reach on a healthy system (`efficiency`);
- topology readers: from a `diag.nccl_log/1` document (transports, hosts, ranks), from
  `nvidia-smi topo -m` text, and from explicit flags; `merge_topology` combines them;
- `expected_busbw(topology)`, `network_busbw(topology)` and `bandwidth_facts(test,
  topology)`: the measured large-message figure beside the expected one. Whether that is
  healthy is the diagnosis layer's judgement (`diag.analyzers.diagnosis.bandwidth`).

Everything here is a pure function of its arguments.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

# Message sizes from which busbw is on its plateau (the "large-message" figure).
LARGE_MESSAGE_BYTES = 64 << 20


@dataclass(frozen=True)
class Link:
    key: str
    kind: str  # "nvlink" | "pcie" | "ib" | "roce" | "ethernet"
    gbps: float  # raw data rate, GB/s per direction (per GPU for NVLink/PCIe, per NIC for networks)
    efficiency: float  # share of gbps that NCCL's large-message busbw reaches when healthy
    label: str


# Per-GPU NVLink: links x per-link rate (NVLink 1: 4 x 20 GB/s on P100; 2: 6 x 25 on V100;
# 3: 12 x 25 on A100; 4: 18 x 25 on H100; 5: 18 x 50 on B200). PCIe x16 after encoding.
# Networks: line rate / 8. Efficiencies: ~80% of NVLink/PCIe, ~96% of an IB/RoCE NIC
# (about 24 GB/s per 200 Gb/s NIC), ~90% of an Ethernet line with TCP sockets.
LINKS: dict[str, Link] = {
    link.key: link
    for link in (
        Link("nvlink1", "nvlink", 80.0, 0.80, "NVLink 1 (4 links, P100)"),
        Link("nvlink2", "nvlink", 150.0, 0.80, "NVLink 2 (6 links, V100)"),
        Link("nvlink3", "nvlink", 300.0, 0.80, "NVLink 3 (12 links, A100)"),
        Link("nvlink4", "nvlink", 450.0, 0.80, "NVLink 4 (18 links, H100)"),
        Link("nvlink5", "nvlink", 900.0, 0.80, "NVLink 5 (18 links, B200)"),
        Link("pcie3", "pcie", 15.75, 0.80, "PCIe Gen3 x16"),
        Link("pcie4", "pcie", 31.5, 0.80, "PCIe Gen4 x16"),
        Link("pcie5", "pcie", 63.0, 0.80, "PCIe Gen5 x16"),
        Link("pcie6", "pcie", 121.0, 0.80, "PCIe Gen6 x16"),
        Link("ib_edr", "ib", 12.5, 0.96, "InfiniBand EDR 100 Gb/s"),
        Link("ib_hdr", "ib", 25.0, 0.96, "InfiniBand HDR 200 Gb/s"),
        Link("ib_ndr", "ib", 50.0, 0.96, "InfiniBand NDR 400 Gb/s"),
        Link("ib_xdr", "ib", 100.0, 0.96, "InfiniBand XDR 800 Gb/s"),
        Link("roce_100", "roce", 12.5, 0.96, "RoCE 100 Gb/s"),
        Link("roce_200", "roce", 25.0, 0.96, "RoCE 200 Gb/s"),
        Link("roce_400", "roce", 50.0, 0.96, "RoCE 400 Gb/s"),
        Link("eth_10", "ethernet", 1.25, 0.90, "Ethernet 10 Gb/s (TCP sockets)"),
        Link("eth_25", "ethernet", 3.125, 0.90, "Ethernet 25 Gb/s (TCP sockets)"),
        Link("eth_100", "ethernet", 12.5, 0.90, "Ethernet 100 Gb/s (TCP sockets)"),
        Link("eth_200", "ethernet", 25.0, 0.90, "Ethernet 200 Gb/s (TCP sockets)"),
        Link("eth_400", "ethernet", 50.0, 0.90, "Ethernet 400 Gb/s (TCP sockets)"),
    )
}
INTRA_LINKS = tuple(k for k, v in LINKS.items() if v.kind in ("nvlink", "pcie"))
INTER_LINKS = tuple(k for k, v in LINKS.items() if v.kind in ("ib", "roce", "ethernet"))
_NVLINK_PER_LINK = {1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 50.0}


def link_key(text: str) -> str:
    """Accept 'nvlink4', 'NVLink-4', 'pcie5', 'gen4', 'hdr', 'ib-ndr', 'roce400', '100gbe'..."""
    t = re.sub(r"[\s\-/]+", "_", str(text).strip().lower())
    aliases = {
        "edr": "ib_edr", "hdr": "ib_hdr", "ndr": "ib_ndr", "xdr": "ib_xdr",
        "gen3": "pcie3", "gen4": "pcie4", "gen5": "pcie5", "gen6": "pcie6",
    }
    t = aliases.get(t, t)
    m = re.fullmatch(r"(nvlink|nvl|nv)_?([1-5])", t)
    if m:
        t = f"nvlink{m.group(2)}"
    m = re.fullmatch(r"pcie?_?(?:gen)?_?([3-6])", t)
    if m:
        t = f"pcie{m.group(1)}"
    m = re.fullmatch(r"(ib|infiniband)_?(edr|hdr|ndr|xdr)", t)
    if m:
        t = f"ib_{m.group(2)}"
    m = re.fullmatch(r"roce_?(100|200|400)(?:g|gbe)?", t)
    if m:
        t = f"roce_{m.group(1)}"
    m = re.fullmatch(r"(?:eth|ethernet)?_?(10|25|100|200|400)(?:g|gbe)", t) or re.fullmatch(
        r"(?:eth|ethernet)_?(10|25|100|200|400)", t
    )
    if m:
        t = f"eth_{m.group(1)}"
    if t not in LINKS:
        raise ValueError(f"unknown link {text!r}: choose from {', '.join(LINKS)}")
    return t


# ---------------------------------------------------------------- topology


def empty_topology() -> dict:
    """Topology keys (None = unknown)."""
    return {
        "nodes": None,
        "gpus_per_node": None,
        "intra": None,  # key of LINKS (nvlink*/pcie*), or "shm" when NCCL goes through host memory
        "intra_gbps": None,  # overrides LINKS[intra].gbps when known exactly (e.g. from NV# counts)
        "inter": None,  # key of LINKS for the NICs the hardware has
        "nics_per_node": None,
        "transport": None,  # what NCCL actually used between nodes: "ib", "socket", or None
        "intra_transport": None,  # what NCCL used inside a node: "p2p", "shm", "nvls", or None
        "gdrdma": None,  # True/False when NCCL's IB transport reported GPUDirect RDMA or not
        "sources": [],
        "notes": [],
    }


def topology_from_flags(intra: str | None = None, inter: str | None = None, nics_per_node: int | None = None,
                        gpus_per_node: int | None = None, nodes: int | None = None) -> dict:
    topo = empty_topology()
    if intra:
        topo["intra"] = link_key(intra)
    if inter:
        topo["inter"] = link_key(inter)
    topo["nics_per_node"] = nics_per_node
    topo["gpus_per_node"] = gpus_per_node
    topo["nodes"] = nodes
    if any(v is not None for v in (intra, inter, nics_per_node, gpus_per_node, nodes)):
        topo["sources"].append("flags")
    return topo


_NV = re.compile(r"^NV(\d+)$")
_PCIE_PATHS = {"PIX", "PXB", "PHB", "NODE", "SYS", "SOC"}


def topology_from_nvidia_smi(text: str) -> dict:
    """GPUs, NICs and the GPU-to-GPU links from the matrix `nvidia-smi topo -m` prints."""
    topo = empty_topology()
    header: list[str] | None = None
    gpu_rows: dict[str, list[str]] = {}
    nic_names: set[str] = set()
    for raw in text.splitlines():
        line = re.sub(r"\x1b\[[0-9;]*m", "", raw).rstrip()
        cells = line.split()
        if not cells:
            continue
        if header is None and cells[0].startswith("GPU0"):
            header = [c for c in re.split(r"\t+|\s{2,}", line.strip()) if c]
            continue
        m = re.match(r"^\s*(NIC\d+)\s*:\s*(\S+)", line)
        if m:
            nic_names.add(m.group(2))
            continue
        if header is not None and re.fullmatch(r"GPU\d+", cells[0]):
            gpu_rows[cells[0]] = cells[1:]
    if header is None or not gpu_rows:
        raise ValueError("not `nvidia-smi topo -m` output: no GPU matrix found")
    gpu_cols = [i for i, h in enumerate(header) if re.fullmatch(r"GPU\d+", h)]
    nic_cols = [h for h in header if re.fullmatch(r"NIC\d+|mlx\d+_\d+|ib\w*|bnxt\w*|eth\w*|irdma\w*", h)]
    topo["gpus_per_node"] = len(gpu_rows)
    nics = max(len(nic_cols), len(nic_names))
    topo["nics_per_node"] = nics or None
    per_gpu_links: list[int] = []
    pcie_only = True
    for cells in gpu_rows.values():
        links = []
        for i in gpu_cols:
            if i < len(cells):
                m = _NV.match(cells[i])
                if m:
                    links.append(int(m.group(1)))
                elif cells[i] in _PCIE_PATHS:
                    links.append(0)
        if any(links):
            pcie_only = False
        peer_links = [x for x in links if x > 0]
        if not peer_links:
            per_gpu_links.append(0)
        elif len(set(peer_links)) == 1 and peer_links[0] >= 8 and len(peer_links) == len(links):
            per_gpu_links.append(peer_links[0])  # NVSwitch: every pair shows the GPU's full link count
        else:
            per_gpu_links.append(sum(peer_links))  # direct mesh: the links split across peers
    if len(gpu_rows) > 1 and not pcie_only and min(per_gpu_links) > 0:
        links = min(per_gpu_links)
        gen = 4 if links >= 18 else 3 if links >= 12 else 2 if links >= 6 else 1
        topo["intra"] = f"nvlink{gen}"
        topo["intra_gbps"] = links * _NVLINK_PER_LINK[gen]
        topo["notes"].append(
            f"{links} NVLink links per GPU, read as NVLink {gen}; pass --intra nvlinkN when the GPU generation differs"
        )
    elif len(gpu_rows) > 1:
        topo["intra"] = "pcie4"
        topo["notes"].append("GPUs are connected through PCIe only; PCIe Gen4 assumed (pass --intra pcieN)")
    topo["sources"].append("nvidia-smi topo -m")
    return topo


def _strings(obj, out: list[str], depth: int = 0) -> None:
    if depth > 6:
        return
    if isinstance(obj, str):
        out.append(obj)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.append(str(k))
            _strings(v, out, depth + 1)
    elif isinstance(obj, list | tuple):
        for v in obj:
            _strings(v, out, depth + 1)


def topology_from_nccl_log(doc: dict) -> dict:
    """What NCCL reported it used: transports between peers, GPUDirect RDMA, NICs, hosts and ranks.

    Reads the `transports` of a diag.nccl_log document (`by_kind` counts, `gdrdma` /
    `no_gdrdma` counts, `nics`, `peers`) and its findings; falls back to scanning every
    string in `transports` for transport names when the structure differs.
    """
    topo = empty_topology()
    transports = doc.get("transports") or {}
    kinds: list[str] = []
    if isinstance(transports, dict) and isinstance(transports.get("by_kind"), dict):
        kinds = [k for k, n in transports["by_kind"].items() if n]
    texts: list[str] = list(kinds)
    _strings(transports.get("peers") if isinstance(transports, dict) else transports, texts)
    if not kinds:
        _strings(transports, texts)
    blob = "\n".join(texts)
    finding_ids = {f.get("id") for f in doc.get("findings") or [] if isinstance(f, dict)}
    ib = re.search(r"NET/IB|NET/AWS|NET/OFI|GDRDMA", blob) is not None
    sock = re.search(r"NET/Socket", blob, re.I) is not None or "net_socket_fallback" in finding_ids
    if ib:
        topo["transport"] = "ib"
        counts = transports if isinstance(transports, dict) else {}
        if isinstance(counts.get("gdrdma"), int) and isinstance(counts.get("no_gdrdma"), int):
            topo["gdrdma"] = counts["gdrdma"] > 0 and counts["no_gdrdma"] == 0
        else:
            topo["gdrdma"] = "GDRDMA" in blob
        if "ib_no_gdrdma" in finding_ids:
            topo["gdrdma"] = False
    elif sock:
        topo["transport"] = "socket"
    if re.search(r"\bNVLS\b", blob):
        topo["intra_transport"] = "nvls"
    elif re.search(r"P2P|CUMEM|\bIPC\b|direct pointer", blob):
        topo["intra_transport"] = "p2p"
    elif re.search(r"\bSHM\b", blob) or "intra_node_shm" in finding_ids:
        topo["intra_transport"] = "shm"
    nics = transports.get("nics") if isinstance(transports, dict) else None
    nic_ids = set(re.findall(r"NET/(?:IB|Socket|IBext\w*)/(\d+)", blob))
    if isinstance(nics, list) and nics:
        topo["nics_per_node"] = len(nics)
    elif nic_ids:
        topo["nics_per_node"] = len(nic_ids)
    hosts = doc.get("hosts") or []
    if isinstance(hosts, dict):
        hosts = list(hosts)
    ranks = doc.get("ranks") or []
    if hosts:
        topo["nodes"] = len(hosts)
    nranks = [n for r in ranks if isinstance(r, dict) and isinstance(n := r.get("nranks"), int)]
    if hosts and nranks:
        topo["gpus_per_node"] = max(1, math.ceil(max(nranks) / len(hosts)))
    topo["sources"].append("NCCL log")
    return topo


def merge_topology(*topos: dict | None) -> dict:
    """Later topologies override earlier ones where they know a value."""
    out = empty_topology()
    for topo in topos:
        if not topo:
            continue
        for k, v in topo.items():
            if k in ("sources", "notes"):
                out[k] = out[k] + [x for x in v if x not in out[k]]
            elif v is not None:
                out[k] = v
    return out


# ---------------------------------------------------------------- expectation


def _nodes_and_gpus(test: dict, topo: dict) -> tuple[int | None, int | None]:
    world = test.get("world_size")
    hosts = test.get("hosts") or sorted({d.get("host") for d in test.get("devices") or [] if d.get("host")})
    nodes = topo.get("nodes") or (len(hosts) if hosts else None)
    gpn = topo.get("gpus_per_node")
    if nodes is None and world and gpn:
        nodes = max(1, math.ceil(world / gpn))
    if gpn is None and world and nodes:
        gpn = max(1, math.ceil(world / nodes))
    return nodes, gpn


def expected_busbw(topo: dict, nodes: int | None = None, gpus_per_node: int | None = None) -> dict:
    """The large-message busbw a healthy system of this topology reaches, and how it was derived.

    Within one node the GPU link bounds busbw; across nodes, also the node's NICs together
    (NCCL spreads its rings over every NIC), whichever is slower.
    """
    nodes = nodes if nodes is not None else topo.get("nodes")
    gpn = gpus_per_node if gpus_per_node is not None else topo.get("gpus_per_node")
    if nodes is None and topo.get("inter") in LINKS:
        # A network named for a run whose nodes are unknown: judged on the GPU link alone, a run
        # across nodes would be held to a rate its network can not give.
        return _expected(None, _NODES_UNKNOWN, None)
    parts: list[tuple[float, str, str]] = []
    if topo.get("intra") in LINKS and (gpn is None or gpn > 1):
        parts.append(_gpu_link_part(topo))
    if nodes is not None and nodes > 1:
        if topo.get("inter") not in LINKS:
            return _expected(None, _NO_NETWORK, None)
        parts.append(_network_part(topo))
    if not parts:
        return _expected(None, "the link between GPUs is unknown (pass --intra or --topo)", None)
    return _expected(*min(parts, key=lambda p: p[0]))


def network_busbw(topo: dict) -> dict:
    """The large-message busbw of the network between nodes alone, whatever the GPUs' own links:
    what a hierarchical collective's inter-node stage gets (`diag plan`'s inter-node rate)."""
    if topo.get("inter") not in LINKS:
        return _expected(None, _NO_NETWORK, None)
    return _expected(*_network_part(topo))


_NO_NETWORK = "the network between nodes is unknown (pass --inter)"
_NODES_UNKNOWN = ("--inter names the network, but not how many nodes the run spans (pass --nodes or "
                  "--gpus-per-node)")


def _expected(value: float | None, basis: str, bottleneck: str | None) -> dict:
    return {"expected_busbw_gbps": value, "basis": basis, "bottleneck": bottleneck}


def _gpu_link_part(topo: dict) -> tuple[float, str, str]:
    link = LINKS[topo["intra"]]
    raw = topo.get("intra_gbps") or link.gbps
    return raw * link.efficiency, f"{link.label}: {raw:g} GB/s x {link.efficiency:.0%}", "gpu link"


def _network_part(topo: dict) -> tuple[float, str, str]:
    link = LINKS[topo["inter"]]
    nics = topo.get("nics_per_node") or 1
    return (nics * link.gbps * link.efficiency,
            f"{nics} x {link.label} per node: {nics * link.gbps:g} GB/s x {link.efficiency:.0%}", "network")


def large_message_busbw(test: dict) -> tuple[float | None, int | None]:
    """Median of each large row's best busbw (out-of-place or in-place), and the largest size."""
    rows = [r for r in test.get("rows") or [] if r.get("size_bytes")]
    if not rows:
        return None, None
    largest = max(r["size_bytes"] for r in rows)
    cut = min(LARGE_MESSAGE_BYTES, largest)
    values = []
    for r in rows:
        if r["size_bytes"] < cut:
            continue
        best = [g.get("busbw_gbps") for g in (r.get("out_of_place"), r.get("in_place")) if g]
        best = [b for b in best if isinstance(b, int | float) and math.isfinite(b)]
        if best:
            values.append(max(best))
    if not values:
        return None, largest
    values.sort()
    mid = len(values) // 2
    median = values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
    return median, largest


def bandwidth_facts(test: dict, topo: dict | None = None) -> dict:
    """What one test of diag.nccl_bench/1 measured and what its topology should reach, with
    the topology facts the judgement names (diag.analyzers.diagnosis.bandwidth judges them)."""
    topo = topo or empty_topology()
    measured, largest = large_message_busbw(test)
    nodes, gpn = _nodes_and_gpus(test, topo)
    exp = expected_busbw(topo, nodes, gpn)
    inter, intra = LINKS.get(topo.get("inter") or ""), LINKS.get(topo.get("intra") or "")
    return {
        "measured_busbw_gbps": measured,
        "largest_size_bytes": largest,
        "expected_busbw_gbps": exp["expected_busbw_gbps"],
        "expected_basis": exp["basis"],
        "nodes": nodes,
        "gpus_per_node": gpn,
        "world_size": test.get("world_size"),
        "backend": test.get("backend"),
        "inter_kind": inter.kind if inter else None,
        "intra_kind": intra.kind if intra else None,
        "transport": topo.get("transport"),
        "intra_transport": topo.get("intra_transport"),
        "gdrdma": topo.get("gdrdma"),
    }
