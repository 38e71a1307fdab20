"""The regression gate's result (diag.analyzers.diagnosis.gate) as a CI job reads it: a
Markdown section for the job summary, and JUnit XML with one test case per tracked figure.
Renders; never judges. Untrusted strings (run paths, reasons) stay text: escaped in
Markdown, and written through ElementTree, which escapes them, in XML."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from diag.report.markdown import md_code, md_text

RESULT_LABEL = {"pass": "PASS", "regression": "REGRESSION", "not_comparable": "NOT COMPARABLE"}


def _value(v, unit: str) -> str:
    if not isinstance(v, (int, float)):
        return "n/a"
    if unit == "ms":
        return f"{v:.2f} ms"
    if unit == "/s":
        return f"{v:,.1f}/s"
    return f"{v:.1%}"  # MFU


def markdown(result: dict, before: str, after: str) -> str:
    """The gate as a Markdown section: its result, then a row per tracked figure."""
    lines = [f"### diag gate: {RESULT_LABEL[result['result']]}", "",
             f"BEFORE {md_code(before)}, AFTER {md_code(after)}; a figure fails when its whole noise band is "
             f"worse than the limit ({result['limit']:.0%}).", ""]
    if result["result"] == "not_comparable":
        lines += ["The runs cannot be compared:", ""] + [f"- {md_text(r)}" for r in result["reasons"]]
    else:
        lines += ["| figure | before | after | change | noise band | limit | result |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        for f in result["figures"]:
            after_cell = _value(f["after"], f["unit"])
            lines.append(f"| {md_text(f['name'])} | {_value(f['before'], f['unit'])} | {after_cell} "
                         f"| {f['change']:+.1%} | {f['band'][0]:+.1%} to {f['band'][1]:+.1%} | {f['limit']:+.0%} "
                         f"| {'**worse**' if f['worse'] else 'ok'} |")
    if result.get("notes"):
        lines += [""] + [f"- {md_text(n)}" for n in result["notes"]]
    return "\n".join(lines) + "\n"


def junit(result: dict) -> bytes:
    """JUnit XML: a test suite `diag.gate` with one case per figure (a failure where it got
    worse), or one failing case `comparable` that says what differs."""
    suite = ET.Element("testsuite", name="diag.gate")
    failed = []
    if result["result"] == "not_comparable":
        case = ET.SubElement(suite, "testcase", classname="diag.gate", name="comparable")
        ET.SubElement(case, "failure", message="the runs are not comparable").text = "\n".join(result["reasons"])
        failed.append(True)
    for f in result["figures"]:
        case = ET.SubElement(suite, "testcase", classname="diag.gate", name=f["name"])
        if f["worse"]:
            ET.SubElement(case, "failure", message=f"{f['name']} {f['change']:+.1%}").text = (
                f"{f['name']} changed {f['change']:+.1%}: its noise band {f['band'][0]:+.1%} to "
                f"{f['band'][1]:+.1%} lies beyond the limit {f['limit']:+.0%}")
        failed.append(bool(f["worse"]))
    suite.set("tests", str(len(failed)))
    suite.set("failures", str(sum(failed)))
    return ET.tostring(suite, encoding="utf-8", xml_declaration=True)
