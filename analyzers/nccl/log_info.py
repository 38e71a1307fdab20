"""The NCCL INFO lines of a log: one handler per first word of the message (INFO_HANDLERS),
each a function over the parser's state (log_state.LogState); the rest fall through to cheap
substring tests (info_other). Topology, versions, communicators, interfaces and the
environment are read here; collectives, tuning and transports in log_collectives.
"""

from __future__ import annotations

import re

from diag.analyzers.nccl.log_collectives import coll, table, transport, tune
from diag.analyzers.nccl.log_errors import chain
from diag.analyzers.nccl.log_grammar import (
    _CHAIN,
    _ENV,
    _IFACE,
    _INIT,
    _IP,
    _RING,
    _SUMMARY,
    _VERSION,
    MAX_COMMS,
    MAX_INTERFACES,
    MAX_RANKS,
    MAX_SET,
)
from diag.analyzers.nccl.log_state import LogState


def info(p: LogState, line: str, pre: str, msg: str) -> None:
    pfx = p.prefix(pre)
    sp = msg.find(" ")
    handler = INFO_HANDLERS.get(msg[:sp] if sp > 0 else msg)
    if handler is not None:
        handler(p, line, pfx, msg)
    else:
        info_other(p, line, pfx, msg, sp)


def info_other(p: LogState, line: str, pfx: tuple, msg: str, sp: int) -> None:
    if sp <= 0:
        if "|" in msg:  # rows of the TUNING model table start with spaces
            table(p, msg)
        return
    w = msg[:sp]
    last = w[-1]
    if last == ":":
        if ": opCount " in msg:
            coll(p, line, msg)
        elif " Bytes -> Algo " in msg:
            tune(p, line, msg)
        return
    if w.startswith(("NCCL_", "RCCL_")):
        env(p, line, msg)
        return
    if ".c" in w or ".h" in w:  # "file.cc:123 -> 3": an error chain frame
        m = _CHAIN.match(msg)
        if m:
            chain(p, line, pfx, m)
        return
    if "|" in msg:
        table(p, msg)
        return
    if " coll channels" in msg:
        for n, kind in _SUMMARY.findall(msg):
            p.summary[kind] = max(p.summary.get(kind, 0), int(n))
        return
    if " Bytes -> Algo " in msg:  # 2.1x TUNING lines without the op name
        tune(p, line, msg)
        return
    if "CollNet" in msg:
        p.collnet_lines += 1
        return
    if "Init FAILED" in msg:
        p.signal("init_failure", line)


def info_channel(p: LogState, line, pfx, msg) -> None:
    if " via " in msg:
        transport(p, line, pfx, msg)
        return
    m = _RING.match(msg)
    if m:
        key = (int(m.group(1)), int(m.group(2)))
        if key not in p.rings and len(p.rings) < 1024:
            p.rings[key] = [int(x) for x in m.group(3).split()]


def info_connected(p: LogState, line, pfx, msg) -> None:
    p.signal("connected_" + msg.rsplit(" ", 1)[-1], line)


def info_version(p: LogState, line, pfx, msg) -> None:
    m = _VERSION.search(msg)
    if m:
        p.note_version(m.group(1), m.group(2), line)


def info_trees(p: LogState, line, pfx, msg) -> None:
    trees(p, msg)


def info_nvls(p: LogState, line, pfx, msg) -> None:
    nvls(p, line, pfx, msg)


def info_net(p: LogState, line, pfx, msg) -> None:
    net(p, line, msg)


def info_using(p: LogState, line, pfx, msg) -> None:
    if msg.startswith("Using network "):
        net = msg[14:].strip()
        if net:
            p.net_used[net] = p.net_used.get(net, 0) + 1
            p.signal("using_network_" + net.split()[0].lower(), line)


def info_bootstrap(p: LogState, line, pfx, msg) -> None:
    m = _IP.search(msg)
    if m and len(p.ips) < MAX_SET:
        p.ips.add(m.group(1))
    if "Using" in msg:
        interfaces(p, "bootstrap", msg, line)


def interfaces(p: LogState, role: str, text: str, line: str) -> None:
    """The interfaces NCCL says it uses for `role` (bootstrap, socket, oob), each once."""
    for m in _IFACE.finditer(text):
        key = (role, m.group(1), m.group(2))
        if key not in p.interfaces and len(p.interfaces) < MAX_INTERFACES:
            p.interfaces[key] = line


def info_failed(p: LogState, line, pfx, msg) -> None:
    if "libibverbs" in msg:
        p.signal("ibverbs_missing", line)


def info_cuda_driver(p: LogState, line, pfx, msg) -> None:
    try:
        if p.cuda_driver is None:
            p.cuda_driver = int(msg.split()[1])
    except (IndexError, ValueError):
        pass


def info_init(p: LogState, line, pfx, msg) -> None:
    if " rank " in msg:
        comm_init(p, line, pfx, msg)


def info_could(p: LogState, line, pfx, msg) -> None:
    if "Could not find a path" in msg:
        p.signal("topology_fallback", line)


def info_ignore(p: LogState, line, pfx, msg) -> None:
    return


def trees(p: LogState, msg: str) -> None:
    t = p.trees
    t["lines"] += 1
    tokens = msg[5:].split()
    # tokens alternate "[channel]" and the tree of that channel; parse each distinct tree once
    t["channels"] = max(t["channels"], len(tokens) // 2)
    if len(t["examples"]) < p.cap:
        t["examples"].append(msg[:300])
    for part in set(tokens[1::2]):
        pieces = part.split("->")
        if len(pieces) != 3:
            continue
        if "/" in pieces[0]:  # 2.5+: down0/down1/down2->rank->up
            t["notation"] = "down->rank->up"
            if pieces[2] == "-1" and len(t["roots"]) < 4096:
                t["roots"].add(int(pieces[1]))
        else:  # 2.4: up->rank->down0/down1/down2
            t["notation"] = t["notation"] or "up->rank->down"
            if pieces[0] == "-1" and len(t["roots"]) < 4096:
                t["roots"].add(int(pieces[1]))


def nvls(p: LogState, line: str, pfx: tuple, msg: str) -> None:
    if msg.startswith("NVLS multicast support is"):
        dev = msg.rsplit(" ", 1)[-1]
        key = (pfx[0], pfx[1], dev)
        if " not available" in msg:
            if len(p.nvls["unavailable"]) < MAX_SET:
                p.nvls["unavailable"].add(key)
            p.signal("nvls_unavailable", line)
        elif len(p.nvls["available"]) < MAX_SET:
            p.nvls["available"].add(key)
            p.signal("nvls_available", line)
    elif msg.startswith("NVLS Head"):
        p.nvls["heads"] += 1
    else:
        p.signal("nvls_other", line)


def env(p: LogState, line: str, msg: str) -> None:
    m = _ENV.match(msg)
    if not m:
        return
    name, value = m.group(1), m.group(2).strip()
    if len(p.env) < 500:
        p.env[name] = value
    p.signal("env_" + name, line)


def net(p: LogState, line: str, msg: str) -> None:
    if msg.startswith("NET/IB") and "Using" in msg:
        nics = re.findall(r"\[\d+\]([\w\-.]+:\d+/\w+)", msg)
        for n in nics:
            if n not in p.nics and len(p.nics) < 256:
                p.nics.append(n)
        if not nics:
            p.signal("ib_no_device", line)
        oob = msg.find("OOB ")
        if oob >= 0:
            interfaces(p, "oob", msg[oob:], line)
    elif msg.startswith("NET/IB") and "No device found" in msg:
        p.signal("ib_no_device", line)
    elif msg.startswith("NET/Socket") and "Using" in msg:
        m = _IP.search(msg)
        if m and len(p.ips) < MAX_SET:
            p.ips.add(m.group(1))
        interfaces(p, "socket", msg, line)
    elif msg.startswith("NET/Plugin"):
        pass


def comm_init(p: LogState, line: str, pfx: tuple, msg: str) -> None:
    m = _INIT.search(msg)
    if not m:
        return
    (comm, rank, nranks, nnodes, local_ranks, _local_rank, cuda_dev, nvml_dev, bus_id,
     comm_id, phase) = m.groups()
    rank, nranks = int(rank), int(nranks)
    if nnodes:
        p.nnodes = max(p.nnodes, int(nnodes))
    cid = comm_id or f"nranks={nranks}"
    c = p.comms.get(cid)
    if c is None and len(p.comms) < MAX_COMMS:
        c = p.comms[cid] = {"comm_id": comm_id, "nranks": nranks, "ranks": set(), "nnodes": None,
                               "local_ranks": None, "init_complete": 0, "hosts": set()}
    key = (pfx[0], pfx[1], comm, rank)
    r = p.ranks.get(key)
    if r is None and len(p.ranks) < MAX_RANKS:
        r = p.ranks[key] = {"rank": rank, "nranks": nranks, "host": pfx[0],
                               "pid": int(pfx[1]) if pfx[1] else None, "cuda_dev": None,
                               "nvml_dev": None, "bus_id": None, "comm": comm, "comm_id": comm_id}
    if r is not None:
        if cuda_dev is not None:
            r["cuda_dev"] = int(cuda_dev)
        if nvml_dev is not None:
            r["nvml_dev"] = int(nvml_dev)
        if bus_id is not None:
            r["bus_id"] = bus_id
        if comm_id and not r["comm_id"]:
            r["comm_id"] = comm_id
    if c is not None:
        if len(c["ranks"]) < MAX_SET:
            c["ranks"].add(rank)
        if pfx[0] and len(c["hosts"]) < 4096:
            c["hosts"].add(pfx[0])
        if nnodes:
            c["nnodes"] = int(nnodes)
            c["local_ranks"] = int(local_ranks)
        if phase == "Init COMPLETE":
            c["init_complete"] += 1
    if phase and phase != "Init START" and phase != "Init COMPLETE":
        p.signal("init_failure", line)


# First word of an INFO message -> handler. Unknown words fall through to info_other.
INFO_HANDLERS = {
    "Channel": info_channel, "Ring": info_channel,
    "Connected": info_connected, "Trees": info_trees,
    "NVLS": info_nvls, "NET/IB": info_net, "NET/IB:": info_net,
    "NET/Socket": info_net, "NET/Plugin": info_ignore,
    "NET/Plugin:": info_ignore, "Using": info_using,
    "Bootstrap": info_bootstrap, "Failed": info_failed,
    "cudaDriverVersion": info_cuda_driver, "comm": info_init,
    "ncclCommInitRank": info_init, "ncclCommInitRankConfig": info_init,
    "ncclCommInitAll": info_init, "ncclCommSplit": info_init,
    "ncclCommInitRankScalable": info_init, "Init": info_init,
    "NCCL": info_version, "RCCL": info_version,
    "Could": info_could, "Setting": info_ignore, "P2P": info_ignore,
    "threadThresholds": info_ignore, "DMA-BUF": info_ignore,
    "TUNER/Plugin:": info_ignore, "Launch": info_ignore,
}
