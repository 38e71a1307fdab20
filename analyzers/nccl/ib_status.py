"""Code tables for NCCL and InfiniBand errors, so findings can say what a number means.

`IBV_WC_STATUS` follows `enum ibv_wc_status` of libibverbs (verbs.h); the explanations say
what usually causes each status on a GPU cluster. `NCCL_RESULT` follows `ncclResult_t`.
"""

from __future__ import annotations

IBV_WC_STATUS: dict[int, tuple[str, str]] = {
    0: ("IBV_WC_SUCCESS", "success"),
    1: ("IBV_WC_LOC_LEN_ERR", "local length error: a posted buffer was too small for the incoming message"),
    2: ("IBV_WC_LOC_QP_OP_ERR", "local QP operation error: an internal queue-pair inconsistency on this side"),
    3: ("IBV_WC_LOC_EEC_OP_ERR", "local EE context operation error"),
    4: ("IBV_WC_LOC_PROT_ERR", "local protection error: the HCA may not access the registered buffer "
        "(memory registration / GPUDirect RDMA problem, e.g. nvidia-peermem or dmabuf not working)"),
    5: ("IBV_WC_WR_FLUSH_ERR", "work request flushed: the queue pair already went to the error state "
        "because of an earlier failure; look for the first completion error"),
    6: ("IBV_WC_MW_BIND_ERR", "memory window bind error"),
    7: ("IBV_WC_BAD_RESP_ERR", "bad response: unexpected transport-layer opcode from the responder"),
    8: ("IBV_WC_LOC_ACCESS_ERR", "local access error: protection error on a local buffer of an RDMA operation"),
    9: ("IBV_WC_REM_INV_REQ_ERR", "remote invalid request: the responder rejected the request "
        "(message too long or unsupported operation)"),
    10: ("IBV_WC_REM_ACCESS_ERR", "remote access error: the peer's memory key or buffer was not accessible "
         "(registration or GPUDirect RDMA problem on the remote node)"),
    11: ("IBV_WC_REM_OP_ERR", "remote operation error: the responder could not complete the operation"),
    12: ("IBV_WC_RETRY_EXC_ERR", "transport retry counter exceeded: the peer did not acknowledge in time "
         "(peer process dead, link down or flapping, congestion, or a wrong GID/route; "
         "see NCCL_IB_TIMEOUT, NCCL_IB_RETRY_CNT, cables and switch counters)"),
    13: ("IBV_WC_RNR_RETRY_EXC_ERR", "receiver-not-ready retry counter exceeded: the peer posted no receive "
         "buffer in time (peer stalled or gone)"),
    14: ("IBV_WC_LOC_RDD_VIOL_ERR", "local RDD violation error"),
    15: ("IBV_WC_REM_INV_RD_REQ_ERR", "remote invalid RD request"),
    16: ("IBV_WC_REM_ABORT_ERR", "remote aborted: the responder aborted the operation"),
    17: ("IBV_WC_INV_EECN_ERR", "invalid EE context number"),
    18: ("IBV_WC_INV_EEC_STATE_ERR", "invalid EE context state"),
    19: ("IBV_WC_FATAL_ERR", "fatal error of the HCA: check the adapter, firmware and driver (dmesg)"),
    20: ("IBV_WC_RESP_TIMEOUT_ERR", "response timeout: no response from the peer"),
    21: ("IBV_WC_GENERAL_ERR", "general error reported by the HCA driver"),
    22: ("IBV_WC_TM_ERR", "tag matching error"),
    23: ("IBV_WC_TM_RNDV_INCOMPLETE", "tag matching rendezvous incomplete"),
}

NCCL_RESULT: dict[int, tuple[str, str]] = {
    0: ("ncclSuccess", "success"),
    1: ("ncclUnhandledCudaError", "a call to CUDA failed"),
    2: ("ncclSystemError", "a system call (socket, malloc, ...) or an external library call failed"),
    3: ("ncclInternalError", "an internal NCCL check failed (NCCL bug or memory corruption)"),
    4: ("ncclInvalidArgument", "an argument given to NCCL was invalid"),
    5: ("ncclInvalidUsage", "NCCL was used incorrectly by the program"),
    6: ("ncclRemoteError", "a remote process failed or the network broke (peer exited, connection closed)"),
    7: ("ncclInProgress", "a non-blocking operation is still in progress"),
}


def ib_status(code: int) -> dict:
    """{"code", "name", "meaning"} for an ibv_wc_status value (unknown codes are kept)."""
    name, meaning = IBV_WC_STATUS.get(code, (f"IBV_WC_STATUS_{code}", "status code not in the ibv_wc_status table"))
    return {"code": code, "name": name, "meaning": meaning}


def ib_status_by_name(name: str) -> int | None:
    for code, (n, _) in IBV_WC_STATUS.items():
        if n == name:
            return code
    return None


def nccl_result(code: int) -> dict:
    name, meaning = NCCL_RESULT.get(code, (f"ncclResult {code}", "unknown result code"))
    return {"code": code, "name": name, "meaning": meaning}
