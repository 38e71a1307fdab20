"""`diag plan`: per-GPU memory, fit, communication and step time of a training layout, and
with `--search` the best layouts for the GPUs at hand (diag.analyzers.plan)."""

from __future__ import annotations

import json
import sys

from diag.errors import DiagInputError

HELP = "plan memory and parallelism: per-GPU memory, fit, communication and step time of a layout"
GIB = 2**30


def add_arguments(parser) -> None:
    m = parser.add_argument_group("model (one of)")
    m.add_argument("--model", metavar="PRESET", help="a published configuration: llama3-8b, llama3-70b, "
                   "llama3-405b, llama2-7b, llama2-70b, mistral-7b, gpt3-175b, gpt2")
    m.add_argument("--hf-config", metavar="FILE", help="a Hugging Face config.json on disk (never downloaded)")
    m.add_argument("--params", type=float, help="parameter count (memory of model states only)")
    m.add_argument("--layers", type=int, help="transformer layers (a model of your own, with --hidden and --heads)")
    m.add_argument("--hidden", type=int, help="hidden size (d_model)")
    m.add_argument("--heads", type=int, help="attention heads")
    m.add_argument("--kv-heads", type=int, help="key/value heads (grouped-query attention; default --heads)")
    m.add_argument("--ffn", type=int, help="feed-forward size (default: LLaMA's 8/3 x --hidden, rounded up to 256)")
    m.add_argument("--vocab", type=int, default=32000, help="vocabulary size (default 32000)")
    m.add_argument("--seq", type=int, help="sequence length (default: the model's context)")
    j = parser.add_argument_group("job")
    j.add_argument("--gpus", type=int, help="GPUs of the layout (with --run: default the run's ranks)")
    j.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    j.add_argument("--micro-batch", type=int, help="sequences per GPU per micro-batch (default 1; with --run "
                   "and the run's own model: the run's samples per step)")
    j.add_argument("--global-batch", type=int,
                   help="sequences per optimizer step over all GPUs (default: micro-batch x data-parallel size)")
    j.add_argument("--precision", default="bf16-mixed", choices=["fp32", "tf32", "bf16-mixed", "fp16-mixed",
                                                                  "fp8-mixed"],
                   help="training precision (default bf16-mixed: bf16 compute, fp32 master weights)")
    j.add_argument("--optimizer", default="adamw", choices=["adam", "adamw", "sgd", "adafactor"],
                   help="optimizer, for the bytes of its state per parameter (default adamw)")
    j.add_argument("--zero", default="0", choices=["0", "1", "2", "3", "fsdp-full", "fsdp-grad-op"],
                   help="what is sharded over data-parallel ranks: ZeRO stage or FSDP strategy (default 0: none)")
    j.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    j.add_argument("--pp", type=int, default=1, help="pipeline-parallel stages (default 1)")
    j.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp > 1)")
    j.add_argument("--recompute", default="none", choices=["none", "selective", "full"],
                   help="activation recomputation (default none)")
    j.add_argument("--offload", action="store_true", help="optimizer states (and ZeRO-3 parameters) in CPU memory")
    j.add_argument("--attention", default="flash", choices=["flash", "eager"],
                   help="flash (SDPA/FlashAttention, the default on GPUs) keeps no s x s scores; eager does")
    j.add_argument("--gpu-memory", type=float, metavar="GIB", help="memory per GPU in GiB")
    j.add_argument("--device", help="a device of diag's table (h100-sxm, a100-80gb, mi300x, ...): memory and peaks")
    r = parser.add_argument_group("rates")
    r.add_argument("--mfu", type=float, default=None, help="achieved share of the datasheet peak "
                   "(default 0.45 when no measured rate is given)")
    r.add_argument("--intra", help="link inside a node (nvlink4, pcie5, ...): its healthy bus bandwidth")
    r.add_argument("--inter", help="network between nodes (ib_ndr, roce_400, eth_100, ...)")
    r.add_argument("--nics-per-node", type=int, help="network cards per node used across nodes (default: the "
                   "reference system's for --device, else 1)")
    r.add_argument("--nccl", nargs="+", metavar="FILE", help="measured bus bandwidth: nccl-tests output or "
                   "`diag nccl --json` documents (across nodes when the run spanned hosts, else inside a node)")
    r.add_argument("--tokens", type=float, help="tokens to train on: prints the time to train")
    parser.add_argument("--run", metavar="RUN_DIR", help="an agent run: its measured FLOP/s, step split, bus "
                        "bandwidth (and RUN_DIR/nccl_bench.json) and, without model flags, its recorded model")
    parser.add_argument("--search", action="store_true", help="rank every valid layout for these GPUs")
    parser.add_argument("--json", action="store_true", help="print the diag.plan/1 document")


def _model(args):
    from diag.analyzers.plan import models

    chosen = [x for x in (args.model, args.hf_config, args.params, args.layers) if x is not None]
    if not chosen and args.run:
        return "run"
    if len(chosen) != 1:
        raise DiagInputError("give the model once: --model PRESET, --hf-config FILE, --params N, or the shape "
                             "flags --layers --hidden --heads --seq")
    if args.model:
        return models.with_seq(models.preset(args.model), args.seq)
    if args.hf_config:
        return models.with_seq(models.from_hf_config(args.hf_config), args.seq)
    if args.params is not None:
        return None
    if not (args.hidden and args.heads and args.seq):
        raise DiagInputError("shape flags need --layers, --hidden, --heads and --seq")
    return models.from_shape(args.layers, args.hidden, args.heads, args.seq, args.kv_heads, args.ffn, args.vocab)


def _device(args, facts: dict | None = None):
    if not args.device:
        if facts and facts.get("device"):  # the run's own device, where diag's table knows it
            from diag.analyzers.trace import devices

            name = str(facts["device"])
            return devices.cpu_device() if name == "cpu" else devices.lookup({"name": name})
        return None
    from diag.analyzers.trace.devices import PEAKS

    key = args.device.lower()
    matches = [d for k, d in PEAKS.items() if k == key or k.startswith(key)]
    if not matches:
        raise DiagInputError(f"unknown device {args.device!r}; known: {', '.join(sorted(PEAKS))}")
    return matches[0]


def _rates(args, device, dtype: str):
    from diag.analyzers.nccl import expected
    from diag.analyzers.plan.planner import DEFAULT_MFU, REFERENCE_LINKS, Rates

    peak = device.peak_flops(dtype) if device else None
    mfu = args.mfu if args.mfu is not None else DEFAULT_MFU
    sources = {}
    if peak:
        sources["flops"] = f"{device.name} datasheet peak {peak / 1e12:.0f} TFLOP/s ({dtype}) x MFU {mfu:.0%}" + (
            "" if args.mfu is not None else " (assumed; measured rates replace it)")
    intra = inter = None
    link_in, link_out, nics = args.intra, args.inter, args.nics_per_node
    ref = REFERENCE_LINKS.get(device.key) if device is not None and not args.nccl else None
    assumed = f" (assumed: the links of the {ref[3]} reference system; --intra, --inter or --nccl replace it)" \
        if ref else ""
    if ref and not link_in:
        link_in = ref[0]
    if ref and not link_out:
        link_out, nics = ref[1], nics or ref[2]
    topo = expected.topology_from_flags(link_in, link_out, nics, args.gpus_per_node)
    if link_in:
        e = expected.expected_busbw(topo, nodes=1)
        intra = (e["expected_busbw_gbps"] or 0) * 1e9 or None
        sources["intra_busbw"] = e["basis"] + (assumed if not args.intra else "")
    if link_out:
        e = expected.network_busbw(topo)
        inter = (e["expected_busbw_gbps"] or 0) * 1e9 or None
        sources["inter_busbw"] = e["basis"] + (assumed if not args.inter else "")
    for where, (bw, basis) in _measured_busbw(args.nccl or [], args.gpus_per_node).items():
        sources[f"{where}_busbw"] = basis
        if where == "intra":
            intra = bw
        else:
            inter = bw
    return Rates(flops_per_gpu=peak * mfu if peak else None, peak_flops=peak, intra_busbw=intra,
                 inter_busbw=inter, sources=sources)


def _measured_busbw(files: list[str], gpus_per_node: int) -> dict:
    """{"intra" | "inter": (bytes/s, basis)}: the best large-message bus bandwidth measured in
    the files, inside a node or across nodes (by the hosts, else the ranks, of each run)."""
    from pathlib import Path

    from diag.analyzers.nccl import expected, nccl_tests

    best: dict = {}
    for f in files:
        path = Path(f)
        try:
            head = path.read_bytes()[:1].strip()
        except OSError as exc:
            raise DiagInputError(f"{f}: cannot read ({exc.strerror or exc})") from None
        if head == b"{":
            try:
                doc = json.loads(path.read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError) as exc:
                raise DiagInputError(f"{f}: not a readable JSON document ({exc})") from None
            tests: list = doc["tests"] if isinstance(doc, dict) and isinstance(doc.get("tests"), list) else []
        else:
            tests = nccl_tests.parse_file(path).get("tests") or []
        for t in tests:
            if not isinstance(t, dict):
                continue
            bw, size = expected.large_message_busbw(t)
            if not bw:
                continue
            hosts = len(set(t.get("hosts") or []))
            world = t.get("world_size") or 0
            where = "inter" if hosts > 1 or (not hosts and world > gpus_per_node) else "intra"
            if bw * 1e9 > best.get(where, (0.0, ""))[0]:
                best[where] = (bw * 1e9, f"measured: {bw:.1f} GB/s {t.get('collective') or ''} busbw "
                                         f"({world or '?'} ranks, {size} B messages) in {path.name}")
    if files and not best:
        raise DiagInputError("no bus bandwidth measurement in " + ", ".join(files))
    return best


def run(args) -> int:
    from diag.analyzers.plan.memory import model_states
    from diag.analyzers.plan.planner import SCHEMA, Job, data_parallel, plan, time_to_train
    from diag.analyzers.plan.search import search

    facts = _run_facts(args.run) if args.run else None
    if args.run:
        from pathlib import Path

        from diag import rundir

        bench = Path(args.run) / rundir.NCCL_BENCH  # `diag nccl --run-dir` wrote it: a measurement on these nodes
        if bench.is_file():
            args.nccl = [*(args.nccl or []), str(bench)]
    model = _model(args)
    if model == "run" and facts is not None:  # "run" comes only with --run
        model = _recorded_model(facts)
    if args.gpus is None:
        if facts is None:
            raise DiagInputError("give --gpus (or --run RUN_DIR to plan the run's own number of ranks)")
        args.gpus = facts["world_size"]
    if args.micro_batch is None:
        own = facts is not None and model is None and args.params is None and facts.get("samples_per_step")
        args.micro_batch = int(facts["samples_per_step"]) if own and facts is not None else 1
    device = _device(args, facts)
    mem = args.gpu_memory * GIB if args.gpu_memory else (device.mem_bytes if device else None)
    job = Job(gpus=args.gpus, gpus_per_node=args.gpus_per_node, micro_batch=args.micro_batch,
              global_batch=args.global_batch, seq=args.seq, precision=args.precision, optimizer=args.optimizer,
              sharding=args.zero, tp=args.tp, pp=args.pp, sp=args.sp, recompute=args.recompute,
              offload=args.offload, flash=args.attention == "flash", gpu_memory_bytes=mem)
    if model is None and args.params is not None:  # --params: model states only
        dp = data_parallel(args.gpus, args.tp, args.pp)
        st = model_states(args.params, args.precision, args.optimizer, args.zero, dp, args.tp, args.pp)
        doc: dict = {"schema": SCHEMA, "model": {"params": args.params}, "per_gpu": {
            "params_bytes": st.params_bytes, "grads_bytes": st.grads_bytes, "optimizer_bytes": st.optimizer_bytes,
            "model_states_bytes": st.total_bytes}, "note": "activations need the model's shape (--model or "
            "--hf-config or the shape flags)"}
        return _emit(args, doc, _states_text(doc))
    dtype = "fp32" if args.precision == "fp32" else "tf32" if args.precision == "tf32" else "bf16"
    rates = _rates(args, device, dtype)
    if facts is not None:
        from diag.analyzers.plan.measured import measured_rates

        rates = measured_rates(facts, rates)
    if model is None:  # the run's own model, without a transformer shape
        if facts is None:
            raise DiagInputError("give the model's shape: --model, --hf-config or the shape flags")
        return _emit(args, *_own_model(args, facts, job, rates))
    if args.search:
        batch = job.global_batch
        if batch is None:
            from dataclasses import replace

            from diag.analyzers.plan.planner import default_global_batch

            batch = default_global_batch(job.seq or model.seq, job.gpus)
            job = replace(job, global_batch=batch)
        doc = search(model, job, rates)
        if args.global_batch is None:
            doc["global_batch"] = {"sequences": batch, "assumed": True,
                                   "why": f"about {batch * (job.seq or model.seq) / 1e6:.1f}M tokens per "
                                          "step, the default (--global-batch sets it)"}
        return _emit(args, doc, _search_text(doc))
    doc = plan(model, job, rates)
    if args.tokens:
        doc["time_to_train_s"] = time_to_train(doc, args.tokens)
        doc["tokens"] = args.tokens
    if facts is not None:
        doc["measured"] = _measured_block(facts)
    return _emit(args, doc, _plan_text(doc))


def _run_facts(path: str) -> dict:
    from pathlib import Path

    from diag.analyzers.analyze import analyze_run_dir as analyze_run
    from diag.analyzers.analyze import json_safe
    from diag.analyzers.plan.measured import run_facts
    from diag.rundir import MANIFEST, is_run_dir

    if not is_run_dir(path):
        raise DiagInputError(f"{path}: not a diag run directory (no {MANIFEST} and no rank-N folder)")
    return run_facts(json_safe(analyze_run(Path(path))))  # the run's analysis as `diag analyze --json` prints it


def _recorded_model(facts: dict):
    """The run's model as a transformer when the agent recorded its configuration, else None."""
    from diag.analyzers.plan import models

    cfg = (facts.get("model") or {}).get("config")
    if not cfg:
        return None
    try:
        return models.from_hf_dict(cfg, "the configuration the agent recorded", "")
    except DiagInputError:
        return None  # a configuration that is not a decoder's: planned from the recorded facts


def _own_model(args, facts: dict, job, rates) -> tuple[dict, str]:
    from dataclasses import replace

    from diag.analyzers.plan.measured import plan_own_model, self_check

    if args.search:
        raise DiagInputError("--search needs the model's transformer shape: give --model, --hf-config or the "
                             "shape flags")
    doc = plan_own_model(facts, job, rates)
    same = job.gpus == facts["world_size"] and job.micro_batch == facts.get("samples_per_step")
    run_layout = doc if same and job.sharding == "0" else plan_own_model(
        facts, replace(job, gpus=facts["world_size"], sharding="0",
                       micro_batch=int(facts.get("samples_per_step") or job.micro_batch)), rates)
    doc["self_check"] = self_check(facts, run_layout.get("step_time_s"))
    doc["measured"] = _measured_block(facts)
    return doc, _plan_text(doc)


def _measured_block(facts: dict) -> dict:
    keep = ("source", "world_size", "hosts", "device", "achieved_flops_per_s", "flops_per_step", "flops_per_sample",
            "flops_per_token", "profiled_steps", "step_time_s", "shares", "samples_per_step", "busbw_gbps")
    return {k: facts.get(k) for k in keep}


def _emit(args, doc: dict, text: str) -> int:
    if args.json:
        json.dump(doc, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(text)
    return 0


def _gib(x) -> str:
    return "n/a" if x is None else f"{x / GIB:9.2f} GiB"


def _states_text(doc: dict) -> str:
    g = doc["per_gpu"]
    return "".join(f"{k.replace('_bytes', ''):<14}{_gib(g[k])}\n" for k in
                   ("params_bytes", "grads_bytes", "optimizer_bytes", "model_states_bytes")) + doc["note"] + "\n"


def params_text(n: float) -> str:
    """A parameter count as people say it: 70.6B, 1.59M, 4.1K, 530."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def _plan_text(doc: dict) -> str:
    m, lay, g = doc["model"], doc["layout"], doc["per_gpu"]
    shape = (f", {m['layers']} layers, hidden {m['hidden']}, seq {m['seq']}" if m.get("layers") else
             f" ({m.get('source')})")
    lines = [f"{m['name']}: {params_text(m['params'])} parameters{shape}",
             f"layout: {lay['gpus']} GPUs = tp {lay['tp']} x pp {lay['pp']} x dp {lay['dp']}, ZeRO-{lay['zero_stage']}"
             + (f", recompute {lay['recompute']}" if "recompute" in lay else "")
             + f", micro-batch {lay['micro_batch']} x {lay['grad_accum']} accumulation = global batch "
             f"{lay['global_batch']}", "", "per GPU:"]
    for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "allowance_bytes",
              "total_bytes"):
        lines.append(f"  {k.replace('_bytes', ''):<12}{_gib(g[k])}")
    if g.get("note"):
        lines.append(f"  ({g['note']})")
    if g["gpu_memory_bytes"] and doc["fits"] is not None:
        lines.append(f"  {'capacity':<12}{_gib(g['gpu_memory_bytes'])}  -> "
                     + ("fits" if doc["fits"] else "DOES NOT FIT"))
    lines.append("communication per GPU per step: " + (", ".join(
        f"{k} {v / 1e9:.3g} GB" for k, v in doc["comm_bytes_per_step"].items() if v) or "none"))
    if doc.get("step_time_s"):
        b = doc["breakdown_s"]
        lines.append(f"predicted step: {_s(doc['step_time_s'])} (compute {_s(b['compute'])}, tp {_s(b['tp_comm'])}, "
                     f"pp {_s(b['pp_comm'])}, exposed dp {_s(b['dp_comm_exposed'])}, bubble "
                     f"{_s(b['pipeline_bubble'])}" + (f", data and host {_s(b['overhead'])}" if b.get("overhead")
                                                     else "") + ")"
                     + (f", MFU {doc['mfu']:.0%}" if doc.get("mfu") else ""))
    elif doc.get("missing"):
        lines.append(f"no step time: {doc['missing']}")
    check = doc.get("self_check")
    if check:
        lines.append(f"the run's own layout: predicted {_s(check['predicted_step_s'])} per step, measured "
                     f"{_s(check['measured_step_s'])} ({check['error']:+.0%})")
    if doc.get("time_to_train_s"):
        lines.append(f"time to train on {doc['tokens']:.3g} tokens: {doc['time_to_train_s'] / 86400:.1f} days")
    for k, v in doc.get("rates", {}).items():
        lines.append(f"rate {k}: {v}")
    return "\n".join(lines) + "\n"


def _s(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.3f} s"


def _search_text(doc: dict) -> str:
    gb = doc.get("global_batch")
    lines = [f"global batch {gb['sequences']} sequences: {gb['why']}"] if gb else []
    lines.append(f"{doc['layouts_considered']} valid layouts, {doc['layouts_fitting']} fit; best:")
    for i, b in enumerate(doc["best"], 1):
        lines.append(f"  {i}. {b['layout']}: {b['why']}")
    lines.append("why the others lose:")
    for k, v in doc["losers"].items():
        if v["count"]:
            lines.append(f"  {k.replace('_', ' ')}: {v['count']} layouts, e.g. {v['example']}: {v['why']}")
    for k, v in doc.get("rates", {}).items():
        lines.append(f"rate {k}: {v}")
    return "\n".join(lines) + "\n"
