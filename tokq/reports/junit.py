"""JUnit XML: one test case per rule, so CI systems list each threshold as a passed or failed test."""

from __future__ import annotations

from xml.etree import ElementTree as ET


def junit_xml(suite: str, rules: list[dict]) -> str:
    """`rules`: dicts with name, bucket (or None), threshold, passed, rule (the one-line reason) and result ("pass",
    "fail" or "inconclusive"; without it, passed decides). A failed rule is a <failure>; an inconclusive one, which
    the data could not decide, is an <error type="inconclusive">: CI lists it apart from the failures, and neither
    as passed."""
    def result(r: dict) -> str:
        return r.get("result") or ("pass" if r["passed"] else "fail")

    failures = sum(result(r) == "fail" for r in rules)
    errors = sum(result(r) == "inconclusive" for r in rules)
    root = ET.Element("testsuites", tests=str(len(rules)), failures=str(failures), errors=str(errors))
    node = ET.SubElement(root, "testsuite", name=suite, tests=str(len(rules)), failures=str(failures),
                         errors=str(errors))
    for r in rules:
        case = ET.SubElement(node, "testcase", classname=suite,
                             name=f"{r['name']} {r['threshold']} ({r.get('bucket') or 'overall'})")
        if result(r) == "fail":
            ET.SubElement(case, "failure", message=r["rule"], type="fail").text = r["rule"]
        elif result(r) == "inconclusive":
            ET.SubElement(case, "error", message=r["rule"], type="inconclusive").text = r["rule"]
        else:
            ET.SubElement(case, "system-out").text = r["rule"]
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"
